"""Sampling is exact: every method's tokens follow the target's distribution.

Chi-square goodness-of-fit of the first three generated positions against the target's exact
marginals (computed by enumerating all continuations of a tiny 8-token vocabulary). Seeds are fixed,
so the tests are deterministic; and a deliberately wrong sampler (resampling from p instead of the
residual max(0, p - q), the research code's bug) is shown to fail the same check.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import triforce.speculation.level as level_mod
from conftest import hf_tiny, ours_from_hf
from triforce.generate import generate
from triforce.sampling import SamplingParams, Scores, make_generator, probs_from_logits, sample
from triforce.speculation.settings import SpecConfig
from triforce.speculation.shortcut import NGramShortcut
from triforce.caches import new_cache

V = 8
N_SAMPLES = 1000
POSITIONS = 3
ALPHA = 1e-3
PARAMS = SamplingParams(temperature=1.0)
CFG = SpecConfig(gamma=3, gamma_draft=2, budget=20, chunk_size=4, recent=4, rebuild_every=4, sink=2, window=6,
                 ngram=2, prefill_chunk=64)


@pytest.fixture(scope="module")
def models():
    target = ours_from_hf(hf_tiny("llama", seed=21, vocab_size=V, initializer_range=0.5, max_position_embeddings=256))
    draft = ours_from_hf(hf_tiny("llama", seed=22, vocab_size=V, initializer_range=0.5, hidden_size=32,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256))
    return target, draft


@pytest.fixture(scope="module")
def prompt():
    base = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    return (base * 4)[:48]  # repeats, so the n-gram drafter proposes


@torch.no_grad()
def exact_marginals(model, prompt, params, positions=POSITIONS) -> list[torch.Tensor]:
    """Marginal distribution of each of the first `positions` generated tokens."""
    def next_probs(ctx):
        return probs_from_logits(model(torch.tensor([ctx], device=model.device), new_cache(model, len(ctx)))[0, -1],
                                 params)

    marginals = [torch.zeros(V, dtype=torch.float64) for _ in range(positions)]
    for depth in range(positions):
        for prefix in itertools.product(range(V), repeat=depth):
            weight = 1.0
            for i in range(depth):  # probability of the prefix
                weight *= float(next_probs(prompt + list(prefix[:i]))[prefix[i]])
            if weight > 0:
                marginals[depth] += weight * next_probs(prompt + list(prefix)).double().cpu()
    return marginals


@pytest.fixture(scope="module")
def exact(models, prompt):
    return exact_marginals(models[0], prompt, PARAMS)


def sample_counts(models, prompt, method, cfg, n=N_SAMPLES, params=PARAMS, stack=None, tops=None):
    """Counts [POSITIONS, V] of the first generated tokens over n seeds; `tops`: a list that gets each run's
    top-level stats."""
    target, draft = models
    counts = torch.zeros(POSITIONS, V)
    for seed in range(n):
        res = generate(target, prompt, POSITIONS, params, method=method, stack=stack, config=cfg, draft_model=draft,
                       seed=seed)
        if tops is not None:
            tops.append(res.stats["levels"][0])
        for i, t in enumerate(res.tokens):
            counts[i, t] += 1
    return counts


def p_values(counts, exact) -> list[float]:
    out = []
    for obs, p in zip(counts, exact):
        expected = p.numpy() * float(obs.sum())
        big = expected >= 5  # pool the rare cells into one
        o = list(obs.numpy()[big]) + [obs.numpy()[~big].sum()]
        e = list(expected[big]) + [expected[~big].sum()]
        if e[-1] == 0:
            o, e = o[:-1], e[:-1]
        if len(e) == 1:  # one possible token (a narrow top-p or top-k): every draw must be it
            out.append(1.0 if o[0] == obs.sum() else 0.0)
            continue
        out.append(float(chisquare(o, e, sum_check=False).pvalue))
    return out


# The fast tier (-m "not slow") keeps one representative of each family of statistical tests; the rest of the
# family is marked slow (CI's default part runs them all).
CASES = [("triforce", "ngram")] + [pytest.param(m, d, marks=pytest.mark.slow) for m, d in [
    ("triforce", "streaming"), ("triforce", "draft"), ("retrieval", "ngram"), ("streaming", "ngram"),
    ("ngram", "ngram"), ("draft", "ngram"), ("ar", "ngram"), ("sequoia", "ngram")]]


@pytest.mark.parametrize("method,drafter", CASES)
def test_sampled_tokens_follow_target_distribution(models, prompt, exact, method, drafter):
    cfg = SpecConfig(**{**CFG.__dict__, "draft": drafter})
    pv = p_values(sample_counts(models, prompt, method, cfg), exact)
    assert min(pv) > ALPHA, f"{method}/{drafter}: chi-square p-values {pv}"


# user-composed stacks, sampled with top-k and top-p (the target's distribution is then the truncated one)
USER_STACKS = [("ngram,streaming:8,retrieval:12,full", "2,2,3", SamplingParams(temperature=0.8, top_k=5)),
               ("draft,retrieval:12,full", "2,3", SamplingParams(temperature=1.0, top_p=0.8)),
               ("streaming:8,full", "3", SamplingParams(temperature=0.7, top_k=6, top_p=0.9)),
               ("ngram,h2o:12,full", "2,3", SamplingParams(temperature=0.8, top_k=5))]


@pytest.mark.slow  # the family's representative in the fast tier: test_sampled_tokens_follow_target_distribution
@pytest.mark.parametrize("levels,gammas,params", USER_STACKS)
def test_user_stacks_follow_target_distribution(models, prompt, levels, gammas, params):
    from triforce.speculation.stack import StackSpec

    exact_p = exact_marginals(models[0], prompt, params)
    counts = sample_counts(models, prompt, None, CFG, params=params, stack=StackSpec.parse(levels, gammas))
    pv = p_values(counts, exact_p)
    assert min(pv) > ALPHA, f"{levels}: chi-square p-values {pv}"


@pytest.fixture(scope="module")
def long_prompt():
    base = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    return (base * 5)[:200]  # long enough that kv4 reads most of it from its 4-bit planes


@pytest.mark.slow
@pytest.mark.parametrize("levels,gammas,params", [("ngram,kv4,full", "2,3", SamplingParams(temperature=0.8, top_k=5))])
def test_kv4_stacks_follow_target_distribution(models, long_prompt, levels, gammas, params):
    """kv4 verifying the n-gram drafter and drafting for the full level (quantspec's kv4,full is the same
    two levels' code), over a prompt it reads mostly from its 4-bit planes. (This check has less power here
    than with the small draft model: kv4's drafts are so close to the target's distribution that the wrong
    sampler below moves kv4,full's output little, p = 0.002 at 600 samples; the rule is the one
    test_check_detects_a_wrong_sampler shows the check catches.)"""
    from triforce.caches.quant_codes import fp_from
    from triforce.speculation.stack import StackSpec

    assert fp_from(len(long_prompt)) >= 128  # most of the prompt is read quantized by the kv4 level
    exact_p = exact_marginals(models[0], long_prompt, params)
    counts = sample_counts(models, long_prompt, None, CFG, n=600, params=params, stack=StackSpec.parse(levels, gammas))
    pv = p_values(counts, exact_p)
    assert min(pv) > ALPHA, f"{levels}: chi-square p-values {pv}"


def wrong_accept(draft, q, p, generator):
    """The research code's middle-level bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    j = 0
    for i, x in enumerate(draft):
        if float(torch.rand(1, generator=generator, device=generator.device)) * float(q[i, x]) < float(p[i, x]):
            j = i + 1
        else:
            break
    return j, int(sample(p[j], generator))


