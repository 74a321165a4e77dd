"""Every method's greedy output equals plain autoregressive decoding, token for token."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce.errors import TriforceError
from triforce.generate import generate, generate_ar
from triforce.speculation.settings import SpecConfig
from triforce.speculation.stack import METHODS, StackSpec

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


CASES = [(m, d) for m in METHODS if m != "triforce" for d in ["-"]] + [("triforce", d) for d in ("ngram", "streaming", "draft")]


@pytest.mark.parametrize("method,drafter", CASES)
@pytest.mark.parametrize("n_prompt,seed", [(200, 0), (333, 1), (90, 2)])
def test_greedy_equals_ar(target, small_draft, method, drafter, n_prompt, seed):
    prompt = _prompt(n_prompt, seed)
    ref = generate_ar(target, prompt, 64, config=TINY_SPEC).tokens  # the same prefill chunks
    cfg = TINY_SPEC if drafter == "-" else SpecConfig(**{**TINY_SPEC.__dict__, "draft": drafter})
    res = generate(target, prompt, 64, method=method, config=cfg, draft_model=small_draft)
    assert res.tokens == ref
    assert res.method == method
    top = res.stats["levels"][0]
    if method != "ar" and not res.stats.get("notes"):
        assert top["rounds"] >= 1 and top["proposed"] >= top["accepted"] >= 0
        assert 0 <= top["acceptance_rate"] <= 1


def test_hierarchy_levels_and_rebuilds(target):
    """TriForce as given (--no-adapt) has three levels; the retrieval cache is rebuilt as generation goes on."""
    prompt = _prompt(300, 3)
    res = generate(target, prompt, 80, method="triforce", config=replace(TINY_SPEC, adapt=False))
    names = [lvl["level"] for lvl in res.stats["levels"]]
    assert names == ["full", "retrieval", "ngram"]
    assert res.stats["retrieval_rebuilds"] >= 1 + 80 // TINY_SPEC.rebuild_every - 1


def test_ngram_shortcut_keeps_greedy_exact(smollm, all_threads):
    """Text the embedded model copies (a passage given twice): once the n-gram drafts of a match length are
    accepted, the top verifies them itself (shortcut rounds), the retrieval level catching up when next used;
    the output stays ar's. 0 turns it off."""
    from triforce.corpus import demo_tokens

    model = smollm.model
    passage = demo_tokens(smollm.tokenizer, 400)
    prompt = passage + passage[:40]
    cfg = SpecConfig(budget=256, recent=32, rebuild_every=32, adapt=False)  # the stack as given: its shortcut
    ref = generate(model, prompt, 64, method="ar").tokens
    on = generate(model, prompt, 64, method="triforce", config=cfg)
    off = generate(model, prompt, 64, method="triforce", config=replace(cfg, ngram_shortcut=0.0))
    assert on.tokens == ref and off.tokens == ref
    top, middle, _ = on.stats["levels"]
    assert 0 < top["shortcut_rounds"] < top["rounds"], top
    assert middle["rounds"] > 0 and top["shortcut_rate_by_match"], (middle, top)
    assert "shortcut_rounds" not in off.stats["levels"][0]
    assert off.stats["levels"][1]["forwards"] > middle["forwards"]  # the rounds it skipped


def test_ngram_shortcut_counts_what_a_direct_round_accepts():
    """A round's n-gram proposal against the tokens the round emitted: the matching prefix is what a direct
    verification accepts (all of it, then the bonus token, when the proposal is shorter than the emission);
    past the emitted tokens nothing is known, so a longer proposal that matched them all counts that far."""
    from triforce.speculation.shortcut import NGramShortcut

    shortcut = NGramShortcut(None, 0.6)
    for proposal, n, emitted, expected in [([5, 6, 7, 8], 3, [5, 6, 9], (4, 2)),  # rejected at the third
                                          ([5, 6, 7, 8], 3, [5, 6, 7, 8, 1], (4, 4)),  # all accepted, bonus
                                          ([5, 6, 7, 8], 3, [4], (4, 0)),
                                          ([5, 6, 7, 8], 2, [5, 6], (2, 2)),  # a round through the middle: 2 known
                                          ([], 0, [5], None)]:
        shortcut._lookahead = (proposal, n)
        before = {k: list(v) for k, v in shortcut._history.items()}
        shortcut.remember(emitted)
        added = [x for k, v in shortcut._history.items() for x in list(v)[len(before.get(k, [])):]]
        assert added == ([expected] if expected else []), (proposal, emitted)
    assert shortcut.rate(3) is None  # three proposals of 3-grams remembered: fewer than MIN_HISTORY
    shortcut._lookahead = ([1, 2], 3)
    shortcut.remember([1, 2, 3])
    assert shortcut.rate(3) == (2 + 4 + 0 + 2) / (4 + 4 + 4 + 2)


