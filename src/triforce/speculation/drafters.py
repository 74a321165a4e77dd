"""Drafters at the bottom of a speculation stack: a model sampling autoregressively, or n-gram lookup (a trained
draft head is drafthead.drafter.HeadDrafter). What a level drafts from is a `Drafter`; a level is one too
(level.Level), for the level above it.
"""
from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import torch

from .state import ModelState, extended
from .tree import DraftTree


class Drafter(Protocol):
    """What a level drafts from."""

    name: str  # the level's name in the stats and the tokens' provenance

    def propose(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens after `ctx` (of which `committed` are committed) -> (tokens, q [len(tokens), V]: the
        distributions they were drawn from, or None: point masses at the tokens, for deterministic or greedy
        drafts)."""
        ...

    def stats(self) -> dict: ...


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    """A drafter that can also draft a token tree (Sequoia): the models at the bottom of a stack."""

    def propose_tree(self, ctx: list[int], committed: int, template: tuple[int, ...]
                     ) -> tuple[DraftTree, torch.Tensor | None]:
        """A draft tree in the shape of `template` (tree.fixed_tree / best_tree) -> (the tree, q [len + 1, V]: the
        row each vertex's children came from, or None when greedy)."""
        ...


def sample_children(row: torch.Tensor, m: int, greedy: bool, generator: torch.Generator | None) -> list[int]:
    """Up to m distinct children of a vertex, in the order they are tried: greedy, the top-m of the logits
    row; else m draws without replacement from the probabilities row (Gumbel top-k: the order of
    sequential sampling without replacement, with fresh randomness for every vertex), never a token of
    probability 0 (so fewer than m where fewer are possible)."""
    if greedy:
        return row.topk(m).indices.tolist()
    u = torch.rand(row.shape, generator=generator, device=row.device, dtype=torch.float64).clamp_(min=1e-300)
    keys = row.double().log() - (-u.log()).log()  # log q + Gumbel noise; -inf where q = 0
    top = keys.topk(m)
    return top.indices[top.values > float("-inf")].tolist()


def draft_tree(template: tuple[int, ...], root_row: torch.Tensor, rows_after, greedy: bool,
               generator: torch.Generator | None) -> tuple[DraftTree, torch.Tensor | None, int]:
    """A draft tree in the shape of `template` (parents, tree.fixed_tree / best_tree), made depth by depth: each
    vertex's children are drawn from the row after it (sample_children: logits when greedy, else probabilities);
    `rows_after(tree so far, nodes)` gives the rows after those nodes of the tree (a drafter's forward). A vertex with
    fewer possible children than the template asks drops the missing subtrees. -> (the tree, q [len + 1, V]: the row
    each vertex's children came from, zeros at leaves, None when greedy; the depths drafted)."""
    kids: list[list[int]] = [[] for _ in range(len(template) + 1)]
    for node, parent in enumerate(template):
        kids[parent + 1].append(node)
    tokens: list[int] = []
    parents: list[int] = []
    rows = {0: root_row}  # actual vertex -> its row
    frontier = [(-1, -1)]  # (template node, actual node) whose children come next
    depths = 0
    while True:
        nxt = []
        for t_node, a_node in frontier:
            want = kids[t_node + 1]
            if not want:
                continue
            for t_child, token in zip(want, sample_children(rows[a_node + 1], len(want), greedy, generator)):
                nxt.append((t_child, len(tokens)))
                tokens.append(token)
                parents.append(a_node)
        depths += 1
        frontier = [(tc, ac) for tc, ac in nxt if kids[tc + 1]]
        if not frontier:
            break
        for (_, ac), row in zip(frontier, rows_after(DraftTree(tuple(tokens), tuple(parents)), [ac for _, ac in frontier])):
            rows[ac + 1] = row
    q = None
    if not greedy:
        q = torch.zeros(len(tokens) + 1, root_row.shape[-1], device=root_row.device)
        for vertex, row in rows.items():
            q[vertex] = row
    return DraftTree(tuple(tokens), tuple(parents)), q, depths


class ModelDrafter:
    """Samples from a model state token by token; its q rows are that model's distributions.
    At the top of a stack (method `ar`) it is plain autoregressive decoding."""

    def __init__(self, state: ModelState, generator: torch.Generator):
        self.state, self.generator = state, generator
        self.name = state.name
        self.tokens = self.syncs = 0
        self.seconds = 0.0

    def propose(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor | None]:
        t = time.perf_counter()
        tokens, rows = [], []
        with extended(ctx) as seq:
            for _ in range(k):
                scores = self.state.score(seq, committed, [])
                tokens.append(scores.token(-1, self.generator))
                seq.append(tokens[-1])
                if not scores.greedy:
                    rows.append(scores.probs[-1])
                self.syncs += 1  # the next forward needs the token: one host synchronisation per drafted token
        self.tokens += k
        self.seconds += time.perf_counter() - t
        return tokens, (torch.stack(rows) if rows else None)

    def step(self, ctx: list[int], committed: int, limit: int) -> list[int]:
        return self.propose(ctx, committed, 1)[0]

    def propose_tree(self, ctx: list[int], committed: int, template: tuple[int, ...]
                     ) -> tuple[DraftTree, torch.Tensor | None]:
        """A draft tree in the shape of `template` (draft_tree): one forward per depth feeds the tree so far as a
        token block (each node seeing its ancestors), then keep_path([]) drops it again."""
        t = time.perf_counter()

        def rows_after(tree: DraftTree, nodes: list[int]) -> list[torch.Tensor]:
            out = self.state.ranked(ctx, committed, tree)
            self.state.keep_path([])  # the next forward feeds the whole tree again
            return [out[n + 1] for n in nodes]

        root = self.state.ranked(ctx, committed, [])[-1]
        tree, q, depths = draft_tree(template, root, rows_after, self.state.params.greedy, self.generator)
        self.syncs += depths
        self.tokens += len(tree)
        self.seconds += time.perf_counter() - t
        return tree, q

    def stats(self) -> dict:
        return {"level": self.name, "role": "draft", "tokens": self.tokens, "seconds": round(self.seconds, 4),
                "forwards": self.state.forwards, "host_syncs": self.syncs}


class NGramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    `max_ngram` down to `min_ngram`) and propose what followed it. Deterministic, so q is one-hot:
    the verifier accepts token x with probability p(x) (at temperature 0: iff x is its argmax)."""

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, device="cpu"):
        self.vocab_size, self.max_ngram, self.min_ngram, self.device = vocab_size, max_ngram, min_ngram, device
        self.name = "ngram"
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0  # n-grams ending before this position (within the committed prefix) are indexed
        self.tokens = 0
        self.seconds = 0.0

    def _update_index(self, ctx: list[int], committed: int) -> None:
        # index n-grams whose continuation token is committed: ending at positions <= committed - 2
        for end in range(self._indexed, committed - 1):
            for n in self._index:
                if end + 1 >= n:
                    self._index[n][tuple(ctx[end + 1 - n:end + 1])] = end
        self._indexed = max(self._indexed, committed - 1)

    def lookup(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], int]:
        """-> (up to k tokens that followed the latest earlier occurrence of the longest matching n-gram, n);
        ([], 0) without a match. No bookkeeping: propose() is the proposal (shortcut.NGramShortcut looks ahead with
        this)."""
        self._update_index(ctx, committed)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ctx) < n:
                continue
            end = self._index[n].get(tuple(ctx[-n:]))
            if end is not None:
                return ctx[end + 1:end + 1 + k], n
        return [], 0

    def propose(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], None]:
        t = time.perf_counter()
        tokens, _ = self.lookup(ctx, committed, k)
        self.tokens += len(tokens)
        self.seconds += time.perf_counter() - t
        return tokens, None

    def stats(self) -> dict:
        return {"level": self.name, "role": "draft", "tokens": self.tokens, "seconds": round(self.seconds, 4)}