def wrong_verify(tree, q, p, generator):
    """wrong_accept in the tree rule's signature (levels verify chains through verify_tree)."""
    j, nxt = wrong_accept(list(tree.tokens), q[:-1] if q is not None else None, p.probs, generator)
    return list(range(j)), nxt


def test_check_detects_a_wrong_sampler(models, prompt, exact, monkeypatch):
    monkeypatch.setattr(level_mod, "verify_tree", wrong_verify)
    pv = p_values(sample_counts(models, prompt, "triforce", SpecConfig(**{**CFG.__dict__, "draft": "draft"})), exact)
    assert min(pv) < 1e-6, f"the wrong sampler went undetected: p-values {pv}"


SHORTCUT_STACK = ("ngram,streaming:8,retrieval:12,full", "2,2,3")


@pytest.mark.slow
def test_ngram_shortcut_follows_target_distribution(models, prompt, exact, monkeypatch):
    """The top verifies the n-gram proposal itself whenever it comes from a bigram match (so the route depends
    on the sampled history), through the levels between otherwise: the tokens still follow the target."""
    from triforce.speculation.stack import StackSpec

    monkeypatch.setattr(NGramShortcut, "rate", lambda self, n: 1.0 if n == 2 else None)
    tops: list[dict] = []
    pv = p_values(sample_counts(models, prompt, None, CFG, stack=StackSpec.parse(*SHORTCUT_STACK), tops=tops), exact)
    assert min(pv) > ALPHA, f"chi-square p-values {pv}"
    assert sum(t["shortcut_rounds"] > 0 for t in tops) > 0.2 * N_SAMPLES  # both routes taken, in many runs
    assert sum(t["shortcut_rounds"] < t["rounds"] for t in tops) > 0.2 * N_SAMPLES


