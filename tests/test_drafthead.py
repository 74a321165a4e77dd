"""A trained draft head at the bottom of a stack: lossless (greedy: ar's tokens; sampled: the target's distribution,
with a wrong sampler caught), reading the features the levels above computed; saved and loaded atomically, refused
with a clear error for another model."""
from __future__ import annotations

import json

import pytest
import torch

import triforce.speculation.kinds as kinds_mod
from conftest import hf_tiny, ours_from_hf
from test_speculation_distribution import ALPHA, POSITIONS, V, exact_marginals, p_values
from triforce.drafthead.drafter import HeadDrafter
from triforce.drafthead.data import generate_shard, save_atomic
from triforce.drafthead.head import DraftHead, HeadConfig
from triforce.drafthead.loading import load_head
from triforce.drafthead.train import Trainer, TrainSettings
from triforce.errors import TriforceError
from triforce.generate import generate
from triforce.sampling import SamplingParams
from triforce.speculation.settings import SpecConfig

CFG = dict(gamma=3, gamma_draft=2, budget=20, chunk_size=4, recent=4, rebuild_every=8, sink=2, window=6, ngram=2,
           prefill_chunk=64, adapt=False)


def make_head(model, path, seed=0, window=64):
    """A head started as the identity (it drafts the token the last feature predicts) with a perturbed layer, so
    that its q overlaps the target's p without equalling it."""
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.for_target(model, window=window), model.cfg)
    head.init_from(model)
    with torch.no_grad():
        head.layer.wo.weight.normal_(0, 0.05)
        head.fc.weight[:, : model.cfg.hidden_size].normal_(0, 0.05)
    head.save(path)
    return path


@pytest.fixture(scope="module")
def target():
    return ours_from_hf(hf_tiny("llama", seed=21, vocab_size=V, initializer_range=0.5, max_position_embeddings=256))


def fit_head(model, out, steps_per_epoch=16, epochs=8, seed=0):
    """A head trained briefly on the model's own sampled text (Trainer, minus the prompt corpus: random prompts)."""
    settings = TrainSettings(tokens=4 * 16 * 40, shard_prompts=16, new_tokens=40, epochs=epochs, batch=4, lr=3e-3,
                             unroll=2, window=64, seed=seed)
    trainer = Trainer(model, None, out, settings, progress=False)
    trainer.data_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(settings.shards):
        prompts = torch.randint(0, model.cfg.vocab_size, (16, 16), generator=g).tolist()
        save_atomic(generate_shard(model, prompts, 40, 1.0, g), trainer.data_dir / f"shard-{i:05d}.pt")
    head = trainer.train()
    head.save(out)
    return out, trainer.history


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    return fit_head(target, tmp_path_factory.mktemp("head"))


@pytest.fixture(scope="module")
def head_dir(trained):
    return trained[0]


def test_training_raises_the_heads_agreement_with_the_target(trained):
    history = trained[1]
    first = sum(h["acc0"] for h in history[:8]) / 8
    last = sum(h["acc0"] for h in history[-8:]) / 8
    assert last > first + 0.1, (first, last)


@pytest.fixture(scope="module")
def prompt():
    base = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    return (base * 4)[:48]


