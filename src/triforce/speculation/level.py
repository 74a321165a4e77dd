"""One level of speculative decoding; levels stack, the verifier of one being the drafter of the next.

The rule (Leviathan et al. / Chen et al.): draft x_1..x_k ~ q; the verifier computes p at every
position in one forward; x_i is accepted with probability min(1, p(x_i) / q(x_i)); at the first
rejection a token is drawn from norm(max(0, p - q)); if all k are accepted a bonus token is drawn
from p. The output follows p exactly. With one-hot p and q (temperature 0) this is "accept iff the
draft equals the verifier's argmax", so greedy decoding is the same code.

A level's output tokens are distributed as its verifier's model, with the verifier's p rows as
their distributions, so a level is itself a drafter (`propose`) for the level above.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from ..sampling import Scores, sample
from .drafters import Drafter, TreeDrafter
from .provenance import RoundLog, cut_tail, drafted_by
from .shortcut import NGramShortcut
from .state import ModelState, extended
from .tree import DraftTree


def verify_tree(tree: DraftTree, q: torch.Tensor | None, p: Scores,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """The acceptance rule, for a tree of drafted tokens (a chain is the tree with one child per node).

    tree: n drafted nodes. Rows are per vertex (0: the root, the context's last token; s: node s - 1):
    q [n + 1, V]: the distribution the vertex's children were drawn from (without replacement, in their
    order), or None for point masses at each child's token (deterministic drafts: n-gram lookup);
    p: the verifier's Scores after each vertex: [n + 1, V] distributions, or [n + 1] argmax ids when greedy (a
    one-hot p, compared as ids). -> (the accepted nodes, root to leaf; the next token).

    Sequoia's rule at each vertex: try its children in order; accept child s with probability
    min(1, p(s) / q(s)); on a rejection p <- norm(max(p - q, 0)) and q <- q without s, renormalised;
    if every child is rejected, sample from the residual p; at a leaf (no children), the bonus token
    from p. With one child per vertex this is the rule of speculative sampling (Leviathan et al.), and
    the output follows p exactly either way. Decisions at different vertices use independent draws, so
    every vertex is resolved at once on tensors, the walk from the root along accepted children too,
    and only the vertex where it ends is sampled; the `.tolist()` is the only host synchronisation.
    """
    n, dev = len(tree), p.device
    kids = tree.children
    width = max(1, max(len(c) for c in kids))
    child = torch.full((n + 1, width), -1, dtype=torch.long)
    for vertex, c in enumerate(kids):
        child[vertex, :len(c)] = torch.tensor(c, dtype=torch.long)
    child = child.to(dev)
    token = torch.tensor(tree.tokens + (0,), device=dev)  # child -1 reads token 0; never used
    chosen = torch.full((n + 1,), -1, dtype=torch.long, device=dev)
    vertices = torch.arange(n + 1, device=dev)
    if p.greedy:
        for b in range(width):  # greedy: the child equal to the argmax; else the argmax itself
            c = child[:, b]
            chosen = torch.where((c >= 0) & (chosen < 0) & (token[c] == p.ids), c, chosen)
    else:
        P, Q = p.probs, q
        for b in range(width):
            c = child[:, b]
            live = (c >= 0) & (chosen < 0)
            x = token[c]
            px = P[vertices, x]
            qx = Q[vertices, x] if Q is not None else torch.ones_like(px)
            u = torch.rand(n + 1, generator=generator, device=dev)
            accepted = live & (u * qx < px)  # P(accept) = min(1, px / qx); qx > 0 since x came from q
            chosen = torch.where(accepted, c, chosen)
            rejected = live & ~accepted
            if b + 1 == width:  # the last residual is needed at the walk's last vertex only: made below
                break
            P = _residual(P, Q, vertices, x, rejected[:, None])
            if Q is not None:  # sampling without replacement: the next child came from q without x
                rest = Q.clone()
                rest[vertices, x] = 0.0
                rest_total = rest.sum(-1, keepdim=True)
                Q = torch.where(rejected[:, None] & (rest_total > 0), rest / rest_total.clamp(min=1e-30), Q)
    # walk from the root along accepted children, on the device: only the last vertex needs a sample
    depth = max(tree.depths, default=-1) + 1
    path = torch.full((depth,), -1, dtype=torch.long, device=dev)
    vertex = torch.zeros((), dtype=torch.long, device=dev)
    for d in range(depth):
        path[d] = chosen[vertex]
        vertex = torch.where(path[d] >= 0, path[d] + 1, vertex)
    if p.greedy:
        nxt = p.ids[vertex]
    else:  # the residual after the last tried child (none at a leaf: its bonus row)
        one = vertex.view(1)
        row = _residual(P[one], Q[one] if Q is not None else None, one.new_zeros(1), x[one], rejected[one][:, None])
        nxt = sample(row[0], generator)
    *path, nxt = torch.cat([path, nxt.view(1)]).tolist()
    return [i for i in path if i >= 0], nxt


def _residual(P: torch.Tensor, Q: torch.Tensor | None, rows: torch.Tensor, x: torch.Tensor,
              rejected: torch.Tensor) -> torch.Tensor:
    """P [r, V] with the rows where `rejected` [r, 1] replaced by norm(max(P - Q, 0)), or, for point
    masses (Q None), by P without token x[row], renormalised. (A total of 0 happens only if p == q up
    to rounding, where rejection has probability 0: such a row is kept.)"""
    if Q is not None:
        residual = (P - Q).clamp_(min=0)
    else:
        residual = P.clone()
        residual[rows, x] = 0.0
    total = residual.sum(-1, keepdim=True)
    return torch.where(rejected & (total > 0), residual / total.clamp(min=1e-30), P)


def accept(draft: list[int], q: torch.Tensor | None, p: Scores,
           generator: torch.Generator | None) -> tuple[int, int]:
    """A chain: draft [k] ids with proposal rows q [k, V] (or None: point masses); verifier rows p
    Scores [k + 1]. -> (j accepted drafts, the next token: the residual sample
    at j, or the bonus token if j == k). The tree rule (verify_tree) with one child per node."""
    if q is not None:
        q = torch.cat([q, torch.zeros_like(q[:1])])  # the last vertex is a leaf: no children
    path, nxt = verify_tree(DraftTree.chain(draft), q, p, generator)
    return len(path), nxt


def verify_rates(rounds: int, proposed: int, accepted: int) -> dict:
    """A verifying level's rates from its counts (None where a count they divide by is 0)."""
    return {"acceptance_rate": round(accepted / proposed, 4) if proposed else None,
            "mean_accepted": round(accepted / rounds, 3) if rounds else None,
            "tokens_per_round": round((accepted + rounds) / rounds, 3) if rounds else None}


