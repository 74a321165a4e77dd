"""Drafted tokens as a tree: tokens + parent indices. A chain is the tree whose node i has parent i - 1.

Node indices 0..n-1 are the drafted tokens; -1 is the root, the last token of the context (whose
next-token distribution is the first row the verifier computes). A node's children are ordered (the
order the drafter made them: for Sequoia, its samples without replacement) and are tried in that
order by the verifier. Rows of per-node tensors are indexed "vertex" = node + 1, vertex 0 being the root.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[i] < i (a node comes after its parent), -1 for the root's children

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft tree needs one parent per token")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before their children")

    @classmethod
    def chain(cls, tokens) -> DraftTree:
        tokens = tuple(tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node: 0 for the root's children (position = context length + depth)."""
        d: list[int] = []
        for p in self.parents:
            d.append(0 if p < 0 else d[p] + 1)
        return tuple(d)

    @cached_property
    def children(self) -> list[list[int]]:
        """children[vertex]: the ordered children of the root (vertex 0) and of node vertex - 1."""
        out: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def ancestry(self, device=None) -> torch.Tensor:
        """[n, n] bool: node i may attend to node j iff j is i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] |= mask[p]
        return mask.to(device) if device is not None else mask

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (inclusive); [] for the root (-1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def fixed_tree(widths) -> tuple[int, ...]:
    """The parents of a tree template whose nodes at depth d each have widths[d] children (the root's
    children are depth 0), in breadth-first order, siblings in rank order: (2, 2) -> 2 + 4 nodes."""
    parents: list[int] = []
    frontier = [-1]
    for w in widths:
        nxt = []
        for p in frontier:
            for _ in range(w):
                nxt.append(len(parents))
                parents.append(p)
        frontier = nxt
    return tuple(parents)


def rank_reach(acceptance) -> list[float]:
    """reach[r]: the probability that the child of rank r is tried and accepted, prod(1 - a[s], s < r) * a[r],
    for a positional acceptance vector (acceptance[r]: P(rank r accepted | the ones before it rejected))."""
    reach, rejected = [], 1.0
    for a in acceptance:
        reach.append(rejected * a)
        rejected *= 1.0 - a
    return reach


def tree_value(parents, acceptance) -> float:
    """Expected tokens of a round drafting this tree (1 + the expected accepted nodes) under the positional
    acceptance model: a node's chance of being reached and accepted is the product of rank_reach along its
    path (a rank past the vector: 0)."""
    reach = rank_reach(acceptance)
    kids: dict[int, int] = {}
    value: list[float] = []
    for p in parents:
        r = kids.get(p, 0)
        kids[p] = r + 1
        value.append((value[p] if p >= 0 else 1.0) * (reach[r] if r < len(reach) else 0.0))
    return 1.0 + sum(value)


def best_tree(acceptance, n_nodes: int, max_depth: int) -> tuple[int, ...]:
    """Sequoia's tree for a positional acceptance vector: acceptance[r] is the probability that the
    (r + 1)-th child tried at a vertex is accepted given the ones before it were rejected. A node's chance
    of being reached and accepted is the product, along its path, of P(its rank is tried and accepted)
    = prod(1 - a[s] for s < r) * a[r]; the expected accepted tokens of a tree is the sum over its nodes.
    Every candidate node is worth no more than its parent and its earlier sibling, so adding the most
    valuable candidate n_nodes times (best-first) is optimal (what the paper's dynamic program computes
    under this model). -> parents in the order added (a parent before its children, siblings in rank order)."""
    reach = rank_reach(acceptance)
    parents: list[int] = []
    # candidates: (-value, tie-break, parent node, rank, depth)
    heap = [(-reach[0], 0, -1, 0, 0)] if reach and n_nodes > 0 and max_depth > 0 else []
    count = 1
    while heap and len(parents) < n_nodes:
        neg, _, parent, rank, depth = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        if rank + 1 < len(reach):  # its next sibling
            heapq.heappush(heap, (neg / reach[rank] * reach[rank + 1] if reach[rank] > 0 else 0.0, count,
                                  parent, rank + 1, depth))
            count += 1
        if depth + 1 < max_depth:  # its first child
            heapq.heappush(heap, (neg * reach[0], count, node, 0, depth + 1))
            count += 1
    return tuple(parents)
