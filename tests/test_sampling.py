"""Sampling: temperature, top-k, top-p semantics and seeded reproducibility."""
from __future__ import annotations

import pytest
import torch

from triforce.errors import TriforceError
from triforce.generate import generate_ar
from triforce.sampling import SamplingParams, make_generator, probs_from_logits, sample


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    p = probs_from_logits(logits, SamplingParams(0.0))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(1.0)), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # top-k 2 renormalises the two largest
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(1.0, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]))
    # top-p 0.8: mass before the 3rd token is 0.8 -> dropped; before the 2nd is 0.5 -> kept
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(1.0, top_p=0.8)), torch.tensor([0.625, 0.375, 0, 0]))
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(1.0, top_p=0.81)),
                               torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    # temperature 2 flattens: p ~ sqrt(p)
    flat = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(2.0)), flat / flat.sum())


def test_sampling_frequencies_follow_probs():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    g = make_generator(0)
    draws = sample(p.expand(40000, 4), g)
    freq = torch.bincount(draws, minlength=4).float() / 40000
    assert (freq - p).abs().max() < 0.01


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(temperature=float("nan"))])
def test_invalid_sampling_values_are_user_errors(bad):
    with pytest.raises(TriforceError):
        SamplingParams(**bad)


@torch.no_grad()
def test_seeded_generation_is_reproducible(tiny_llama):
    params = SamplingParams(1.0, top_p=0.95)
    a = generate_ar(tiny_llama, [1, 2, 3], 30, params, seed=123).tokens
    b = generate_ar(tiny_llama, [1, 2, 3], 30, params, seed=123).tokens
    c = generate_ar(tiny_llama, [1, 2, 3], 30, params, seed=124).tokens
    assert a == b and a != c


@torch.no_grad()
def test_stops_at_eos_and_max_new_tokens(tiny_llama):
    free = generate_ar(tiny_llama, [5, 6, 7], 20, SamplingParams()).tokens
    assert len(free) == 20
    eos = free[7]
    first = free.index(eos)
    res = generate_ar(tiny_llama, [5, 6, 7], 20, SamplingParams(), eos_ids=(eos,))
    assert res.tokens == free[:first + 1] and res.finish_reason == "eos"


def test_top_p_from_candidates_equals_the_full_sort():
    """top-p decided on the top k tokens (k from TOP_P_CANDIDATES in turn, when their mass reaches top_p) gives
    bit-identical probabilities to sorting the whole row; rows whose mass is spread wider fall back to more
    candidates, then to the full sort."""
    import triforce.sampling as sampling_mod
    from triforce.sampling import SamplingParams, probs_from_logits

    def full_sort(logits, params):
        probs = torch.softmax(logits.float() / params.temperature, -1)
        sp, order = probs.sort(dim=-1, descending=True)
        sp = sp.masked_fill((sp.cumsum(-1) - sp) >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sp)
        return probs / probs.sum(-1, keepdim=True)

    g = torch.Generator().manual_seed(0)
    assert max(sampling_mod.TOP_P_CANDIDATES) < 5000
    for scale in (0.3, 1.5, 3.0, 12.0):  # flat rows (full sort) to peaked ones (candidates)
        x = torch.randn(3, 5000, generator=g) * scale
        for p in (0.5, 0.9, 0.99):
            params = SamplingParams(temperature=0.7, top_p=p)
            assert torch.equal(probs_from_logits(x, params), full_sort(x, params))