def test_ngram_shortcut_alternating_routes_keep_greedy_exact(target, monkeypatch):
    """Every other round verified directly: each middle level catches up over the tokens it skipped."""
    from triforce.speculation.shortcut import NGramShortcut

    calls = []

    def every_other(self, n):
        calls.append(n)
        return 1.0 if len(calls) % 2 else 0.0

    monkeypatch.setattr(NGramShortcut, "rate", every_other)
    for seed, n_prompt in [(0, 200), (2, 90)]:
        prompt = _prompt(n_prompt, seed)
        stack = StackSpec.parse("ngram,streaming:24,retrieval:40,full", "2,2,4")
        res = generate(target, prompt, 64, stack=stack, config=TINY_SPEC)
        assert res.tokens == generate_ar(target, prompt, 64, config=TINY_SPEC).tokens
        top = res.stats["levels"][0]
        assert 0 < top["shortcut_rounds"] < top["rounds"]


def test_short_prompt_degrades_to_full_cache(target):
    prompt = _prompt(30, 4)
    res = generate(target, prompt, 20, method="triforce", config=replace(TINY_SPEC, adapt=False))
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


# user-composed stacks (bottom to top; gammas per boundary or one for all) on the tiny model
USER_STACKS = [
    ("streaming:24,full", "3"),
    ("ngram,retrieval:40,full", "2,4"),
    ("draft,streaming,full", "2,3"),
    ("ngram,streaming:24,retrieval:40,retrieval:96,full", "2,2,3,4"),
    ("retrieval:96,retrieval:40,full", "3"),  # a larger budget below a smaller one: odd, still exact
    ("ngram,draft,retrieval,full", "3,2,5"),
    ("ngram,kv4,full", "3"),  # QuantSpec's draft: the target reading its cache at 4 bits
    ("ngram,kv4,retrieval:40,full", "2,3,4"),
    ("kv4,streaming:24,full", "2,3"),
    ("ngram,h2o:40,full", "2,4"),  # H2O: heavy hitters of the last queries + the recent window
    ("streaming:24,h2o:40,retrieval:96,full", "2,2,3"),
]


@pytest.mark.parametrize("levels,gammas", USER_STACKS)
@pytest.mark.parametrize("n_prompt,seed", [(200, 0), (333, 1)])
def test_user_stacks_equal_ar(target, small_draft, levels, gammas, n_prompt, seed):
    prompt = _prompt(n_prompt, seed)
    ref = generate_ar(target, prompt, 64).tokens
    stack = StackSpec.parse(levels, gammas)
    res = generate(target, prompt, 64, stack=stack, config=TINY_SPEC, draft_model=small_draft)
    assert res.tokens == ref
    assert res.method == levels and res.stats["stack"] == levels and not res.stats.get("notes")
    names = [lvl["level"] for lvl in res.stats["levels"]]
    assert names == [str(lvl) for lvl in reversed(stack.levels)]  # top first, every level ran
    for lvl in res.stats["levels"][:-1]:
        assert lvl["rounds"] >= 1 and lvl["proposed"] >= lvl["accepted"] >= 0


def test_stack_text_round_trips_and_methods_are_stacks():
    from triforce.speculation.stack import method_stack

    for levels, gammas in USER_STACKS:
        s = StackSpec.parse(levels, gammas)
        assert StackSpec.parse(s.levels_text, ",".join(map(str, s.gammas))) == s
    assert str(method_stack("ar")) == "full"
    assert str(method_stack("triforce", 4, 3)) == "ngram,retrieval,full --gammas 3,4"
    assert str(method_stack("triforce", 4, 3, "streaming", 1024)) == "streaming,retrieval:1024,full --gammas 3,4"
    assert str(method_stack("ngram", 5)) == "ngram,full --gammas 5"


@pytest.mark.parametrize("levels,gammas,words", [
    ("ngram,retrieval", None, ["no 'full' level"]),
    ("full,retrieval", None, ["does not end with 'full'"]),
    ("full,full", None, ["more than once"]),
    ("medusa,full", None, ["unknown level kind 'medusa'"]),
    ("retrieval,ngram,full", None, ["'ngram' can only be the bottom level"]),
    ("ngram:64,full", None, ["takes no budget"]),
    ("retrieval:lots,full", None, ["not an integer"]),
    ("ngram,retrieval,full", "1,2,3", ["3 values for 2 boundaries"]),
    ("ngram,retrieval,full", "0", [">= 1"]),
    ("ngram,streaming,streaming,streaming,retrieval,full", None, ["1 to 5 levels"]),
])
def test_invalid_stacks_are_user_errors(levels, gammas, words):
    with pytest.raises(TriforceError) as e:
        StackSpec.parse(levels, gammas)
    for w in words:
        assert w in str(e.value)
    assert "valid stacks" in str(e.value) or ">= 1" in str(e.value)


def test_budgets_are_checked_against_the_model(target):
    with pytest.raises(TriforceError, match="larger than the model.s context"):
        generate(target, _prompt(100, 6), 4, stack="retrieval:5000,full", config=TINY_SPEC)
    with pytest.raises(TriforceError, match="smaller than the StreamingLLM sink"):
        generate(target, _prompt(100, 6), 4, stack="streaming:4,full", config=TINY_SPEC)  # sink 4: no window


