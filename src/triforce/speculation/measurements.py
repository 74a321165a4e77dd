"""What an adaptive run measures of its stack, cheaply (no extra host synchronisation), for pricing its routes:

- each model level's forward cost in ms by tokens fed (ModelState.on_forward): LevelCosts;
- each boundary's per-token acceptance (Level.on_round): Acceptance; a draft that ran out (an n-gram proposal
  shorter than asked) counts as a rejection there;
- what each route family's rounds take beyond their forwards' modelled cost (sampling, feeds the model does not
  count): RoundCosts;
- n-gram lookup against the top level for every round whatever its route: NGramWindow. The lookup is a dict read
  and the committed text that follows is the top level's, so how much of the proposal a direct verification would
  have accepted is known (in distribution when sampling) without running it; when sampling, LookupCalibration
  scales the window by what the rounds that did verify it directly made.

Measurements holds them for one run. The figures behind the constants are in docs/performance.md ("The adaptive
planner's measurements").
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Callable

from .cost_model import Boundary, expected_tokens

MIN_ROUNDS = 3  # a boundary's acceptance, or a family's extra cost, is priced from this many measured rounds on
MAX_GAMMA_NGRAM = 8  # the longest n-gram proposal the window prices
PRIOR_SLOPE = 0.1  # with one measured token count, a forward's cost grows this fraction of it per extra token
PRIOR_MISSES = 2  # the n-gram window's prior: this many rounds more than judged, each drafting gamma, none accepted


class LevelCosts:
    """One model level's recent forward costs by tokens fed: medians of the last KEEP per count, of those made in
    the last STALE forwards where a count has any, so that a cost measured in a noisy minute ages out instead of
    outvoting the next measurements.

    The first forward of a count runs code paths for the first time (kernel set-up, allocations), so it is
    provisional: dropped when a second arrives, and used only while no count has two. A count not fed for STALE
    forwards is dropped while two fresher ones remain, so that one noisy cost cannot keep its gamma out for the
    rest of the run (Planner re-measures the count above the chosen gamma now and then). The lowest count is kept
    however old: a verification's cost grows faster per token than a decode step's, so extrapolating down to it
    from the counts above comes out low. The curve never falls as tokens grow: a forward of more tokens does more
    work, so a lower median above a higher one is noise (pooled away)."""

    KEEP = 8
    STALE = 48

    def __init__(self):
        self.samples: dict[int, deque] = {}
        self._provisional: set[int] = set()
        self.forwards = 0
        self.last: dict[int, int] = {}  # count -> the forward (self.forwards) that last fed it

    def add(self, k: int, seconds: float) -> None:
        d = self.samples.get(k)
        if d is None:
            d = self.samples[k] = deque(maxlen=self.KEEP)
            self._provisional.add(k)
        elif k in self._provisional:
            d.clear()
            self._provisional.discard(k)
        self.forwards += 1
        d.append((self.forwards, seconds * 1e3))
        self.last[k] = self.forwards

    def settled(self, k: int) -> bool:
        """Whether k tokens have been fed more than once (the first forward of a count is provisional)."""
        return k in self.samples and k not in self._provisional

    def fresh(self, k: int) -> bool:
        """Whether a settled measurement of k tokens was made within the last STALE forwards."""
        return self.settled(k) and self.forwards - self.last[k] <= self.STALE

    def _median(self, k: int) -> float:
        d = self.samples[k]
        return statistics.median([ms for i, ms in d if self.forwards - i <= self.STALE] or [d[-1][1]])

    def curve(self) -> Callable[[float], float] | None:
        """ms of a forward of k tokens (k may be fractional): linear between measured counts, the nearest
        segment's slope beyond them (with one count, PRIOR_SLOPE); None before any forward."""
        settled = [k for k in self.samples if k not in self._provisional] or list(self.samples)
        if not settled:
            return None
        kept = sorted(settled, key=lambda k: self.last[k])[-2:] + [min(settled)]  # the two latest, the lowest
        counts = sorted(k for k in settled if self.forwards - self.last[k] <= self.STALE or k in kept)
        blocks: list[tuple[float, int, list[int]]] = []  # pool adjacent violators: (level, counts pooled in it)
        for k in counts:
            c, w, ks = self._median(k), 1, [k]
            while blocks and blocks[-1][0] > c:
                pc, pw, pks = blocks.pop()
                c, w, ks = (pc * pw + c * w) / (pw + w), pw + w, pks + ks
            blocks.append((c, w, ks))
        pts = [(k, c) for c, _, ks in blocks for k in ks]
        if len(pts) == 1:
            k0, c0 = pts[0]
            return lambda k: max(c0 * (1.0 + PRIOR_SLOPE * (k - k0)), 0.0)
        ks = [p[0] for p in pts]
        cs = [p[1] for p in pts]

        top_slope = (cs[-1] - cs[-2]) / (ks[-1] - ks[-2])
        if top_slope <= 0.0:  # flat at the top (pooled): beyond it, grow as the prior says
            top_slope = PRIOR_SLOPE * cs[-1]

        def cost(k: float) -> float:
            if k > ks[-1]:
                return cs[-1] + top_slope * (k - ks[-1])
            i = 1
            while i < len(ks) - 1 and ks[i] < k:
                i += 1
            k0, k1, c0, c1 = ks[i - 1], ks[i], cs[i - 1], cs[i]
            return max(c0 + (c1 - c0) * (k - k0) / (k1 - k0), 0.0)
        return cost


