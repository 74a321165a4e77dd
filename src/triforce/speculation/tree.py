"""Drafted tokens as a tree: tokens + parent indices. A chain is the tree whose node i has parent i - 1.

Node indices 0..n-1 are the drafted tokens; -1 is the root, the last token of the context (whose
next-token distribution is the first row the verifier computes). A node's children are ordered (the
order the drafter made them: for Sequoia, its samples without replacement) and are tried in that
order by the verifier. Rows of per-node tensors are indexed "slot" = node + 1, slot 0 being the root.
"""
from __future__ import annotations

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
        """children[slot]: the ordered children of the root (slot 0) and of node slot - 1."""
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