def test_streaming_chunks_are_the_result(target):
    from triforce.generate import generate_stream

    prompt = _prompt(200, 0)
    stream = generate_stream(target, prompt, 40, stack="ngram,retrieval:40,full", config=TINY_SPEC)
    chunks = [c.tokens for c in stream]
    assert sum(chunks, []) == stream.result.tokens == generate_ar(target, prompt, 40).tokens
    assert len(chunks) > 1 and all(chunks)


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


# user-composed stacks on the embedded model: 2, 3 and 5 levels, two retrieval levels of different budgets
USER_STACKS_EMBEDDED = [("streaming:256,full", "5"), ("ngram,retrieval:1024,full", "3,4"),
                        ("ngram,streaming,retrieval:512,retrieval:1024,full", "2,2,3,4")]


def _code_tokens(tokenizer, n: int) -> list[int]:
    """n tokens of Python source: the standard library's argparse and json modules."""
    import argparse
    import json.decoder

    text = "".join(Path(m.__file__).read_text() for m in (argparse, json.decoder))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("n_prompt,offset", [(2048, 0), (3000, 250_000), (6000, 600_000), (4000, "code")])
def test_greedy_equals_ar_on_embedded_model(smollm, all_threads, n_prompt, offset):
    """Real text at 2K-6K tokens with the embedded SmolLM2, prose (Shakespeare) and code (Python):
    every method and the user stacks below = ar."""
    from triforce.corpus import demo_tokens

    model = smollm.model
    if offset == "code":
        prompt = _code_tokens(smollm.tokenizer, n_prompt)
    else:
        prompt = demo_tokens(smollm.tokenizer, n_prompt, offset_chars=offset)
    assert_every_stack_equals_ar(model, prompt, 24, ("triforce", "retrieval", "streaming", "ngram", "sequoia"),
                                 USER_STACKS_EMBEDDED)


def assert_every_stack_equals_ar(model, prompt: list[int], new: int, methods, user_stacks) -> None:
    """ar's `new` greedy tokens from every named method (triforce also with a streaming bottom drafter) and
    every user stack (levels, gammas), one prefill shared; a retrieval budget well below the prompt, so the
    retrieval level really drops most of the context."""
    from triforce.speculation.builder import full_capacity
    from triforce.speculation.stack import method_stack
    from triforce.speculation.state import PrefilledPrompt

    cfg = SpecConfig(budget=512, recent=32, rebuild_every=16, window=128, sink=4)
    runs = [(m, "ngram") for m in methods] + [("triforce", "streaming")] * ("triforce" in methods)
    stacks = [method_stack(m, cfg.gamma, cfg.gamma_draft) for m, _ in runs]
    stacks += [StackSpec.parse(levels, gammas) for levels, gammas in user_stacks]
    shared = PrefilledPrompt(model, prompt, max(full_capacity(len(prompt), new, s) for s in stacks))
    ref = generate(model, prompt, new, method="ar", prefilled=shared).tokens
    for method, drafter in runs:
        res = generate(model, prompt, new, method=method, config=SpecConfig(**{**cfg.__dict__, "draft": drafter}),
                       prefilled=shared)
        assert res.tokens == ref, (method, drafter)
    for levels, gammas in user_stacks:
        res = generate(model, prompt, new, stack=StackSpec.parse(levels, gammas), config=cfg, prefilled=shared)
        assert res.tokens == ref, levels


# Sequoia trees drafted by the bottom model level (widths per depth), under the full level or a middle one
TREE_STACKS = [("streaming:24,full", "3", "3,2,1"), ("retrieval:40,full", "4", "2,2,2"), ("draft,full", "4", "4,1,1,1"),
               ("streaming:24,retrieval:40,full", "3,4", "2,1,1"), ("draft,retrieval:96,full", "2,3", "1,1,1,1"),
               ("h2o:40,full", "3", "2,2,1")]


@pytest.mark.parametrize("levels,gammas,tree", TREE_STACKS)
@pytest.mark.parametrize("n_prompt,seed", [(200, 0), (333, 1)])
def test_tree_stacks_equal_ar(target, small_draft, levels, gammas, tree, n_prompt, seed):
    prompt = _prompt(n_prompt, seed)
    ref = generate_ar(target, prompt, 64).tokens
    stack = StackSpec.parse(levels, gammas, tree=tree)
    res = generate(target, prompt, 64, stack=stack, config=TINY_SPEC, draft_model=small_draft)
    assert res.tokens == ref
    bottom_verifier = res.stats["levels"][-2]  # the level that verified the trees
    assert bottom_verifier["rounds"] >= 1 and bottom_verifier["proposed"] >= stack.tree_nodes


@pytest.mark.parametrize("levels,tree,words", [
    ("ngram,full", "2,2", ["needs a model at the bottom"]),
    ("full", "2", ["needs a model at the bottom"]),
    ("streaming,full", "8,8", ["72 nodes", "at most 64"]),
    ("streaming,full", "2,0", [">= 1"]),
    ("streaming,full", "2,x", ["integers separated by commas"]),
])
def test_invalid_trees_are_user_errors(levels, tree, words):
    with pytest.raises(TriforceError) as e:
        StackSpec.parse(levels, None, tree=tree)
    for w in words:
        assert w in str(e.value)
