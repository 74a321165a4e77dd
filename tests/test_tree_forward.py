"""Tree verification in one forward equals brute force, and the caches after acceptance equal caches
built by plain decoding of the accepted path (full, retrieval and streaming caches)."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce.caches import RetrievalCache, StreamingCache
from triforce.sampling import SamplingParams
from triforce.speculation.state import ModelState, prefill
from triforce.speculation.tree import DraftTree
from triforce.caches import new_cache

PARAMS = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(hf_tiny("llama", seed=5, max_position_embeddings=1024))


def random_tree(rng: random.Random, max_depth: int, max_width: int, max_nodes: int = 40) -> DraftTree:
    tokens, parents, frontier = [], [], [(-1, 0)]
    while frontier and len(tokens) < max_nodes:
        parent, depth = frontier.pop(rng.randrange(len(frontier)))
        if depth >= max_depth:
            continue
        for _ in range(rng.randint(1 if parent < 0 else 0, max_width)):
            if len(tokens) >= max_nodes:
                break
            tokens.append(rng.randrange(96))
            parents.append(parent)
            frontier.append((len(tokens) - 1, depth + 1))
    order = sorted(range(len(tokens)), key=lambda i: (DraftTree(tuple(tokens), tuple(parents)).depths[i], i))
    # parents come before children already (appended after their parent); keep the order as made
    return DraftTree(tuple(tokens), tuple(parents)) if order else DraftTree((), ())


def make_state(model, kind: str, prompt: list[int]) -> ModelState:
    c = model.cfg
    full = new_cache(model, 512, record_queries=True)
    prefill(model, full, torch.tensor([prompt]), 64)
    if kind == "full":
        state = ModelState("full", model, full, PARAMS)
    elif kind == "retrieval":
        cache = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, budget=40, chunk_size=4, recent=8, max_new=128)
        cache.build(full)
        state = ModelState("retrieval", model, cache, PARAMS)
    else:
        cache = StreamingCache(c.n_layers, c.n_kv_heads, c.head_dim, sink=4, window=24, max_rollback=48, slack=64)
        prefill(model, cache, torch.tensor([prompt]), 64)
        state = ModelState("streaming", model, cache, PARAMS)
    state.fed, state.stable = list(prompt), len(prompt)
    return state


@pytest.mark.parametrize("kind", ["full", "retrieval", "streaming"])
@pytest.mark.parametrize("seed", range(6))
def test_tree_forward_equals_brute_force_and_keep_equals_ar(model, kind, seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(96) for _ in range(90)]
    pending = [rng.randrange(96) for _ in range(rng.randint(1, 3))]  # context tokens not yet fed
    ctx = prompt + pending
    tree = random_tree(rng, max_depth=8, max_width=4)
    state = make_state(model, kind, prompt)
    before = copy.deepcopy(state)
    rows = state.score(ctx, len(prompt), tree).probs
    assert rows.shape == (len(tree) + 1, 96)
    for vertex in range(len(tree) + 1):  # brute force: plain decoding down the path to each node
        path = [tree.tokens[i] for i in tree.path_to(vertex - 1)]
        ref = copy.deepcopy(before).score(ctx + path, len(prompt), []).probs[-1]
        torch.testing.assert_close(rows[vertex], ref, atol=2e-5, rtol=1e-4)
    leaves = [i for i in range(len(tree)) if not tree.children[i + 1]]
    path = tree.path_to(rng.choice(leaves))[: rng.randint(0, 8)]  # an accepted path: any root-to-node prefix
    state.keep_path(path)
    ar = copy.deepcopy(before)
    ar.score(ctx + [tree.tokens[i] for i in path] + [0], len(prompt), [])  # feeds ctx + path (+ a probe token)
    ar.cache.rollback(len(ctx) + len(path))
    del ar.fed[len(ctx) + len(path):]
    assert state.fed == ar.fed and state.cache.length == ar.cache.length == len(ctx) + len(path)
    end = _physical_end(state.cache)
    torch.testing.assert_close(state.cache.k[..., :end, :], ar.cache.k[..., :end, :], atol=2e-5, rtol=1e-4)  # float order only
    torch.testing.assert_close(state.cache.v[..., :end, :], ar.cache.v[..., :end, :], atol=2e-5, rtol=1e-4)
    if kind == "streaming":
        assert torch.equal(state.cache.pos[:end], ar.cache.pos[:end])
    # and decoding goes on from the kept path exactly as from the AR-built cache
    nxt = [rng.randrange(96)]
    torch.testing.assert_close(state.score(ctx + [tree.tokens[i] for i in path] + nxt, len(prompt), []).probs[-1],
                               ar.score(ctx + [tree.tokens[i] for i in path] + nxt, len(prompt), []).probs[-1],
                               atol=2e-5, rtol=1e-4)


def _physical_end(cache) -> int:
    return cache._slot(cache.length)


def test_a_chain_is_a_prefix_rollback(model):
    """Chains take the causal path (no token block) and keep() of a prefix is a rollback."""
    prompt = list(range(1, 60))
    state = make_state(model, "full", prompt)
    chain = DraftTree.chain([5, 6, 7, 8])
    rows = state.score(prompt + [9], len(prompt), chain).probs
    ref = make_state(model, "full", prompt).score(prompt + [9], len(prompt), [5, 6, 7, 8]).probs
    assert torch.equal(rows, ref)
    state.keep_path([0, 1])  # a no-op for chains: the next forward rolls back lazily
    assert state.cache.length == len(prompt) + 5


@pytest.fixture(scope="module")
def long_model():
    return ours_from_hf(hf_tiny("llama", seed=6, max_position_embeddings=2048, hidden_size=256))  # head dim 64


@pytest.mark.parametrize("kind", ["full", "retrieval"])
def test_tree_forward_on_the_attention_kernel(kern, long_model, kind):
    """Over 1,064 keys (several of the kernel's blocks) a tree's forward runs the compiled attention kernel with the token block's
    visibility (not PyTorch's masked attention over a dense [T, S] mask), for each ISA variant: each
    node's logits equal plain decoding down its path, and a kernel that ignored the visibility (each node
    seeing its earlier siblings too, as the causal path would let it) is caught."""
    from triforce import kernels

    rng = random.Random(11)
    n_prompt = 1064
    prompt = [rng.randrange(96) for _ in range(n_prompt)]
    pending = [rng.randrange(96) for _ in range(2)]
    ctx = prompt + pending
    # at most 14 nodes: with the 2 pending tokens the block stays within PANEL_MAX_ROWS, so the linear layers run
    # the panel kernel for both forwards (exact per row); past it they ran oneDNN's sgemm, whose other summation
    # order on AMD Zen 4 put 6.5-9.3e-6 of the logits' scale between the two, too near the wrong variant's 1.5e-5
    tree = random_tree(rng, max_depth=5, max_width=3, max_nodes=14)
    assert len(tree) >= 6 and not tree.is_chain
    c = long_model.cfg

    def state_for():
        full = new_cache(long_model, n_prompt + 64, record_queries=True)
        prefill(long_model, full, torch.tensor([prompt]), 512)
        if kind == "full":
            st = ModelState("full", long_model, full, GREEDY)
        else:  # a budget of several kernel blocks
            cache = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, budget=1040, chunk_size=8, recent=16,
                                   max_new=64)
            cache.build(full)
            st = ModelState("retrieval", long_model, cache, GREEDY)
        st.fed, st.stable = list(prompt), len(prompt)
        return st

    with torch.inference_mode(), kernels.override(kern):  # plain decoding on the kernels too: float order apart,
        before = state_for()                                 # the same arithmetic
        want = [copy.deepcopy(before).ranked(ctx + [tree.tokens[i] for i in tree.path_to(vertex - 1)], len(prompt), [])[-1]
                for vertex in range(len(tree) + 1)]
    calls = []

    class Spy:  # the kernel module, recording whether each attention call carried a token block (or dropping it)
        def __init__(self, drop: bool):
            self.drop = drop

        def __getattr__(self, name):
            fn = getattr(kern, name)
            if name != "decode_attention":
                return fn

            def spied(*a, **kw):
                calls.append("visible" in kw)
                if self.drop:
                    kw.pop("visible", None)
                return fn(*a, **kw)
            return spied

    with torch.inference_mode(), kernels.override(Spy(drop=False)):
        rows = copy.deepcopy(before).ranked(ctx, len(prompt), tree)  # fp32 logits [T + 1, V]
    assert calls.count(True) == c.n_layers  # every layer's attention: the kernel with the tree's visibility
    with torch.inference_mode(), kernels.override(Spy(drop=True)):  # the wrong variant: nodes see earlier siblings
        wrong = copy.deepcopy(before).ranked(ctx, len(prompt), tree)
    want = torch.stack(want)
    # Float order apart, the tree's rows are plain decoding's; the wrong variant's are not (1.5e-5 of the logits'
    # scale: a node that sees its siblings' keys among a thousand). The float order is the attention kernel's: a
    # chain of up to 3 tokens takes the per-row path, the tree the rows-in-lanes path where this CPU's crossover
    # says so (AVX2 build on AMD Zen 4: up to 4.7e-6 of the scale between them; the same path: under 4e-7).
    tol = 6e-6 * float(want.abs().max())
    assert float((rows - want).abs().max()) <= tol
    assert float((wrong - want).abs().max()) > 1.5 * tol
