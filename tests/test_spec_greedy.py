"""Every method's greedy output equals plain autoregressive decoding, token for token."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce.errors import TriforceError
from triforce.generate import generate, generate_ar
from triforce.spec.methods import METHODS, SpecConfig

TINY_SPEC = SpecConfig(gamma=4, gamma_draft=2, budget=48, chunk_size=8, recent=8, rebuild_every=16,
                       sink=4, window=16, ngram=3, prefill_chunk=64)


@pytest.fixture(scope="module")
def target():
    return ours_from_hf(hf_tiny("llama", seed=11, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def small_draft():
    return ours_from_hf(hf_tiny("llama", seed=12, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                max_position_embeddings=1024))


def _prompt(n, seed, repeat=True):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 96, (n // 4 if repeat else n,), generator=g).tolist()
    return (base * 4)[:n] if repeat else base  # repetition gives the n-gram drafter something to find


CASES = [(m, d) for m in METHODS if m != "triforce" for d in ["-"]] + [("triforce", d) for d in ("ngram", "streaming", "model")]


@pytest.mark.parametrize("method,drafter", CASES)
@pytest.mark.parametrize("n_prompt,seed", [(200, 0), (333, 1), (90, 2)])
def test_greedy_equals_ar(target, small_draft, method, drafter, n_prompt, seed):
    prompt = _prompt(n_prompt, seed)
    ref = generate_ar(target, prompt, 64).tokens
    cfg = TINY_SPEC if drafter == "-" else SpecConfig(**{**TINY_SPEC.__dict__, "draft": drafter})
    res = generate(target, prompt, 64, method=method, config=cfg, draft_model=small_draft)
    assert res.tokens == ref
    assert res.method == method
    top = res.stats["levels"][0]
    if method != "ar" and not res.stats.get("notes"):
        assert top["rounds"] >= 1 and top["proposed"] >= top["accepted"] >= 0
        assert 0 <= top["acceptance_rate"] <= 1


def test_hierarchy_levels_and_rebuilds(target):
    """TriForce has three levels; the retrieval cache is rebuilt as generation goes on."""
    prompt = _prompt(300, 3)
    res = generate(target, prompt, 80, method="triforce", config=TINY_SPEC)
    names = [lvl["level"] for lvl in res.stats["levels"]]
    assert names == ["full", "retrieval", "ngram"]
    assert res.stats["retrieval_rebuilds"] >= 1 + 80 // TINY_SPEC.rebuild_every - 1


def test_short_prompt_degrades_to_full_cache(target):
    prompt = _prompt(30, 4)
    res = generate(target, prompt, 20, method="triforce", config=TINY_SPEC)
    assert res.tokens == generate_ar(target, prompt, 20).tokens
    assert "fits in the retrieval budget" in res.stats["notes"][0]
    assert [lvl["level"] for lvl in res.stats["levels"]] == ["full", "ngram"]


@pytest.mark.parametrize("method", ["triforce", "ngram", "retrieval"])
def test_eos_inside_a_draft_and_exact_length(target, method):
    prompt = _prompt(240, 5)
    free = generate_ar(target, prompt, 40).tokens
    for eos_at in (3, 17, 30):
        eos = free[eos_at]
        first = free.index(eos)
        res = generate(target, prompt, 40, method=method, config=TINY_SPEC, eos_ids=(eos,))
        assert res.tokens == free[:first + 1] and res.finish_reason == "eos"
    for n in (1, 2, 7, 13):
        res = generate(target, prompt, n, method=method, config=TINY_SPEC)
        assert res.tokens == free[:n] and res.finish_reason == "length"


@pytest.mark.parametrize("draft_weights", ["bf16", "fp32"])
def test_draft_weights_keep_greedy_exact(target, draft_weights):
    """The target drafting with its bf16 weights copy (the default) or its fp32 weights: same output."""
    prompt = _prompt(200, 3)
    ref = generate_ar(target, prompt, 48).tokens
    for drafter in ("ngram", "streaming"):
        cfg = SpecConfig(**{**TINY_SPEC.__dict__, "draft": drafter, "draft_weights": draft_weights})
        assert generate(target, prompt, 48, method="triforce", config=cfg).tokens == ref


def test_bad_configurations_are_user_errors(target):
    with pytest.raises(TriforceError, match="budget"):
        generate(target, _prompt(100, 6), 4, method="triforce", config=SpecConfig(budget=4096))
    with pytest.raises(TriforceError, match="draft model"):
        generate(target, _prompt(100, 6), 4, method="draft", config=TINY_SPEC)
    with pytest.raises(TriforceError, match="batch size 1"):
        generate(target, [[1, 2], [3, 4]], 4)
    with pytest.raises(TriforceError, match="unknown method"):
        generate(target, [1, 2], 4, method="medusa")
    with pytest.raises(TriforceError, match="--draft-weights"):
        generate(target, _prompt(100, 6), 4, method="triforce", config=SpecConfig(**{**TINY_SPEC.__dict__, "draft_weights": "int4"}))


@pytest.mark.parametrize("n_prompt,offset", [(2048, 0), (3000, 250_000), (6000, 600_000)])
def test_greedy_equals_ar_on_embedded_model(smollm, all_threads, n_prompt, offset):
    """Real text (Shakespeare) at 2K-6K tokens with the embedded SmolLM2: every method = ar."""
    from triforce.corpus import demo_tokens
    from triforce.spec.methods import SharedPrefill

    model = smollm.model
    prompt = demo_tokens(smollm.tokenizer, n_prompt, offset_chars=offset)
    new = 24
    # a budget well below the prompt, so the retrieval level really drops most of the context
    cfg = SpecConfig(budget=512, recent=32, rebuild_every=16, window=128, sink=4)
    shared = SharedPrefill(model, prompt, n_prompt + new + cfg.gamma + 2)
    ref = generate(model, prompt, new, method="ar", shared_prefill=shared).tokens
    for method, drafter in [("triforce", "ngram"), ("triforce", "streaming"), ("retrieval", "ngram"),
                            ("streaming", "ngram"), ("ngram", "ngram")]:
        res = generate(model, prompt, new, method=method, config=SpecConfig(**{**cfg.__dict__, "draft": drafter}),
                       shared_prefill=shared)
        assert res.tokens == ref, (method, drafter)
