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


def accept(draft: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """draft [k] with proposal rows q [k, V]; verifier rows p [k + 1, V].
    -> (number of accepted draft tokens j, the next token: residual sample at j, or bonus if j == k)."""
    k = len(draft)
    if k:
        idx = torch.arange(k, device=p.device)
        tok = torch.tensor(draft, device=p.device)
        px, qx = p[idx, tok], q[idx, tok]
        u = torch.rand(k, generator=generator, device=p.device)
        ok = u * qx < px  # P(accept) = min(1, px / qx); qx > 0 since x was drawn from q
        rejected = (~ok).nonzero()
        j = int(rejected[0]) if len(rejected) else k
    else:
        j = 0
    if j < k:
        residual = (p[j] - q[j]).clamp_(min=0)
        total = residual.sum()
        # total == 0 only if p == q up to rounding, where rejection has probability 0
        dist = residual / total if total > 0 else p[j]
    else:
        dist = p[k]
    return j, int(sample(dist, generator))


class Level:
    """`drafter` proposes up to `gamma` tokens, `verifier` checks them in one forward."""

    def __init__(self, name: str, drafter, verifier: ModelState, gamma: int, generator: torch.Generator):
        self.name, self.drafter, self.verifier, self.gamma, self.generator = name, drafter, verifier, gamma, generator
        self.rounds = self.drafted = self.accepted = 0
        self.seconds = 0.0
        self.recent: list[float] = []  # acceptance of the last rounds, for rebuild policies

    def _round(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor]:
        draft, q = self.drafter.propose(ctx, committed, k)
        t = time.perf_counter()
        p = self.verifier.score(ctx, committed, draft)
        j, nxt = accept(draft, q, p, self.generator)
        self.seconds += time.perf_counter() - t
        self.rounds += 1
        self.drafted += len(draft)
        self.accepted += j
        if draft:
            self.recent = (self.recent + [j / len(draft)])[-8:]
        return draft[:j] + [nxt], p[:j + 1]

    def step(self, ctx: list[int], committed: int, limit: int) -> list[int]:
        """One round at the top of the stack: 1 to gamma + 1 tokens (at most `limit`)."""
        return self._round(ctx, committed, min(self.gamma, limit))[0][:limit]

    def propose(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor]:
        """Exactly k tokens distributed as the verifier's model, with its rows as their q."""
        out: list[int] = []
        rows: list[torch.Tensor] = []
        while len(out) < k:
            toks, p = self._round(ctx + out, committed, min(self.gamma, k - len(out)))
            out += toks
            rows.append(p)
        return out[:k], torch.cat(rows)[:k]

    def stats(self) -> dict:
        return {
            "level": self.name, "role": "verify", "gamma": self.gamma, "rounds": self.rounds,
            "proposed": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "mean_accepted": round(self.accepted / self.rounds, 3) if self.rounds else None,
            "tokens_per_round": round((self.accepted + self.rounds) / self.rounds, 3) if self.rounds else None,
            "seconds": round(self.seconds, 4), "forwards": self.verifier.forwards,
        }