@pytest.mark.slow  # the check's power in the fast tier: test_check_detects_a_wrong_sampler
def test_check_detects_a_shortcut_that_retries(models, prompt, exact, monkeypatch):
    """A wrong router: a direct round whose first draft is rejected is thrown away and redone through the levels
    between (a second chance for the n-gram's token). The same check catches it."""
    from triforce.speculation.stack import StackSpec

    monkeypatch.setattr(NGramShortcut, "rate", lambda self, n: 1.0)
    right = level_mod.Level._round

    def retrying(self, ctx, committed, k):
        tokens, p, origins = right(self, ctx, committed, k)
        if self.shortcut is None or len(tokens) > 1:
            return tokens, p, origins
        shortcut, self.shortcut = self.shortcut, None
        try:
            return right(self, ctx, committed, k)
        finally:
            self.shortcut = shortcut

    monkeypatch.setattr(level_mod.Level, "_round", retrying)
    pv = p_values(sample_counts(models, prompt, None, CFG, stack=StackSpec.parse(*SHORTCUT_STACK)), exact)
    assert min(pv) < 1e-6, f"the retrying router went undetected: p-values {pv}"


def _accept_first_token(accept_fn, p, q, n, seed):
    g = make_generator(seed)
    counts = torch.zeros(p.shape[1])
    for _ in range(n):
        x = int(sample(q[0], g))
        j, nxt = accept_fn([x, int(sample(q[1], g))], q, p, g)
        counts[x if j >= 1 else nxt] += 1
    return counts


def test_accept_rule_alone_is_exact_and_the_check_has_power():
    """The first output token of one verification round is distributed as p[0], whatever q is."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0, 0.0]] * 3)
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.2, 0.1]] * 2)
    n = 20000
    def rule(draft, q, p, g):  # the verifier's rows as a sampling verifier hands them over
        return level_mod.accept(draft, q, Scores(probs=p), g)

    pv = p_values(_accept_first_token(rule, p, q, n, 0)[None], [p[0].double()])
    assert pv[0] > ALPHA
    bad = p_values(_accept_first_token(wrong_accept, p, q, n, 0)[None], [p[0].double()])
    assert bad[0] < 1e-6


# Sequoia trees drafted by the bottom model (children without replacement, Sequoia's rule), sampled with
# top-k / top-p: each output position follows the target's distribution
TREE_STACKS = [("draft,full", "3", "3,2", SamplingParams(temperature=1.0, top_k=6)),
               ("streaming:8,full", "3", "2,2,1", SamplingParams(temperature=0.6, top_p=0.9)),
               ("draft,retrieval:12,full", "2,3", "4,1", SamplingParams(temperature=1.0))]


@pytest.mark.slow  # trees in the fast tier: tests/test_tree_verify.py's test_tree_rule_is_exact_and_the_check_has_power[0]
@pytest.mark.parametrize("levels,gammas,tree,params", TREE_STACKS)
def test_tree_stacks_follow_target_distribution(models, prompt, levels, gammas, tree, params):
    from triforce.speculation.stack import StackSpec

    exact_p = exact_marginals(models[0], prompt, params)
    counts = sample_counts(models, prompt, None, CFG, params=params, stack=StackSpec.parse(levels, gammas, tree=tree))
    pv = p_values(counts, exact_p)
    assert min(pv) > ALPHA, f"{levels} --tree {tree}: chi-square p-values {pv}"


@pytest.mark.slow
def test_check_detects_children_sampled_with_replacement(models, prompt, exact, monkeypatch):
    """The deliberately wrong tree sampler: siblings drawn independently (with replacement), which
    Sequoia's rule (it removes a rejected child from q) does not correct for: the check must fail."""
    import triforce.speculation.drafters as drafters_mod
    from triforce.speculation.stack import StackSpec

    def with_replacement(row, m, greedy, generator):
        return [int(sample(row, generator)) for _ in range(m)]

    monkeypatch.setattr(drafters_mod, "sample_children", with_replacement)
    counts = sample_counts(models, prompt, None, CFG, stack=StackSpec.parse("draft,full", "3", tree="4,2"))
    pv = p_values(counts, exact)
    assert min(pv) < 1e-6, f"the wrong tree sampler went undetected: p-values {pv}"