class Level:
    """`drafter` proposes up to `gamma` tokens, `verifier` checks them in one forward. With a tree
    template (parents: tree.fixed_tree / best_tree) and a drafter that can draft trees (a TreeDrafter: a model at
    the bottom), each round drafts that tree instead of a chain (Sequoia).

    `shortcut` (shortcut.NGramShortcut, at the top of a stack with levels between an n-gram drafter and it)
    chooses each round's drafter: its n-gram proposal, verified directly, or `drafter`.

    Provenance (provenance.py): `origins` are the level names of the tokens step / propose returned last, `rejected`
    the draft tail the last round cut, and each round is recorded in `log` (a RoundLog shared by the stack's levels).
    """

    def __init__(self, name: str, drafter: Drafter, verifier: ModelState, gamma: int, generator: torch.Generator,
                 tree: tuple[int, ...] | None = None, shortcut: NGramShortcut | None = None, on_round=None,
                 log: RoundLog | None = None):
        self.on_round = on_round  # called with (asked, drafted, accepted) after each round (the adaptive planner)
        self.log = log
        self.origins: list[str] = []
        self.rejected: list[int] = []
        self.name, self.drafter, self.verifier, self.gamma, self.generator = name, drafter, verifier, gamma, generator
        if tree and not isinstance(drafter, TreeDrafter):  # (StackSpec.check allows trees below such kinds only)
            raise TypeError(f"a draft tree needs a drafter that drafts trees, not {drafter.name}")
        self.tree = tree or None
        self.shortcut = shortcut if self.tree is None else None
        self.rounds = self.drafted = self.accepted = self.syncs = 0
        self.seconds = 0.0
        self.recent: list[float] = []  # acceptance of the last rounds, for rebuild policies
        # trees: per child rank, how often a child of that rank was tried / accepted at the vertices of the
        # accepted path (Sequoia's positional acceptance vector: accepted / tried, `triforce tune --trees`)
        self.rank_tried: list[int] = []
        self.rank_accepted: list[int] = []
        # chains: per draft position, how often it was verified (every earlier one accepted) / accepted
        self.position_tried: list[int] = []
        self.position_accepted: list[int] = []

    def _round(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor | None, list[str]]:
        """draft -> verify -> accept -> roll back: the accepted tokens and the bonus token, with the verifier's
        rows as their distributions (None when greedy) and the level that drafted each (provenance.py)."""
        # draft: a chain of k tokens (or a tree) after ctx, with the drafter's q rows
        drafter = self.drafter
        if self.tree is not None:
            tree, q = drafter.propose_tree(ctx, committed, self.tree)
        else:
            drafter = self.drafter if self.shortcut is None else self.shortcut.choose(ctx, committed, k, self.drafter)
            draft, q = drafter.propose(ctx, committed, k)
            tree = DraftTree.chain(draft)
            if q is not None:
                q = torch.cat([q, torch.zeros_like(q[:1])])  # the last node is a leaf: no children
        t = time.perf_counter()
        # verify: one forward of the verifier over the draft, its cache extended by every drafted token
        p = self.verifier.score(ctx, committed, tree)
        # accept: the longest path the rule takes, and the next token (recovered from the residual, or the bonus)
        path, nxt = verify_tree(tree, q, p, self.generator)
        # roll back (llama.cpp's seq_rm): the verifier's cache keeps ctx and the accepted path only. A drafter
        # below rolls back its own state when it drafts next: it keeps what still matches the context.
        self.verifier.keep_path(path)
        j = len(path)
        self.seconds += time.perf_counter() - t
        self.rounds += 1
        self.syncs += 1
        self.drafted += len(tree)
        self.accepted += j
        if len(tree):
            self.recent = (self.recent + [j / len(tree)])[-8:]
        if self.on_round is not None:
            self.on_round(k, len(tree), j)
        if self.tree is not None:
            self._count_ranks(tree, path)
        else:
            self._count_positions(len(tree), j)
        tokens = [tree.tokens[i] for i in path] + [nxt]  # a tree may give more than k + 1: callers cut
        if self.shortcut is not None:
            self.shortcut.remember(tokens)
        # provenance: ids already on the host (verify_tree's one sync), so a few list operations per round
        below = drafted_by(drafter, len(tree))
        origins = [below[i] for i in path] + [self.name]
        self.rejected = cut_tail(tree, path) if self.tree is not None else list(tree.tokens[j:])
        if self.log is not None:
            self.log.record(self.name, tree.tokens, j)
        vertices = [0] + [i + 1 for i in path]  # the verifier's rows after the context and each accepted node
        return tokens, (None if p.greedy else p.probs[vertices][:len(tokens)]), origins

    def _count_ranks(self, tree: DraftTree, path: list[int]) -> None:
        """At each vertex of the accepted path (the root, then each accepted node): its children up to the
        accepted one were tried, that one accepted; at the last vertex every child was tried and rejected."""
        nodes = [-1] + path  # the root (-1) and the accepted nodes: node n's children are at vertex n + 1
        for i, node in enumerate(nodes):
            kids = tree.children[node + 1]
            accepted = kids.index(nodes[i + 1]) if i + 1 < len(nodes) else None
            tried = len(kids) if accepted is None else accepted + 1
            while len(self.rank_tried) < len(kids):
                self.rank_tried.append(0)
                self.rank_accepted.append(0)
            for r in range(tried):
                self.rank_tried[r] += 1
            if accepted is not None:
                self.rank_accepted[accepted] += 1

    def _count_positions(self, drafted: int, accepted: int) -> None:
        while len(self.position_tried) < drafted:
            self.position_tried.append(0)
            self.position_accepted.append(0)
        for i in range(min(accepted + 1, drafted)):
            self.position_tried[i] += 1
        for i in range(accepted):
            self.position_accepted[i] += 1

    def acceptance_by_position(self) -> list[float]:
        """Per draft position of the chains: accepted / verified (P(accepted | every earlier one accepted))."""
        return [a / t if t else 0.0 for a, t in zip(self.position_accepted, self.position_tried)]

    def acceptance_by_rank(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.rank_accepted, self.rank_tried)]

    def step(self, ctx: list[int], committed: int, limit: int) -> list[int]:
        """One round at the top of the stack: 1 to gamma + 1 tokens (at most `limit`)."""
        tokens, _, origins = self._round(ctx, committed, min(self.gamma, limit))
        self.origins = origins[:limit]
        return tokens[:limit]

    def propose(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor | None]:
        """Exactly k tokens distributed as the verifier's model, with its rows as their q (None when
        greedy: the tokens are the verifier's argmax, compared as ids)."""
        out: list[int] = []
        rows: list[torch.Tensor] = []
        origins: list[str] = []
        with extended(ctx) as seq:  # each round drafts after the tokens of the rounds before
            while len(out) < k:
                toks, p, levels = self._round(seq, committed, min(self.gamma, k - len(out)))
                out += toks
                origins += levels
                seq.extend(toks)
                if p is not None:
                    rows.append(p)
        self.origins = origins[:k]
        return out[:k], (torch.cat(rows)[:k] if rows else None)

    def stats(self) -> dict:
        return {
            "level": self.name, "role": "verify", "gamma": self.gamma, "rounds": self.rounds,
            "proposed": self.drafted, "accepted": self.accepted, **verify_rates(self.rounds, self.drafted, self.accepted),
            "seconds": round(self.seconds, 4), "forwards": self.verifier.forwards,
            "host_syncs": self.syncs, "syncs_per_round": round(self.syncs / self.rounds, 3) if self.rounds else None,
            **(self.shortcut.stats() if self.shortcut is not None else {}),
            **({"acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position()],
                "verified_by_position": list(self.position_tried)} if self.tree is None and self.position_tried else {}),
            **({"tree_nodes": len(self.tree), "acceptance_by_rank": [round(a, 4) for a in self.acceptance_by_rank()],
                "tried_by_rank": list(self.rank_tried)} if self.tree is not None else {}),
        }


def chain_of(top: Level | Drafter) -> Iterator[Level | Drafter]:
    """A stack's levels from `top` down: each Level, then the drafter at the bottom."""
    node = top
    while isinstance(node, Level):
        yield node
        node = node.drafter
    yield node