@pytest.mark.parametrize("stack", ["head,full", "head,retrieval,full", "head,kv4,full", "head,streaming,full"])
def test_greedy_output_with_a_head_at_the_bottom_is_ar_output(tiny_llama, tmp_path, stack):
    model = tiny_llama
    prompt = torch.randint(0, model.cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    config = SpecConfig(**CFG, head=str(make_head(model, tmp_path)))
    ar = generate(model, prompt, 40, SamplingParams(), method="ar")
    res = generate(model, prompt, 40, SamplingParams(), stack=stack, config=config)
    assert res.tokens == ar.tokens
    head = res.stats["levels"][-1]
    assert head["level"] == "head" and head["tokens"] > 0 and head["catch_up_rows"] > 0


def test_the_head_reads_features_of_every_position_it_feeds(tiny_llama, tmp_path):
    """Catching up after each round needs the verifier's features of the accepted tokens: every drafting round
    but the first finds them (no reset of the head's cache mid-run)."""
    model = tiny_llama
    prompt = torch.randint(0, model.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    config = SpecConfig(**CFG, head=str(make_head(model, tmp_path)))
    resets = []
    original = HeadDrafter._reset
    try:
        HeadDrafter._reset = lambda self, start: (resets.append(start), original(self, start))[1]
        generate(model, prompt, 30, SamplingParams(), stack="head,full", config=config)
    finally:
        HeadDrafter._reset = original
    assert len(resets) == 1


def sampled(target, prompt, stack, head_dir, runs=1000):
    """Token counts per position over `runs` seeds at temperature 1, and the drafts the head's verifier accepted."""
    config = SpecConfig(**CFG, head=str(head_dir))
    counts = torch.zeros(POSITIONS, V)
    accepted = 0
    for seed in range(runs):
        res = generate(target, prompt, POSITIONS, SamplingParams(temperature=1.0), stack=stack, config=config, seed=seed)
        for i, t in enumerate(res.tokens):
            counts[i, t] += 1
        accepted += res.stats["levels"][-2]["accepted"]  # the head's verifier
    return counts, accepted


@pytest.mark.slow  # statistical tests beyond one per family (pyproject.toml's `slow` marker)
@pytest.mark.parametrize("stack", ["head,full", "head,retrieval,full"])
def test_sampled_tokens_with_a_head_follow_the_target_distribution(target, head_dir, prompt, stack):
    exact = exact_marginals(target, prompt, SamplingParams(temperature=1.0))
    counts, accepted = sampled(target, prompt, stack, head_dir)
    pv = p_values(counts, exact)
    assert min(pv) > ALPHA, f"chi-square p-values {pv}"
    assert accepted > 100  # the head's drafts were accepted often enough for the check to test them


class SharpeningHead(HeadDrafter):
    """A wrong sampler: it draws from q sharpened (q^2, renormalised) but reports q as the proposal."""

    def propose(self, ctx, committed, k):
        tokens, q = super().propose(ctx, committed, k)
        if q is None:
            return tokens, q
        g = torch.Generator().manual_seed(len(ctx) * 31 + committed)
        sharp = q ** 2 / (q ** 2).sum(-1, keepdim=True)
        tokens = [int(torch.multinomial(row, 1, generator=g)) for row in sharp]
        return tokens, q


@pytest.mark.slow
def test_the_distribution_check_catches_a_head_that_misreports_its_proposal(target, head_dir, prompt, monkeypatch):
    monkeypatch.setattr(kinds_mod, "HeadDrafter", SharpeningHead)  # what the head kind builds
    exact = exact_marginals(target, prompt, SamplingParams(temperature=1.0))
    counts, _ = sampled(target, prompt, "head,full", head_dir)
    assert min(p_values(counts, exact)) < ALPHA


def test_a_saved_head_loads_back_equal(tiny_llama, tmp_path):
    path = make_head(tiny_llama, tmp_path / "h")
    head = load_head(path, tiny_llama)
    again = DraftHead(HeadConfig.for_target(tiny_llama, window=64), tiny_llama.cfg)
    torch.manual_seed(0)
    from safetensors.torch import load_file

    sd = load_file(str(path / "head.safetensors"))
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in sd.items())
    assert not list(path.glob("*.tmp"))  # written under temporary names, then renamed
    assert again.cfg.target == head.cfg.target


def test_a_head_for_another_model_is_refused_with_a_clear_error(tiny_llama, tmp_path):
    path = make_head(tiny_llama, tmp_path / "h")
    other = ours_from_hf(hf_tiny("llama", seed=3, hidden_size=48, intermediate_size=96))
    with pytest.raises(TriforceError, match="hidden size"):
        load_head(path, other)
    cfg = json.loads((path / "config.json").read_text())
    cfg["target"] = "qwen2-hidden32-layers2-heads4x8-vocab256"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TriforceError, match="trained for another model"):
        load_head(path, tiny_llama)


def test_a_head_level_without_a_head_for_the_model_says_how_to_get_one(tiny_llama):
    prompt = list(range(20))
    with pytest.raises(TriforceError, match="train-drafter"):
        generate(tiny_llama, prompt, 4, SamplingParams(), stack="head,full", config=SpecConfig(**CFG))