class Acceptance:
    """Per-token acceptance at one boundary: accepted / (accepted + rounds that stopped short + 1), the geometric
    model's estimate with one stop more than seen (else a probe's few all-accepted rounds would make the longest
    gamma look free). A measurement weighs DECAY less per round of the run since it was made, whether or not the
    boundary ran in between: text changes while a route sits out, and a probe after a long pause must not be
    outvoted by what the boundary met long ago."""

    DECAY = 0.93

    def __init__(self):
        self.accepted = self.stopped = 0.0
        self.rounds = 0
        self.last_round = 0

    def add(self, accepted: int, stopped: bool, round_index: int) -> None:
        fade = self.DECAY ** max(round_index - self.last_round, 1)
        self.accepted = self.accepted * fade + accepted
        self.stopped = self.stopped * fade + stopped
        self.rounds += 1
        self.last_round = round_index

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.stopped + 1.0)


class RoundCosts:
    """What one route family's rounds take beyond the modelled cost of their forwards, over its last KEEP rounds:
    each round's own time (ModelRunner.own_clock) minus that cost. The difference is real and differs by family
    (sampling and acceptance per round, a drafter's 2-token feed after a fully accepted round, priced as 1, a
    level's catch-up feed after sitting out): priced by forwards alone, the routes near plain decoding's price
    would run slower than it. The largest eighth is left out: a rebuild's or a switch's one-off cost is priced
    apart (Planner's setup_ms)."""

    KEEP = 16

    def __init__(self):
        self.rounds: deque = deque(maxlen=self.KEEP)  # ms beyond the modelled cost of its forwards, per round

    def add(self, ms: float, forwards_ms: float) -> None:
        self.rounds.append(ms - forwards_ms)

    def extra_ms(self) -> float | None:
        """ms a round costs beyond its forwards' modelled cost; None before MIN_ROUNDS rounds."""
        if len(self.rounds) < MIN_ROUNDS:
            return None
        kept = sorted(self.rounds)[:len(self.rounds) - len(self.rounds) // 8]
        return sum(kept) / len(kept)


class NGramWindow:
    """n-gram lookup against the top level, judged for every round whatever its route: each round's proposal is
    compared with the committed text that follows it, once that is known (a round or two later). The match
    length is what a direct verification of the proposal accepts: at temperature 0 exactly; when sampling, in
    distribution, since a one-hot draft x is accepted exactly when the verifier's token is x, and the committed
    text is distributed as the verifier's output whatever the route."""

    KEEP = 48

    def __init__(self):
        self.rounds: deque = deque(maxlen=self.KEEP)  # (match class, proposal length, matched)
        self.pending: deque = deque()  # (position, proposal, match class) not yet judged
        # the pending ones as of the last judge(): (class, length, matched so far)
        self.open: list[tuple[int, int, int]] = []

    def propose(self, position: int, proposal: list[int], cls: int = 0) -> None:
        """A round's proposal; `cls`: its match class (the n-gram length that matched; 0: no proposal)."""
        if proposal:
            self.pending.append((position, proposal, cls))
        else:
            self.rounds.append((0, 0, 0))

    def judge(self, seq: list[int]) -> None:
        """Judge the pending proposals that the committed sequence `seq` now decides; the others keep how far
        they match so far (`open`)."""
        self.open = []
        undecided = deque()
        for pos, proposal, cls in self.pending:
            m = 0
            while m < len(proposal) and pos + m < len(seq) and seq[pos + m] == proposal[m]:
                m += 1
            if m < len(proposal) and pos + m >= len(seq):
                self.open.append((cls, len(proposal), m))  # still matching where the sequence ends
                undecided.append((pos, proposal, cls))
            else:
                self.rounds.append((cls, len(proposal), m))
        self.pending = undecided

    def classes(self) -> set[int]:
        return {c for c, _, _ in self.rounds} | {c for c, _, _ in self.open}

    def boundary(self, cls: int | None = None) -> Boundary | None:
        """Tokens per round and drafted tokens by gamma, over the rounds of match class `cls` (None: all). An
        undecided proposal counts with what it matched so far, its undecided rest at the judged rate (matched /
        (matched + misses)): on repeating text most proposals stay undecided for several rounds, and waiting for
        them would keep the run on a slower route."""
        rounds = [(d, m) for c, d, m in self.rounds if cls is None or c == cls]
        opened = [(d, m) for c, d, m in self.open if cls is None or c == cls]
        n = len(rounds) + len(opened)
        if n < MIN_ROUNDS:
            return None
        matched = sum(m for _, m in rounds) + sum(m for _, m in opened)
        misses = sum(1 for d, m in rounds if m < d) + PRIOR_MISSES
        rate = (matched + 1.0) / (matched + misses + 2.0)
        tokens, drafted = [], []
        for g in range(MAX_GAMMA_NGRAM + 1):
            total = sum(min(m, g) for _, m in rounds)
            for d, m in opened:
                total += min(m, g) + (expected_tokens(rate, min(d, g) - m) - 1.0 if m < min(d, g) else 0.0)
            tokens.append(total / (n + PRIOR_MISSES) + 1.0)
            drafted.append((sum(min(d, g) for d, _ in rounds) + sum(min(d, g) for d, _ in opened)
                            + PRIOR_MISSES * g) / (n + PRIOR_MISSES))
        return Boundary(tokens.__getitem__, drafted.__getitem__)


class LookupCalibration:
    """When sampling, what the rounds of n-gram lookup verified directly yielded against what the window predicted
    for them: the window's tokens per round beyond the first, scaled by (accepted + PRIOR) / (predicted + PRIOR)
    over the last KEEP such rounds. A sampled window is a noisy estimate, a route is chosen when it looks good, and
    its rounds then fall back to the mean (the winner's curse). Greedy runs are not scaled: there the window's
    matches are the text's own, and a factor from a few rounds would cost long gammas their gains."""

    KEEP = 32
    PRIOR = 2.0  # drafts accepted as predicted, before any round: a factor of 1 until rounds say otherwise

    def __init__(self):
        self.rounds: deque = deque(maxlen=self.KEEP)  # (predicted, accepted) drafts per round

    def add(self, predicted_tokens: float, tokens: int) -> None:
        self.rounds.append((predicted_tokens - 1.0, tokens - 1))

    @property
    def factor(self) -> float:
        predicted = sum(p for p, _ in self.rounds)
        accepted = sum(a for _, a in self.rounds)
        return (accepted + self.PRIOR) / (predicted + self.PRIOR)

    def boundary(self, window: Boundary | None) -> Boundary | None:
        """The window's boundary with its accepted drafts scaled by `factor`."""
        if window is None:
            return None
        f = self.factor
        return Boundary(lambda g: 1.0 + f * (window.tokens(g) - 1.0), window.drafted)


class Measurements:
    """Everything one adaptive run has measured of its stack, by level index (`kinds`: bottom to top) and by route
    family (`families`: tuples of level indices), and each boundary's acceptance as a cost_model.Boundary."""

    def __init__(self, kinds: list[str], families: list[tuple[int, ...]], sampled: bool):
        self.top = len(kinds) - 1
        self.ngram = kinds[0] == "ngram"
        self.costs = {i: LevelCosts() for i, k in enumerate(kinds) if k != "ngram"}
        self.acceptance: dict[tuple[int, int], Acceptance] = {}
        self.seen: dict[tuple[int, int], int] = {}  # boundary -> the last round that measured it
        self.ngram_top = NGramWindow() if self.ngram else None
        self.lookup_calibration = LookupCalibration() if sampled and self.ngram else None
        self.round_costs = {f: RoundCosts() for f in families}

    def measured_by_window(self, below: int, above: int) -> bool:
        """Whether the boundary is n-gram lookup against the top: NGramWindow judges it every round."""
        return self.ngram and below == 0 and above == self.top

    def observe(self, below: int, above: int, asked: int, accepted: int, round_index: int) -> None:
        """A verification at boundary (below, above) of round `round_index` accepted `accepted` of `asked` drafts."""
        if self.measured_by_window(below, above):
            return
        a = self.acceptance.get((below, above))
        if a is None:
            a = self.acceptance[below, above] = Acceptance()
        a.add(accepted, accepted < asked, round_index)
        self.seen[below, above] = round_index - 1

    def curves(self) -> dict[int, Callable[[float], float] | None]:
        """Each model level's forward cost curve as of now (LevelCosts.curve)."""
        return {i: c.curve() for i, c in self.costs.items()}

    def boundary(self, below: int, above: int, ngram: Boundary | None) -> Boundary | None:
        """The boundary's yield by gamma; None while it has fewer than MIN_ROUNDS measured rounds. `ngram`: the
        n-gram window's boundary the prices are for (all rounds', or one match class's)."""
        if self.measured_by_window(below, above):
            return ngram if self.lookup_calibration is None else self.lookup_calibration.boundary(ngram)
        a = self.acceptance.get((below, above))
        if a is None or a.rounds < MIN_ROUNDS:
            return None
        alpha = a.alpha
        if self.ngram and ngram is not None and below == 0:  # proposals stop where the match does
            drafted = ngram.drafted
            return Boundary(lambda g: expected_tokens(alpha, drafted(g)), drafted)
        return Boundary.iid(alpha)

    def extra_ms(self, family: tuple[int, ...], optimistic: bool = False) -> float:
        """A round's cost beyond its forwards' for the family: measured, else (and for a best case) 0. Unmeasured
        is priced optimistically on purpose: running the family is what measures it, and a family priced with
        another's extra cost might never be chosen to run."""
        own = None if optimistic else self.round_costs[family].extra_ms()
        return 0.0 if own is None else own
