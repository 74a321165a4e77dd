"""The acceptance rule on draft trees (Sequoia's): exact in distribution, greedy = argmax walk, a chain
is the one-child-per-node case, and the check fails for a sampler that lies about its q."""
from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from triforce.sampling import Scores, make_generator
from triforce.speculation.level import accept, verify_tree
from triforce.speculation.tree import DraftTree

V = 6


def test_tree_shape():
    t = DraftTree((5, 6, 7, 8, 9), (-1, -1, 0, 0, 2))
    assert t.depths == (0, 0, 1, 1, 2)
    assert t.children == [[0, 1], [2, 3], [], [4], [], []]
    assert t.path_to(4) == [0, 2, 4] and t.path_to(-1) == []
    anc = t.ancestry()
    assert anc[4].tolist() == [True, False, True, False, True] and anc[1].tolist() == [False, True, False, False, False]
    c = DraftTree.chain([3, 4, 5])
    assert c.is_chain and c.parents == (-1, 0, 1) and c.depths == (0, 1, 2) and not t.is_chain
    with pytest.raises(ValueError):
        DraftTree((1, 2), (1, -1))


def test_greedy_tree_walks_the_argmax():
    t = DraftTree((1, 2, 3, 4, 5), (-1, -1, 1, 1, 3))
    # argmax after: root 2 (node 1), node 1 -> 4 (node 3), node 3 -> 5 (node 4), node 4 -> 0 (bonus)
    p = torch.tensor([2, 9, 4, 9, 5, 0])
    assert verify_tree(t, None, Scores(ids=p), None) == ([1, 3, 4], 0)
    p = torch.tensor([2, 9, 1, 9, 5, 0])  # after node 1 the argmax 1 is no child: stop there
    assert verify_tree(t, None, Scores(ids=p), None) == ([1], 1)
    p = torch.tensor([0, 9, 1, 9, 5, 0])
    assert verify_tree(t, None, Scores(ids=p), None) == ([], 0)


def test_chain_is_the_one_child_case():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        p = torch.softmax(torch.randn(5, V, generator=g), -1)
        q = torch.softmax(torch.randn(4, V, generator=g), -1)
        draft = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
        a = accept(draft, q, Scores(probs=p), make_generator(7))
        path, nxt = verify_tree(DraftTree.chain(draft), torch.cat([q, torch.zeros(1, V)]), Scores(probs=p),
                                make_generator(7))
        assert a == (len(path), nxt) and path == list(range(len(path)))


def random_tree(shape_seed: int, rows, gen: torch.Generator, max_depth=3, max_width=3):
    """A tree of random shape (fixed by shape_seed) whose children are drawn, without replacement
    (Gumbel top-k), from rows(slot, tokens so far) -> the drafter's distribution at that slot; -> tree."""
    rng = random.Random(shape_seed)
    tokens, parents = [], []
    frontier = [(-1, 0)]
    while frontier:
        parent, depth = frontier.pop(0)
        width = rng.randint(1, max_width) if depth < max_depth and (parent < 0 or rng.random() < 0.7) else 0
        if width == 0:
            continue
        q = rows(parent, tokens)
        gumbel = q.log() - torch.empty(V).exponential_(generator=gen).log()
        for x in gumbel.topk(width).indices.tolist():
            tokens.append(x)
            parents.append(parent)
            frontier.append((len(tokens) - 1, depth + 1))
    return DraftTree(tuple(tokens), tuple(parents))


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double().numpy() * float(counts.sum())
    keep = expected > 0
    assert counts.numpy()[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(chisquare(counts.numpy()[keep], expected[keep], sum_check=False).pvalue)


class Models:
    """A target and a drafter over V tokens: next-token rows after the context (root) and after one
    more token t; deeper rows depend on the last token only (any rows will do there)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.p_root, self.q_root = (torch.softmax(torch.randn(V, generator=g) * 1.5, -1) for _ in range(2))
        self.p_after, self.q_after = (torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1) for _ in range(2))

    def rows(self, tree: DraftTree, which: str) -> torch.Tensor:
        root, after = (self.p_root, self.p_after) if which == "p" else (self.q_root, self.q_after)
        return torch.stack([root] + [after[t] for t in tree.tokens])


def _emitted(models: Models, n: int, seed: int, lie: bool = False):
    """Counts of the first emitted token, and of the second token after each first token."""
    gen = make_generator(seed)
    first, second = torch.zeros(V), torch.zeros(V, V)
    for _ in range(n):
        tree = random_tree(seed, lambda parent, toks: models.q_root if parent < 0 else models.q_after[toks[parent]],
                           gen)
        q = models.rows(tree, "q")
        if lie:  # a wrong sampler: it claims uniform proposals
            q = torch.full_like(q, 1.0 / V)
        path, nxt = verify_tree(tree, q, Scores(probs=models.rows(tree, "p")), gen)
        out = [tree.tokens[i] for i in path] + [nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    return first, second


# seed 0 in the fast tier (-m "not slow"), the other seeds with the slow tests (CI runs all three)
@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)])
def test_tree_rule_is_exact_and_the_check_has_power(seed):
    """First emitted token ~ the target's root row; after first token t, the second ~ the target's
    row after t (a second token is emitted whenever t was an accepted child)."""
    models = Models(seed)
    first, second = _emitted(models, 8000, seed)
    assert _pvalue(first, models.p_root) > 1e-3
    t = int(second.sum(1).argmax())
    assert second[t].sum() > 400 and _pvalue(second[t], models.p_after[t]) > 1e-3
    bad_first, _ = _emitted(models, 8000, seed, lie=True)
    assert _pvalue(bad_first, models.p_root) < 1e-6


def _all_trees(n: int, max_depth: int):
    """Every ordered tree of n nodes (parents before children) up to isomorphism of construction order."""
    def grow(parents, depths):
        if len(parents) == n:
            yield tuple(parents)
            return
        for p in [-1] + list(range(len(parents))):
            d = 0 if p < 0 else depths[p] + 1
            if d < max_depth:
                yield from grow(parents + [p], depths + [d])
    yield from grow([], [])


@pytest.mark.parametrize("acceptance", [[0.8, 0.1, 0.05], [0.4, 0.3, 0.2], [0.95, 0.5, 0.5], [0.2, 0.2, 0.2]])
@pytest.mark.parametrize("n,depth", [(4, 2), (5, 3), (6, 6)])
def test_best_tree_is_optimal(acceptance, n, depth):
    """Sequoia's tree (best-first) has the largest expected accepted tokens of all trees of n nodes and
    depth <= d (brute force; tree_value is checked against simulated rounds in test_tune), and is a valid
    draft tree shape."""
    from triforce.speculation.tree import best_tree, tree_value

    best = best_tree(acceptance, n, depth)
    DraftTree(tuple(range(len(best))), best)  # parents before children
    assert len(best) == n
    brute = max(tree_value(t, acceptance) for t in _all_trees(n, depth))
    assert tree_value(best, acceptance) == pytest.approx(brute, rel=1e-12)


def test_fixed_tree_shapes():
    from triforce.speculation.tree import fixed_tree

    assert fixed_tree((2, 2)) == (-1, -1, 0, 0, 1, 1)
    assert fixed_tree((3, 1)) == (-1, -1, -1, 0, 1, 2)
    assert fixed_tree((1, 1, 1)) == (-1, 0, 1)  # a chain
