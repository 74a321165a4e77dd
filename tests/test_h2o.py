"""The H2O drafting cache (caches/h2o.py): which positions a build keeps, against a brute-force reading of
its definition, and what it refuses. (Exactness of stacks with an h2o level: test_speculation_greedy,
test_speculation_distribution, test_gemma3.)"""
from __future__ import annotations

import pytest
import torch

from triforce.caches import H2OCache
from triforce.caches.h2o import OBSERVED
from triforce.errors import TriforceError


def _brute_force(keys, queries, budget, recent, scale):
    """Per KV head: the attention weight each position drew from the last OBSERVED queries (each query at
    position N - Tq + t sees keys <= its position), summed over them and the group's query heads; the
    heaviest older positions and the recent window."""
    B, Hkv, N, D = keys.shape
    Hq, Tq = queries.shape[1], queries.shape[2]
    g = Hq // Hkv
    out = []
    for h in range(Hkv):
        w = torch.zeros(N, dtype=torch.float64)
        for qh in range(h * g, (h + 1) * g):
            for t in range(max(0, Tq - OBSERVED), Tq):
                pos = N - Tq + t
                s = (keys[0, h, :pos + 1].double() @ queries[0, qh, t].double()) * scale
                w[:pos + 1] += torch.softmax(s, 0)
        older = N - recent
        top = set(torch.topk(w[:older], budget - recent).indices.tolist())
        out.append((top | set(range(older, N)), w))
    return out


@pytest.mark.parametrize("Tq", [1, 5, 80])
def test_select_keeps_the_heaviest_hitters_and_the_recent_window(Tq):
    torch.manual_seed(Tq)
    B, Hkv, g, N, D, budget, recent = 1, 2, 3, 300, 16, 64, 8
    keys = torch.randn(B, Hkv, N, D)
    queries = torch.randn(B, Hkv * g, Tq, D)
    hot = [3, 77, 150]  # keys along the queries' mean direction: they draw attention
    for h in range(Hkv):
        direction = queries[0, h * g:(h + 1) * g].mean(dim=(0, 1))
        keys[0, h, hot] = 4 * direction / direction.norm()
    cache = H2OCache(2, Hkv, D, budget=budget, recent=recent, max_new=16)
    idx = cache.select(keys, queries)
    assert idx.shape == (B, Hkv, budget)
    ref = _brute_force(keys, queries, budget, recent, D ** -0.5)
    for h in range(Hkv):
        kept = idx[0, h].tolist()
        assert kept == sorted(kept) and len(set(kept)) == budget
        assert set(range(N - recent, N)) <= set(kept)
        want, weight = ref[h]
        if set(kept) != want:  # only near-ties may differ (float32 against float64 sums)
            older = sorted(weight[:N - recent].tolist(), reverse=True)
            cut = older[budget - recent - 1]
            for p in set(kept) ^ want:
                assert abs(weight[p].item() - cut) < 1e-5 * max(1.0, cut), (p, weight[p].item(), cut)
        assert set(hot) <= set(kept)


def test_a_context_within_the_budget_is_kept_whole_and_small_budgets_are_refused():
    cache = H2OCache(1, 1, 8, budget=32, recent=8, max_new=8)
    assert cache.select(torch.randn(1, 1, 30, 8), torch.randn(1, 2, 4, 8)).tolist() == [[list(range(30))]]
    with pytest.raises(TriforceError, match="recent tokens"):
        H2OCache(1, 1, 8, budget=8, recent=8)


def test_h2o_is_a_level_kind():
    from triforce.speculation.stack import StackSpec

    assert str(StackSpec.parse("ngram,h2o:512,full", "3,4")) == "ngram,h2o:512,full --gammas 3,4"
    with pytest.raises(TriforceError, match="not an integer"):
        StackSpec.parse("h2o:lots,full")
