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

import torch

from ..sampling import sample
from .state import ModelState


def accept(draft: list[int], q: torch.Tensor | None, p: torch.Tensor,
           generator: torch.Generator | None) -> tuple[int, int]:
    """draft [k] token ids; q [k, V] their proposal rows, or None for a deterministic drafter (a point
    mass at each drafted token: n-gram lookup); p [k + 1, V] the verifier's rows, or [k + 1] ids for
    a greedy verifier (its argmax: a one-hot p, compared as ids, no rows built).
    -> (j, the next token): j drafted tokens accepted, then a residual sample at j, or the bonus
    token from p[k] if j == k. Computed on tensors; the single `.tolist()` at the end is the round's
    only host synchronisation."""
    k = len(draft)
    x = torch.tensor(draft + [0], device=p.device)  # padded: row k of p is the bonus row
    if p.dim() == 1:
        # greedy: p is one-hot at its argmax a, so x is accepted iff x == a, and the residual
        # norm(max(0, p - q)) at a rejection is one-hot at a again, whatever q was
        j = (x[:k] == p[:k]).long().cumprod(0).sum()
        nxt = p[j]
    else:
        rows = torch.arange(k, device=p.device)
        px = p[rows, x[:k]]
        qx = q[rows, x[:k]] if q is not None else torch.ones_like(px)
        u = torch.rand(k, generator=generator, device=p.device)
        j = (u * qx < px).long().cumprod(0).sum()  # P(accept) = min(1, px / qx); qx > 0 since x came from q
        residual = p[j].clone()
        if q is not None:
            residual -= torch.cat([q, torch.zeros_like(q[:1])])[j]  # the zero row: j == k gives p[k]
            residual.clamp_(min=0)
        else:
            residual[x[j]] = torch.where(j < k, 0.0, residual[x[j]])  # remove the point mass at x_j
        total = residual.sum()
        # total == 0 only if p == q up to rounding, where rejection has probability 0
        nxt = sample(torch.where(total > 0, residual / total, p[j]), generator)
    j, nxt = torch.stack([j, nxt]).tolist()
    return j, nxt


class Level:
    """`drafter` proposes up to `gamma` tokens, `verifier` checks them in one forward."""

    def __init__(self, name: str, drafter, verifier: ModelState, gamma: int, generator: torch.Generator):
        self.name, self.drafter, self.verifier, self.gamma, self.generator = name, drafter, verifier, gamma, generator
        self.rounds = self.drafted = self.accepted = self.syncs = 0
        self.seconds = 0.0
        self.recent: list[float] = []  # acceptance of the last rounds, for rebuild policies

    def _round(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor | None]:
        draft, q = self.drafter.propose(ctx, committed, k)
        t = time.perf_counter()
        p = self.verifier.score(ctx, committed, draft)
        j, nxt = accept(draft, q, p, self.generator)
        self.seconds += time.perf_counter() - t
        self.rounds += 1
        self.syncs += 1
        self.drafted += len(draft)
        self.accepted += j
        if draft:
            self.recent = (self.recent + [j / len(draft)])[-8:]
        return draft[:j] + [nxt], (p[:j + 1] if p.dim() == 2 else None)

    def step(self, ctx: list[int], committed: int, limit: int) -> list[int]:
        """One round at the top of the stack: 1 to gamma + 1 tokens (at most `limit`)."""
        return self._round(ctx, committed, min(self.gamma, limit))[0][:limit]

    def propose(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor | None]:
        """Exactly k tokens distributed as the verifier's model, with its rows as their q (None when
        greedy: the tokens are the verifier's argmax, compared as ids)."""
        out: list[int] = []
        rows: list[torch.Tensor] = []
        while len(out) < k:
            toks, p = self._round(ctx + out, committed, min(self.gamma, k - len(out)))
            out += toks
            if p is not None:
                rows.append(p)
        return out[:k], (torch.cat(rows)[:k] if rows else None)

    def stats(self) -> dict:
        return {
            "level": self.name, "role": "verify", "gamma": self.gamma, "rounds": self.rounds,
            "proposed": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "mean_accepted": round(self.accepted / self.rounds, 3) if self.rounds else None,
            "tokens_per_round": round((self.accepted + self.rounds) / self.rounds, 3) if self.rounds else None,
            "seconds": round(self.seconds, 4), "forwards": self.verifier.forwards,
            "host_syncs": self.syncs, "syncs_per_round": round(self.syncs / self.rounds, 3) if self.rounds else None,
        }
