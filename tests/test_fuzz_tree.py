"""Property tests (Hypothesis) of the tree acceptance rule, greedy (speculation/level.py: verify_tree).

With the verifier's argmax ids p [n + 1] (vertex 0: the root, vertex s: node s - 1), on random small trees:
- the accepted nodes form a chain from the root down (each one's parent is the one before it);
- each accepted node's token is p at its parent's vertex, and it is the first child in order that has it;
- the walk ends where no child of the end vertex carries p there, and the next token is p at the end vertex.
"""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from triforce.sampling import Scores
from triforce.speculation.level import verify_tree
from triforce.speculation.tree import DraftTree

VOCAB = 5  # few tokens: siblings share tokens and argmaxes hit children often


@st.composite
def tree_and_argmax(draw):
    n = draw(st.integers(0, 12))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    tokens = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)))
    p = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n + 1, max_size=n + 1))
    return DraftTree(tokens, parents), p


def reference_walk(tree: DraftTree, p: list[int]) -> tuple[list[int], int]:
    path, vertex = [], 0
    while True:
        match = [c for c in tree.children[vertex] if tree.tokens[c] == p[vertex]]
        if not match:
            return path, p[vertex]
        path.append(match[0])
        vertex = match[0] + 1


@given(tree_and_argmax())
def test_greedy_tree_verification_walks_the_argmax(case):
    tree, p = case
    path, nxt = verify_tree(tree, None, Scores(ids=torch.tensor(p)), None)
    vertex = 0
    for node in path:
        parent = tree.parents[node]
        assert parent + 1 == vertex  # a chain from the root: each node a child of the previous one
        assert tree.tokens[node] == p[vertex]  # the verifier's argmax at its parent's vertex
        assert node == next(c for c in tree.children[vertex] if tree.tokens[c] == p[vertex])  # the first such child
        vertex = node + 1
    assert all(tree.tokens[c] != p[vertex] for c in tree.children[vertex])  # nothing more to accept
    assert nxt == p[vertex]
    assert (path, nxt) == reference_walk(tree, p)
    assert path == tree.path_to(path[-1] if path else -1)


@given(st.lists(st.integers(0, VOCAB - 1), max_size=10), st.data())
def test_greedy_chain_accepts_the_longest_matching_prefix(draft, data):
    p = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(draft) + 1, max_size=len(draft) + 1))
    path, nxt = verify_tree(DraftTree.chain(draft), None, Scores(ids=torch.tensor(p)), None)
    k = next((i for i, (d, q) in enumerate(zip(draft, p)) if d != q), len(draft))
    assert path == list(range(k)) and nxt == p[k]