def test_a_damaged_head_file_is_refused(tiny_llama, tmp_path):
    path = make_head(tiny_llama, tmp_path / "h")
    (path / "head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(TriforceError, match="cannot read the draft head"):
        load_head(path, tiny_llama)


def test_head_is_a_bottom_only_kind(tiny_llama, tmp_path):
    config = SpecConfig(**CFG, head=str(make_head(tiny_llama, tmp_path)))
    with pytest.raises(TriforceError, match="bottom"):
        generate(tiny_llama, list(range(20)), 4, SamplingParams(), stack="ngram,head,full", config=config)
    assert "head" in kinds_mod.KIND_CLASSES


def test_an_interrupted_training_resumes_to_the_same_head(target, tmp_path, monkeypatch):
    """Checkpoints are atomic and hold everything (weights, optimiser, schedule, step; the batch order follows from
    the seed): a run stopped mid-way (Ctrl-C, or kill -9 with the checkpoint on disk) and run again ends with the
    head an uninterrupted run makes, bit for bit. A half-written checkpoint (.tmp) left by a kill is ignored."""
    import triforce.drafthead.train as train_mod

    monkeypatch.setattr(train_mod, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint after every step
    whole, _ = fit_head(target, tmp_path / "whole", epochs=2)
    calls = {"n": 0}
    original = Trainer.loss

    def stopping(self, *a):
        calls["n"] += 1
        if calls["n"] == 21:
            raise KeyboardInterrupt
        return original(self, *a)

    monkeypatch.setattr(Trainer, "loss", stopping)
    with pytest.raises(KeyboardInterrupt):
        fit_head(target, tmp_path / "resumed", epochs=2)
    (tmp_path / "resumed" / "work" / "checkpoint.pt.tmp").write_bytes(b"half a file")
    monkeypatch.setattr(Trainer, "loss", original)
    resumed, history = fit_head(target, tmp_path / "resumed", epochs=2)
    assert len(history) == 32 and calls["n"] == 21
    from safetensors.torch import load_file

    a, b = load_file(str(whole / "head.safetensors")), load_file(str(resumed / "head.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("seed", [0, 1])
def test_an_adaptive_head_stack_switching_routes_keeps_greedy_output(tiny_llama, tmp_path, seed):
    """The planner may run the head under the retrieval level, under the full level directly, or not at all: every
    route (forced per round, with several gammas) gives ar's tokens, and the head is timed as the bottom level."""
    import dataclasses
    import random

    from triforce.speculation.routes import Route
    from triforce.speculation.stack import StackSpec

    model = tiny_llama
    prompt = torch.randint(0, model.cfg.vocab_size, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    config = SpecConfig(**{**CFG, "adapt": True}, head=str(make_head(model, tmp_path)))
    stack = dataclasses.replace(StackSpec.parse("head,retrieval,full", "2,3"), adaptive=True)

    def force(r):
        rng = random.Random(r * 7919 + seed)
        fam = rng.choice([(2,), (0, 2), (1, 2), (0, 1, 2)])
        return Route(fam, tuple(rng.randint(1, 4) for _ in fam[1:]))

    ar = generate(model, prompt, 48, SamplingParams(), method="ar")
    res = generate(model, prompt, 48, SamplingParams(), stack=stack, config=config, force_route=force)
    assert res.tokens == ar.tokens
    assert {r.split("@")[0] for r in res.stats["adaptive"]["routes"]} == {"full", "head,full", "retrieval,full",
                                                                           "head,retrieval,full"}
    free = generate(model, prompt, 48, SamplingParams(), stack=stack, config=config)  # the planner's own choices
    assert free.tokens == ar.tokens


@pytest.mark.parametrize("levels,tree", [("head,full", "2,2,1"), ("head,retrieval,full", "3,1"),
                                         ("head,kv4,full", "2,2")])
def test_greedy_output_with_head_trees_is_ar_output(tiny_llama, tmp_path, levels, tree):
    from triforce.speculation.stack import StackSpec

    model = tiny_llama
    prompt = torch.randint(0, model.cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    config = SpecConfig(**CFG, head=str(make_head(model, tmp_path)))
    ar = generate(model, prompt, 40, SamplingParams(), method="ar")
    res = generate(model, prompt, 40, SamplingParams(), stack=StackSpec.parse(levels, "2", tree=tree), config=config)
    assert res.tokens == ar.tokens
    assert res.stats["levels"][-2]["tree_nodes"] > 0


@pytest.mark.slow
def test_sampled_tokens_with_head_trees_follow_the_target_distribution(target, head_dir, prompt):
    from triforce.speculation.stack import StackSpec

    exact = exact_marginals(target, prompt, SamplingParams(temperature=1.0))
    counts, accepted = sampled(target, prompt, StackSpec.parse("head,full", "2", tree="3,2"), head_dir)
    assert min(p_values(counts, exact)) > ALPHA
    assert accepted > 100


class FlatteningTreeHead(HeadDrafter):
    """A wrong tree sampler: it draws the children from q but reports q flattened towards uniform."""

    def propose_tree(self, ctx, committed, template):
        tree, q = super().propose_tree(ctx, committed, template)
        if q is not None:
            live = q.sum(-1, keepdim=True) > 0
            q = torch.where(live, 0.3 * q + 0.7 / q.shape[-1], q)
        return tree, q


@pytest.mark.slow
def test_the_distribution_check_catches_a_tree_head_that_misreports_its_proposal(target, head_dir, prompt,
                                                                                  monkeypatch):
    from triforce.speculation.stack import StackSpec

    monkeypatch.setattr(kinds_mod, "HeadDrafter", FlatteningTreeHead)  # what the head kind builds
    exact = exact_marginals(target, prompt, SamplingParams(temperature=1.0))
    counts, _ = sampled(target, prompt, StackSpec.parse("head,full", "2", tree="3,2"), head_dir)
    assert min(p_values(counts, exact)) < ALPHA


def test_tune_prices_a_head_stack_from_its_measured_cost_and_acceptance(tiny_llama, tmp_path):
    from triforce.speculation.state import PrefilledPrompt
    from triforce.tuning.tune import tune_head

    model = tiny_llama
    prompt = torch.randint(0, model.cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    shared = PrefilledPrompt(model, prompt, 64 + 40)
    cost_full = {k: 1.0 + 0.1 * k for k in range(1, 8)}
    out = tune_head(model, shared, prompt, cost_full, 4, SpecConfig(**CFG, head=str(make_head(model, tmp_path))),
                    16, 0.0, 0, log=lambda m: None)
    assert 0.0 <= out["acceptance"] <= 1.0 and out["cost_head_ms_per_token"] > 0
    assert [r["predicted_ms_per_token"] for r in out["top"]] == sorted(r["predicted_ms_per_token"] for r in out["top"])
    assert tune_head(model, shared, prompt, cost_full, 4, SpecConfig(**CFG), 16, 0.0, 0) is None  # no head: no row
