"""The n-gram shortcut: a round of a stack's top level that verifies an n-gram proposal directly, past the levels
between, when proposals like it have lately been accepted.

Each round looks the n-gram drafter's proposal up first. Proposals are grouped by the length of the n-gram they
matched (a 3-token match in repeated text is accepted far more often than a 1-token match anywhere); a round
takes the shortcut when that group's recent proposals were accepted at least `accept_above` of the time. Repeated
text then costs no middle-level forwards, and new text still goes through them. Every round counts for the rates:
a direct round by what it accepted, a round through the middle by how far the proposal matched the tokens the
round emitted, which is what a direct round would have accepted (at temperature 0 exactly; sampled, in
distribution, the emitted tokens being the verifier's either way). The route is chosen from past rounds only,
before the round's verification draws anything, so the output stays exactly the verifier's.

Worked example (accept_above 0.6): the last four proposals from 3-token matches were accepted 4 of 4, 3 of 4,
4 of 4 and 2 of 4 (rate 13 / 16 = 0.81): this round's proposal, also from a 3-token match, is verified directly.
A proposal from a 1-token match, whose group stands at 0.2, goes through the levels between.
"""
from __future__ import annotations

from collections import deque

from .drafters import NGramDrafter


class NGramShortcut:
    HISTORY = 16  # proposals per match length whose outcome is remembered
    MIN_HISTORY = 4  # fewer: the rate is unknown and the round goes through the levels between

    def __init__(self, ngram: NGramDrafter, accept_above: float):
        self.ngram, self.accept_above = ngram, accept_above
        self.rounds = 0  # rounds that took the shortcut
        self._history: dict[int, deque] = {}  # match length -> (drafted, accepted) of recent proposals
        self._lookahead: tuple[list[int], int] = ([], 0)  # this round's proposal and its match length

    def rate(self, n: int) -> float | None:
        """Accepted / drafted over the remembered proposals from n-gram matches of length n (None: too few)."""
        h = self._history.get(n)
        if h is None or len(h) < self.MIN_HISTORY:
            return None
        return sum(a for _, a in h) / sum(d for d, _ in h)

    def choose(self, ctx: list[int], committed: int, k: int, drafter):
        """This round's drafter: the n-gram drafter where its proposal's match length has earned it, else
        `drafter` (the levels between)."""
        self._lookahead = self.ngram.lookup(ctx, committed, k)
        tokens, n = self._lookahead
        rate = self.rate(n) if tokens else None
        if rate is not None and rate >= self.accept_above:
            self.rounds += 1
            return self.ngram
        return drafter

    def remember(self, emitted: list[int]) -> None:
        """The round emitted these tokens: how many of its proposal a direct verification accepted or would have
        (the proposal's prefix equal to them; past the emitted tokens nothing is known)."""
        proposal, n = self._lookahead
        self._lookahead = ([], 0)
        if not proposal:
            return
        m = 0
        while m < min(len(proposal), len(emitted)) and proposal[m] == emitted[m]:
            m += 1
        drafted = len(proposal) if m < len(emitted) else m
        if drafted:
            self._history.setdefault(n, deque(maxlen=self.HISTORY)).append((drafted, m))

    def stats(self) -> dict:
        return {"shortcut_rounds": self.rounds,
                "shortcut_rate_by_match": {str(n): round(r, 3) for n in sorted(self._history)
                                           if (r := self.rate(n)) is not None}}
