"""The adaptive stack: each round runs a *route* through the built levels, chosen from what the run has measured.

A stack's levels are built once (builder.BuiltStack). A route is the sub-stack one round runs: some of the levels
below the top, in order, and the top (`full`), with a gamma per boundary. For the default stack
ngram -> retrieval -> full the routes are

    full                       plain decoding (`ar`): one forward of one token
    ngram,full       @g        prompt lookup verified directly
    retrieval,full   @g        the retrieval level drafting by itself
    ngram,retrieval,full @d,g  the whole stack

Any route gives exactly the target's output (the top level verifies whatever is drafted), and the route of a round
is chosen before the round from earlier rounds only, so switching keeps greedy output identical to `ar` and
sampled output distributed as the target's. What is measured, cheaply (no extra host synchronisation):
- each model level's forward cost in ms by tokens fed (ModelState.on_forward): medians of the last few per count,
  interpolated between counts (LevelCosts);
- each boundary's per-token acceptance (Level.on_round), the geometric model's estimate over recent rounds
  (Acceptance); a draft that ran out (an n-gram proposal shorter than asked) counts as a rejection there;
- each route family's rounds: what they took beyond their forwards' modelled cost (RoundCosts: sampling, feeds
  the model does not count);
- n-gram lookup against the full level for every round whatever its route (NGramWindow): the lookup is a dict
  read, and the committed text that follows is the full level's, so how many of the proposal a direct
  verification would have accepted is known (in distribution when sampling) without running it.

Every PLAN_EVERY generated tokens the planner prices every route with the cost model that `triforce tune` uses
(cost_model.chain_ms, the arithmetic of cost_model.ms_per_token) and moves to the cheapest when it beats the current
route by SWITCH_GAIN (hysteresis: timings are noisy), or, when the cheapest is plain decoding, by any margin. It
plans once for all rounds and once per n-gram *match class*: a round's lookup is made before its route is chosen,
and the length of the n-gram it matched says much about whether its proposal will be accepted (a 3-token match in
repeated text, a 1-token match almost anywhere), so the routes through n-gram lookup are priced again with that
class's rounds alone. Routes through a model level below the top are only measured by running them: the given
stack runs its first MIN_ROUNDS rounds, and then one route is probed now and then (every PROBE_FIRST rounds,
doubling to PROBE_MAX while probes do not win), for as many rounds as pricing it takes: the run comes back to the
stack when the text becomes predictable again. Forward costs that only running measures (a plain step's, an
n-gram verification's while decoding plainly) are measured again when stale and able to change the choice.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from itertools import combinations, product
from typing import Callable

import torch

from .cost_model import Boundary, chain_ms, expected_tokens
from .drafters import ModelDrafter, NGramDrafter
from .level import Level, verify_rates
from .provenance import drafted_by
from .stack import DRAFT_ONLY
from .state import ModelState

PLAN_EVERY = 12  # generated tokens between re-plans
EARLY_PLANS = 8  # ... but the first plans come every round: the early measurements change fast
MIN_ROUNDS = 3  # a boundary's acceptance is priced from this many measured rounds on
SWITCH_GAIN = 0.05  # a route must be predicted this much cheaper than the current one to replace it
PROBE_FIRST, PROBE_MAX = 8, 64  # rounds between probes of an unmeasured or stale route family
MAX_GAMMA_TOP = 6  # gammas the planner considers at the top boundary (n-gram lookup: MAX_GAMMA_NGRAM)
MAX_GAMMA_NGRAM = 8
MAX_GAMMA_BELOW = 4  # ... and at the boundaries below
START_GAMMA = 2  # rounds 1 to MIN_ROUNDS run the given stack with gammas of at most this
CATCH_UP = 32  # a rebuilt level (retrieval, h2o) that sat out this many committed tokens is rebuilt, not re-fed
PROBE_HORIZON = 32  # no probe with fewer tokens left to generate: what it finds would pay over too few
PRIOR_SLOPE = 0.1  # with one measured token count, a forward's cost grows this fraction of it per extra token
PLAIN_REFRESH = 0.75  # a stale plain-step cost is measured again while the route is priced above this share of it
PRIOR_MISSES = 2  # the n-gram window's prior: this many rounds more than judged, each drafting gamma, none accepted


def _repays(saving_ms: float, family: tuple[int, ...], remaining: int | None,
            setup_ms: Callable[[tuple[int, ...]], float] | None) -> bool:
    """Whether saving `saving_ms` per token over the `remaining` tokens repays what starting `family` costs now
    (`setup_ms`: Planner.next_route's); with no limit or no setup cost given, it does."""
    return remaining is None or setup_ms is None or saving_ms * remaining > setup_ms(family)


def _round(cost: Callable[[float], float], boundary: Boundary, gamma: int) -> tuple[int, float, float]:
    """One boundary's round at `gamma` as chain_ms takes it: (gamma, ms of the verifying forward, tokens per round)."""
    return gamma, cost(1 + boundary.drafted(gamma)), boundary.tokens(gamma)


@dataclass(frozen=True)
class Route:
    """levels: indices into the stack's levels, bottom to top, ending with the top; gammas: one per boundary."""

    levels: tuple[int, ...]
    gammas: tuple[int, ...]

    def text(self, names: list[str]) -> str:
        out = ",".join(names[i] for i in self.levels)
        return out + (f"@{','.join(map(str, self.gammas))}" if self.gammas else "")


class LevelCosts:
    """One model level's recent forward costs by tokens fed: medians of the last KEEP per count, of those made in
    the last STALE forwards where a count has any (a cost measured in a noisy minute ages out of its median
    instead of outvoting the next measurements for as long as they take to come). The first
    forward of a count runs code paths for the first time (kernel set-up, allocations: the first decode step of a
    run took 60x a later one), so it is provisional: dropped when a second arrives, and used only while no count
    has two. A count not fed for STALE forwards of the level is dropped while two fresher ones remain (a cost
    measured in a noisy minute must not keep its gamma out for the rest of the run; Planner.next_route measures the
    count above the chosen gamma again now and then), but the lowest count is kept however old: below it the cost
    would be extrapolated down from the counts above, and a verification's cost grows faster per token than a
    decode step's does (on the AVX2 build at 32K: 40 ms for 1 token, 53 for 2, 74 for 3, so 1 token came out at
    33). The curve never falls as tokens grow (a forward of more tokens does more work: a lower median above a
    higher one is noise)."""

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
    model's estimate with one stop more than seen (a probe's 3 rounds of 2 drafts all accepted make 6/7, not 1: at
    1 the longest gamma looked free, and ran at 2.4x its price), over recent rounds: a measurement weighs DECAY
    less per round of the run since it was made,
    whether or not the boundary ran in between (text changes while a route sits out: a probe after a long pause
    must not be outvoted by what the boundary met long ago)."""

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
    """What one route family's rounds take beyond the modelled cost of their forwards (by tokens fed, drafts per
    round), over its last KEEP rounds: each round's own time (ModelRunner.own_clock: its span; in a serving batch, its
    forwards' shares of their batches and its own CPU time) minus that
    cost. The difference is real and differs by family: sampling and acceptance per round, a drafter feeding 2
    tokens after a round that accepted all its drafts (priced as 1), a level's catch-up feed after sitting out. On
    the AVX2 build at 32K a `retrieval,full@1` round took 83 ms where its forwards were priced at 65, and a plain
    step 42 against 40: priced by forwards alone, the routes near plain decoding's price ran slower than it. The
    estimate leaves out the rounds with the largest eighth (a rebuild's or a switch's one-off cost is priced apart:
    Planner._probe's setup_ms)."""

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
        self.open: list[tuple[int, int, int]] = []  # the pending ones as of the last judge(): (class, length, matched so far)

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
    over the last KEEP such rounds. Why: a sampled window is a noisy estimate, a route is chosen when it looks good,
    and its rounds then fall back to the mean (the winner's curse). In a serving batch of 8 sampled requests (8K,
    T = 0.6) the window predicted 1.90 tokens per `ngram,full@2` round, 2.25 at gamma 3 and 3.61 at gamma 6, where
    the rounds made 1.54, 1.14 and 1.44, and plain decoding was faster than any of them. Greedy runs are not
    scaled: there the window's matches are the text's own, and a factor from a few rounds cost long gammas their
    gains (8 greedy requests: 84 tokens/s scaled against 95 unscaled, alternated runs)."""

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


class Planner:
    """Chooses each round's route from the measurements (see the module docstring). `kinds` are the stack's level
    kinds bottom to top, `start` the route of the stack as given (its gammas)."""

    def __init__(self, kinds: list[str], start: Route, force: Callable[[int], Route | None] | None = None,
                 sampled: bool = False):
        self.kinds, self.start, self.force = kinds, start, force
        self.top = len(kinds) - 1
        self.ngram = kinds[0] == "ngram"
        self.costs = {i: LevelCosts() for i, k in enumerate(kinds) if k != "ngram"}
        self.acceptance: dict[tuple[int, int], Acceptance] = {}
        self.ngram_top = NGramWindow() if self.ngram else None
        self.lookup_calibration = LookupCalibration() if sampled and self.ngram else None  # (see LookupCalibration)
        self.families = self._families()
        self.route = Route((self.top,), ())  # the first round: a plain step (measures it, risks nothing)
        self.round = 0
        self.seen: dict[tuple[int, int], int] = {}  # boundary -> the last round that measured it
        self.probe_gap = PROBE_FIRST
        self.probing: tuple[int, ...] | None = None
        self.probe_route: Route | None = None
        self.probe_rounds = 0  # rounds the current probe has run
        self.predicted: dict[str, float] = {}  # route text -> ms/token at the last plan
        self.plans = 0
        self.planned_at = -PLAN_EVERY  # tokens generated at the last plan
        self._ngram_boundary: Boundary | None = None
        self._class_boundaries: dict[int, Boundary] = {}  # n-gram match class -> its window boundary (plan())
        self._curves: dict | None = None  # the cost curves of the last plan
        self.by_class: dict[int, Route] = {}  # n-gram match class -> its route (plan())
        self.round_costs = {f: RoundCosts() for f in self.families}

    def _families(self) -> list[tuple[int, ...]]:
        """Every sub-stack: any levels below the top, in order (n-gram lookup only at the bottom), then the top."""
        below = range(self.top)
        out = []
        for r in range(len(below) + 1):
            for c in combinations(below, r):
                if all(self.kinds[i] != "ngram" or i == c[0] for i in c):
                    out.append(c + (self.top,))
        return out

    # -- measurements ------------------------------------------------------------------------------------------
    def observe(self, below: int, above: int, asked: int, drafted: int, accepted: int) -> None:
        if self.ngram and below == 0 and above == self.top:
            return  # measured for every round by NGramWindow
        a = self.acceptance.get((below, above))
        if a is None:
            a = self.acceptance[below, above] = Acceptance()
        a.add(accepted, accepted < asked, self.round)
        self.seen[below, above] = self.round - 1

    def record_round(self, route: Route, cls: int | None, ms: float, tokens: int | None = None) -> None:
        """A round of `route` (for a round of n-gram match class `cls`) took `ms` of its own time (RoundCosts) and
        made `tokens` (LookupCalibration, for n-gram lookup verified directly), from the first plan on (the first
        round runs code paths for the first time; the stack's first rounds cannot be priced)."""
        if self._curves is None or self.round <= 1:
            return
        ngram = self._class_boundaries.get(cls, self._ngram_boundary)
        calibration = self.lookup_calibration
        if tokens is not None and ngram is not None and calibration is not None and route.levels == (0, self.top):
            calibration.add(ngram.tokens(route.gammas[0]), tokens)
        modelled = self._modelled(route, self._curves, ngram)
        if modelled is None:
            return
        ms_per_token, per_round = modelled
        self.round_costs[route.levels].add(ms, ms_per_token * per_round)

    def _extra_ms(self, family: tuple[int, ...], optimistic: bool = False) -> float:
        """A round's cost beyond its forwards' for the family: measured, else (and for a best case) 0. Unmeasured
        is priced optimistically on purpose: running the family is what measures it (a family given another's
        extra cost, plain decoding given the retrieval routes' 18 ms, ran 110 rounds before it could be chosen)."""
        own = None if optimistic else self.round_costs[family].extra_ms()
        return 0.0 if own is None else own

    def _boundary(self, below: int, above: int, ngram: Boundary | None) -> Boundary | None:
        """`ngram`: the n-gram window's boundary the prices are for (all rounds', or one match class's)."""
        if self.ngram and below == 0 and above == self.top:
            return ngram if self.lookup_calibration is None else self.lookup_calibration.boundary(ngram)
        a = self.acceptance.get((below, above))
        if a is None or a.rounds < MIN_ROUNDS:
            return None
        alpha = a.alpha
        if self.ngram and ngram is not None and below == 0:  # proposals stop where the match does
            drafted = ngram.drafted
            return Boundary(lambda g: expected_tokens(alpha, drafted(g)), drafted)
        return Boundary.iid(alpha)

    # -- pricing -----------------------------------------------------------------------------------------------
    def _max_gamma(self, below: int, above: int) -> int:
        if above != self.top:
            return MAX_GAMMA_BELOW
        return MAX_GAMMA_NGRAM if self.kinds[below] == "ngram" else MAX_GAMMA_TOP

    def _gamma_grids(self, family: tuple[int, ...]) -> list[range]:
        """The gammas considered at each boundary of the family, bottom first."""
        return [range(1, self._max_gamma(below, above) + 1) for below, above in zip(family, family[1:])]

    def _measured(self) -> dict:
        """The cost curves of the model levels, and the n-gram window's boundary, as of now (for price())."""
        self._ngram_boundary = self.ngram_top.boundary() if self.ngram else None
        return {i: c.curve() for i, c in self.costs.items()}

    def _steps(self, family: tuple[int, ...], curves: dict, optimistic: bool, ngram: Boundary | None):
        """-> (ms of a bottom draft, [(cost curve of the level above, its boundary) per boundary, bottom first]),
        or None while something the family needs is unmeasured (see price)."""
        bottom = family[0]
        if self.kinds[bottom] == "ngram":
            bottom_ms = 0.0
        elif curves.get(bottom) is None:
            return None
        else:
            bottom_ms = curves[bottom](1)
        steps = []
        for below, above in zip(family, family[1:]):
            if optimistic and self.kinds[below] != "ngram":
                b = Boundary.iid(1.0)
            elif optimistic:  # a model level takes n-gram drafts about as the full level does
                b = ngram or Boundary.iid(1.0)
            else:
                b = self._boundary(below, above, ngram)
            if b is None or curves.get(above) is None:
                return None
            steps.append((curves[above], b))
        return bottom_ms, steps

    def _modelled(self, route: Route, curves: dict, ngram: Boundary | None) -> tuple[float, float] | None:
        """The route's (ms/token by its forwards alone, tokens per round at the top), None while unpriceable."""
        found = self._steps(route.levels, curves, False, ngram)
        if found is None:
            return None
        bottom_ms, steps = found
        if not steps:
            return bottom_ms, 1.0
        rounds = [_round(cost, b, g) for (cost, b), g in zip(steps, route.gammas)]
        return chain_ms(bottom_ms, rounds), rounds[-1][2]

    def price(self, family: tuple[int, ...], curves: dict, optimistic: bool = False,
              ngram: Boundary | None = None) -> tuple[float, Route] | None:
        """The family's cheapest gammas and their predicted ms/token; None while something it needs is unmeasured.
        A round costs its forwards (priced from `curves`, from _measured(), and the boundaries' acceptance) plus
        what the family's rounds have measured beyond them (RoundCosts). `optimistic`: its best case, every draft
        of a model level accepted, n-gram drafts taken as the full level takes them, nothing beyond its forwards (a
        bound for _probe). `ngram`: one match class's window boundary (default: all rounds', from _measured())."""
        ngram = self._ngram_boundary if ngram is None else ngram
        found = self._steps(family, curves, optimistic, ngram)
        if found is None:
            return None
        bottom_ms, steps = found
        extra = self._extra_ms(family, optimistic)
        if not steps:  # plain decoding
            return bottom_ms + extra, Route(family, ())
        # per boundary and gamma: (gamma, ms of the verifying forward, tokens per round), computed once
        tables = []
        for (cost, b), grid in zip(steps, self._gamma_grids(family)):
            tables.append([_round(cost, b, g) for g in grid])
        best = None
        for combo in product(*tables):
            ms = chain_ms(bottom_ms, combo) + extra / combo[-1][2]
            if best is None or ms < best[0]:
                best = (ms, combo)
        return best[0], Route(family, tuple(g for g, _, _ in best[1]))

    def _stale(self, family: tuple[int, ...]) -> bool:
        """Whether a boundary of the family went unmeasured for probe_gap rounds: only running a route through a
        level measures the acceptance of its drafts (n-gram lookup against the top excepted: NGramWindow)."""
        return any(self.round - self.seen.get(b, -10 ** 9) > self.probe_gap
                   for b in zip(family, family[1:]) if not (self.ngram and b == (0, self.top)))

    def plan(self, remaining: int | None = None,
             setup_ms: Callable[[tuple[int, ...]], float] | None = None) -> tuple[dict, dict]:
        """Re-choose the route -> (the cost curves, every family's price) it was chosen from, for _probe.
        `remaining`, `setup_ms`: as next_route's (a switch must repay what starting its family costs)."""
        self.plans += 1
        curves = self._curves = self._measured()
        priced = {f: self.price(f, curves) for f in self.families}
        names = self.kinds
        self.predicted = {p[1].text(names): round(p[0], 3) for p in priced.values() if p is not None}
        if all(p is None for p in priced.values()):
            return curves, priced
        self.route = self._choose(priced, self.route, remaining, setup_ms)
        if self.ngram:
            self._plan_classes(curves, priced, remaining, setup_ms)
        return curves, priced

    def _choose(self, priced: dict, route: Route, remaining: int | None = None,
                setup_ms: Callable[[tuple[int, ...]], float] | None = None) -> Route:
        """The cheapest priced route, unless it beats `route`'s family by less than SWITCH_GAIN (hysteresis: timings
        are noisy). Plain decoding needs no margin: it is the baseline every route must beat, and where every route
        costs about what it does (the AVX2 build's sampled dialogue), a route kept for being within the margin ran
        5-7% behind `ar` for the rest of the run. Nor a route whose family costs more to start
        (`setup_ms(family)`: levels that sat out re-fed or rebuilt) than it saves over the `remaining` tokens: in a
        serving batch at 8K, rounds that re-fed a retrieval level 16-28 tokens took 56-128 ms, 4-10 plain steps,
        at the start of routes priced within 10% of plain decoding."""
        current = priced.get(route.levels)
        best = min((p for p in priced.values() if p is not None), key=lambda p: p[0], default=None)
        if best is None:
            return route
        gain = 0.0 if best[1].levels == (self.top,) else SWITCH_GAIN
        if current is None:
            return best[1]
        if best[0] < (1.0 - gain) * current[0] and (
                best[1].levels == route.levels or _repays(current[0] - best[0], best[1].levels, remaining, setup_ms)):
            return best[1]
        return current[1]  # the same levels, gammas re-tuned

    def _plan_classes(self, curves: dict, priced: dict, remaining: int | None = None,
                      setup_ms: Callable[[tuple[int, ...]], float] | None = None) -> None:
        """A route per n-gram match class: a round's lookup is made before its route is chosen, and how often a
        proposal is accepted depends much on the length of the match it came from (a 3-token match in repeated
        text against a 1-token one anywhere). The families through n-gram lookup are re-priced with that class's
        rounds only; the others cost what they cost for any class. A class with too few judged rounds takes the
        route planned for all."""
        through_ngram = [f for f in self.families if f[0] == 0]
        self._class_boundaries = {}
        for cls in self.ngram_top.classes():
            b = self.ngram_top.boundary(cls)
            if b is None:
                self.by_class.pop(cls, None)
                continue
            self._class_boundaries[cls] = b
            by_cls = dict(priced)
            by_cls.update({f: self.price(f, curves, ngram=b) for f in through_ngram})
            self.by_class[cls] = self._choose(by_cls, self.by_class.get(cls, self.route), remaining, setup_ms)

    def _settle_probe(self, priced: dict) -> Route | None:
        """After a probe round: its route again while the family cannot be priced yet (a boundary's acceptance is
        priced from MIN_ROUNDS rounds on: one round would be spent for nothing, and counted as a probe that lost);
        else the probe is over, and one that did not win makes the next come later."""
        if self.probing is None:
            return None
        if priced.get(self.probing) is None and self.probe_rounds < MIN_ROUNDS:
            self.probe_rounds += 1
            return self.probe_route
        if self.route.levels == self.probing:
            self.probe_gap = PROBE_FIRST
        else:
            self.probe_gap = min(2 * self.probe_gap, PROBE_MAX)
        self.probing = None
        return None

    def _probe(self, curves: dict, priced: dict, remaining: int | None = None,
               setup_ms: Callable[[tuple[int, ...]], float] | None = None) -> Route | None:
        """A family that only running measures, unmeasured for probe_gap rounds, and that could still win: one round
        of its best-priced route. "Could win": priced with every draft of a model level accepted (and n-gram drafts
        for a model level as the full level takes them), it beats the current route, by more than what starting it
        costs (`setup_ms(family)`: the rebuild of a retrieval level that sat out) over the `remaining` tokens the
        run may still generate; and PROBE_HORIZON tokens are left. `curves`, `priced`: from plan()."""
        if remaining is not None and remaining < PROBE_HORIZON:
            return None
        stale = [f for f in self.families if f != self.route.levels and self._stale(f)]
        if not stale:
            return None
        current = priced[self.route.levels]
        options = []
        for f in stale:
            best_case = self.price(f, curves, optimistic=True)
            if current is not None and best_case is not None:
                if best_case[0] >= (1.0 - SWITCH_GAIN) * current[0]:
                    continue
                if not _repays(current[0] - best_case[0], f, remaining, setup_ms):
                    continue
            p = priced[f]
            options.append((p[0] if p is not None else 0.0, f, p[1] if p is not None else self._start_of(f)))
        if not options:
            return None
        options.sort(key=lambda o: o[0])
        # with short drafts: a probe measures acceptance, which is per token whatever the gamma, and a long one
        # costs much when it fails (a 7-token verification took 4 decode steps on the AVX2 build at 32K)
        _, family, route = options[0]
        self.probe_route = Route(family, tuple(min(g, START_GAMMA) for g in route.gammas))
        self.probing, self.probe_rounds = family, 1
        return self.probe_route

    def _start_of(self, family: tuple[int, ...]) -> Route:
        """An unmeasured family's first gammas: the given stack's at the boundaries they share, else its top gamma."""
        given = dict(zip(zip(self.start.levels, self.start.levels[1:]), self.start.gammas))
        top_gamma = self.start.gammas[-1] if self.start.gammas else 1
        return Route(family, tuple(given.get(b, top_gamma) for b in zip(family, family[1:])))

    def _refresh(self, route: Route, priced: dict, cls: int | None) -> Route | None:
        """One round of another route whose top forward's cost is stale, where that cost could change the choice
        (its price within PLAIN_REFRESH of the other's), when the round would run `route`:
        - plain decoding, when `route` is not plain and the top's 1-token cost is stale: plain decoding is what
          every route must beat, its cost is only measured by running it, and LevelCosts keeps it however old;
        - while decoding plainly, n-gram lookup verified directly (its priced gammas), for a round whose lookup
          found a proposal (`cls`), when the forward that takes has a stale cost: the route is priced from the
          window without running it, so its verification's cost would otherwise be the one measured in the first
          rounds for the rest of the run."""
        costs, plain = self.costs[self.top], (self.top,)
        ours, theirs = priced.get(route.levels), priced.get(plain)
        if route.levels != plain:
            if costs.fresh(1):
                return None
            if costs.settled(1) and ours is not None and theirs is not None and ours[0] < PLAIN_REFRESH * theirs[0]:
                return None
            return Route(plain, ())
        lookup = priced.get((0, self.top)) if self.ngram and cls else None
        if lookup is None or ours is None or PLAIN_REFRESH * lookup[0] > ours[0]:
            return None
        return None if costs.fresh(1 + lookup[1].gammas[0]) else lookup[1]

    def _explore(self, route: Route) -> Route:
        """`route`, or once with one more draft at the top when the forward that would take has no fresh cost:
        a cost measured once too high would otherwise keep every longer gamma out for the rest of the run."""
        if not route.gammas:
            return route
        g = route.gammas[-1]
        if g >= self._max_gamma(route.levels[-2], self.top) or self.costs[self.top].fresh(g + 2):
            return route
        return Route(route.levels, route.gammas[:-1] + (g + 1,))

    def next_route(self, tokens: int, cls: int | None = None, remaining: int | None = None,
                   setup_ms: Callable[[tuple[int, ...]], float] | None = None) -> Route:
        """The route of the round about to run, `tokens` having been generated, `cls` the match class of the
        round's n-gram lookup (NGramWindow.propose), chosen from the committed text and earlier rounds only.
        `remaining`: the tokens the run may still generate (None: no limit); `setup_ms(family)`: what starting a
        family now would cost before its first round (for _probe and _choose)."""
        r = self.round
        route = self.by_class.get(cls, self.route)
        if self.force is not None and (forced := self.force(r)) is not None:
            route = forced
        elif 1 <= r <= MIN_ROUNDS and len(self.start.levels) > 1:
            # the stack as given, with short drafts, until its boundaries can be priced: a round of poor drafts
            # costs little, and acceptance is measured per token whatever the gamma
            route = self.route = Route(self.start.levels, tuple(min(g, START_GAMMA) for g in self.start.gammas))
        elif r > MIN_ROUNDS and (tokens - self.planned_at >= PLAN_EVERY or self.probing is not None
                         or self.plans < EARLY_PLANS):
            curves, priced = self.plan(remaining, setup_ms)
            self.planned_at = tokens
            route = self.by_class.get(cls, self.route)
            route = (self._settle_probe(priced) or self._probe(curves, priced, remaining, setup_ms)
                     or self._refresh(route, priced, cls) or self._explore(route))
        self.round += 1
        return route


class AdaptiveTop:
    """The top of an adaptive stack: runs each round through the route its planner chooses, over the decoder's
    level states (shared by every route: a state rolls itself back to each round's context). `catch_up(i, ctx,
    committed)` rebuilds a retrieval or H2O level that sat out too long (rebuild.RebuildPolicy.catch_up), and
    `catch_up_ms(i, committed)` is what that would cost now (0: no rebuild needed)."""

    SWITCH_LOG = 64  # route changes kept in the stats

    def __init__(self, kinds: list[str], names: list[str], states: list[ModelState | None], ngram: NGramDrafter | None,
                 start: Route, generator: torch.Generator, catch_up, catch_up_ms=None, force=None,
                 sampled: bool = False, log=None):
        self.log = log  # provenance.RoundLog shared by the routes' levels
        # provenance of the last round (provenance.py): its tokens' levels, the draft tail cut at the top, its route
        self.origins: list[str] = []
        self.rejected: list[int] = []
        self.route_text: str | None = None
        # a model-less bottom drafter: n-gram lookup, or a draft head (timed per drafted token as a level's forward)
        self.ngram = ngram if kinds[0] == "ngram" else None
        self.head = ngram if kinds[0] == "head" else None
        self.kinds, self.names, self.states = kinds, names, states
        self.generator, self.catch_up, self.catch_up_ms = generator, catch_up, catch_up_ms
        self.clock = states[-1].runner.own_clock  # a round's own time (execution/runner.py)
        self.planner = Planner(kinds, start, force, sampled)
        for i, state in enumerate(states):
            if state is not None:
                state.on_forward = self.planner.costs[i].add
        if self.head is not None:
            self.head.on_forward = self.planner.costs[0].add
        self._chains: dict[tuple[int, ...], object] = {}
        self._drafters: dict[int, ModelDrafter] = {}
        self.rounds_by_route: dict[str, int] = {}
        self.switches: list[dict] = []
        self.n_switches = 0
        self.planner_seconds = 0.0
        self.tokens = 0
        self._route: Route | None = None  # the last round's
        self._texts: dict[Route, str] = {}

    def _chain(self, route: Route):
        chain = self._chains.get(route.levels)
        if chain is None:
            fam = route.levels
            b = fam[0]
            if self.kinds[b] in DRAFT_ONLY:
                chain = self.ngram or self.head
            else:
                chain = self._drafters.setdefault(b, ModelDrafter(self.states[b], self.generator))
            for below, above in zip(fam, fam[1:]):
                chain = Level(self.names[above], chain, self.states[above], 1, self.generator,
                              on_round=lambda asked, drafted, accepted, b=below, a=above:
                              self.planner.observe(b, a, asked, drafted, accepted), log=self.log)
            self._chains[fam] = chain
        node = chain
        for g in reversed(route.gammas):  # top boundary first
            node.gamma = g
            node = node.drafter
        return chain

    def _start_ms(self, i: int, committed: int) -> float:
        """What level i, sitting out, costs to run again now: its rebuild (catch_up_ms), else a forward of the tokens
        it missed beyond its usual 1-token feed (its measured cost curve; 0 while unmeasured)."""
        rebuild = self.catch_up_ms(i, committed) if self.catch_up_ms is not None else 0.0
        if rebuild > 0.0 or self.states[i] is None:
            return rebuild
        curve = self.planner.costs[i].curve()
        behind = committed - self.states[i].stable
        return max(curve(behind + 1) - curve(1), 0.0) if curve is not None and behind > 0 else 0.0

    @property
    def levels_in_use(self) -> tuple[int, ...]:
        return self.planner.route.levels

    def step(self, ctx: list[int], committed: int, limit: int) -> list[int]:
        cls = None
        if self.ngram is not None:  # the n-gram drafter's own work (its first lookup indexes the prompt), not planning
            proposal, n = self.ngram.lookup(ctx, committed, MAX_GAMMA_NGRAM)
            cls = n if proposal else 0
        t = time.perf_counter()
        if self.ngram is not None:
            self.planner.ngram_top.judge(ctx)
        last = self._route
        running = last.levels if last is not None else ()

        def setup(family: tuple[int, ...]) -> float:
            return sum(self._start_ms(i, committed) for i in family[:-1] if i not in running)
        route = self._route = self.planner.next_route(self.tokens, cls, limit, setup)
        text = self._texts.get(route)
        if text is None:
            text = self._texts[route] = route.text(self.names)
        if route != last:
            self.n_switches += last is not None
            if len(self.switches) < self.SWITCH_LOG:
                self.switches.append({"round": self.planner.round - 1, "token": self.tokens, "route": text})
        self.rounds_by_route[text] = self.rounds_by_route.get(text, 0) + 1
        chain = self._chain(route)
        self.planner_seconds += time.perf_counter() - t
        if self.ngram is not None:
            self.planner.ngram_top.propose(len(ctx), proposal, cls)
        for i in route.levels[:-1]:
            self.catch_up(i, ctx, committed)
        started = self.clock()
        tokens = chain.step(ctx, committed, limit)
        t = time.perf_counter()
        self.planner.record_round(route, cls, 1e3 * (self.clock() - started), len(tokens))
        self.planner_seconds += time.perf_counter() - t
        self.tokens += len(tokens)
        self.origins, self.rejected = drafted_by(chain, len(tokens)), getattr(chain, "rejected", [])
        self.route_text = text
        return tokens

    def level_stats(self) -> list[dict]:
        """Per verifying level, its rounds over every route summed (top first); then the drafters."""
        verify: dict[str, dict] = {}
        drafters: dict[str, dict] = {}
        for chain in self._chains.values():
            node = chain
            while node is not None:
                s = node.stats()
                if s["role"] == "verify":
                    v = verify.setdefault(s["level"], {"level": s["level"], "role": "verify", "rounds": 0,
                                                       "proposed": 0, "accepted": 0, "seconds": 0.0,
                                                       "host_syncs": 0})
                    for k in ("rounds", "proposed", "accepted", "seconds", "host_syncs"):
                        v[k] += s[k]
                    v["forwards"] = s["forwards"]  # the state's, shared by every route
                else:
                    drafters.setdefault(s["level"], s)
                node = getattr(node, "drafter", None)
        out = []
        for i in reversed(range(len(self.names))):
            v = verify.get(self.names[i])
            if v is None:
                continue
            v.update(verify_rates(v["rounds"], v["proposed"], v["accepted"]), seconds=round(v["seconds"], 4))
            out.append(v)
        return out + list(drafters.values())

    def stats(self) -> dict:
        p = self.planner
        return {"routes": dict(self.rounds_by_route), "route_changes": self.n_switches, "switches": self.switches,
                "final_route": p.route.text(self.names), "plans": p.plans,
                "planner_seconds": round(self.planner_seconds, 6),
                "acceptance": {f"{self.names[b]}->{self.names[a]}": round(x.alpha, 4)
                               for (b, a), x in p.acceptance.items()},
                "predicted_ms_per_token": p.predicted,
                "lookup_calibration": (round(p.lookup_calibration.factor, 3) if p.lookup_calibration is not None
                                       else None),
                "round_extra_ms": {Route(f, ()).text(self.names): round(x, 2) for f, c in p.round_costs.items()
                                   if (x := c.extra_ms()) is not None}}
