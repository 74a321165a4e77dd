"""The adaptive stack's policy: which route (routes.py) each round runs, chosen before the round from earlier rounds
only, so switching keeps greedy output identical to `ar` and sampled output distributed as the target's.

Each round, Planner.next_route runs one step of this loop:

    start    rounds 1 to MIN_ROUNDS run the stack as given, with short drafts, until its boundaries can be priced
    plan     every PLAN_EVERY generated tokens, price every route family (routes.RoutePricer) and move to the
             cheapest when it beats the current route by SWITCH_GAIN, or, for plain decoding, by any margin; with
             n-gram lookup, once more per match class (the length of the n-gram the round's lookup matched)
    probe    a family that only running measures (a model level below the top), unmeasured for a while and able
             to win: run it for as many rounds as pricing it takes, then back off (PROBE_FIRST, doubling to
             PROBE_MAX) while probes lose
    refresh  a forward cost that only running measures (a plain step's; an n-gram verification's while decoding
             plainly), stale and able to change the choice: one round that measures it again
    explore  one more draft at the top when that forward's cost is not fresh, so that a cost measured once too
             high does not keep every longer gamma out for the rest of the run

The figures behind the constants are in docs/performance.md ("The adaptive planner's measurements").
"""
from __future__ import annotations

from typing import Callable

from .cost_model import Boundary
from .measurements import MIN_ROUNDS, Measurements
from .routes import Curves, Route, RoutePricer, route_families

PLAN_EVERY = 12  # generated tokens between re-plans
EARLY_PLANS = 8  # ... but the first plans come every round: the early measurements change fast
SWITCH_GAIN = 0.05  # a route must be predicted this much cheaper than the current one to replace it (timings are noisy)
PROBE_FIRST, PROBE_MAX = 8, 64  # rounds between probes of an unmeasured or stale route family
START_GAMMA = 2  # the given stack's first rounds, and probes, draft at most this much per boundary
PROBE_HORIZON = 32  # no probe with fewer tokens left to generate: what it finds would pay over too few
PLAIN_REFRESH = 0.75  # a stale plain-step cost is measured again while the route is priced above this share of it

Prices = dict[tuple[int, ...], tuple[float, Route] | None]  # family -> its price and best gammas (RoutePricer.price)
SetupMs = Callable[[tuple[int, ...]], float]  # family -> what starting it now costs (levels that sat out)


def _repays(saving_ms: float, family: tuple[int, ...], remaining: int | None, setup_ms: SetupMs | None) -> bool:
    """Whether saving `saving_ms` per token over the `remaining` tokens repays what starting `family` costs now;
    with no limit or no setup cost given, it does."""
    return remaining is None or setup_ms is None or saving_ms * remaining > setup_ms(family)


class Planner:
    """Chooses each round's route from the run's measurements. `kinds` are the stack's level kinds bottom to top,
    `start` the route of the stack as given (its gammas); `force(round)`, for tests, gives a route to run instead."""

    def __init__(self, kinds: list[str], start: Route, force: Callable[[int], Route | None] | None = None,
                 sampled: bool = False):
        self.kinds, self.start, self.force = kinds, start, force
        self.top = len(kinds) - 1
        self.ngram = kinds[0] == "ngram"
        self.families = route_families(kinds)
        self.measured = Measurements(kinds, self.families, sampled)
        self.pricer = RoutePricer(kinds, self.measured)
        self.route = Route((self.top,), ())  # the first round: a plain step (measures it, risks nothing)
        self.by_class: dict[int, Route] = {}  # n-gram match class -> its route (plan())
        self.round = 0
        self.probe_gap = PROBE_FIRST
        self.probing: tuple[int, ...] | None = None
        self.probe_route: Route | None = None
        self.probe_rounds = 0  # rounds the current probe has run
        self.predicted: dict[str, float] = {}  # route text -> ms/token at the last plan
        self.plans = 0
        self.planned_at = -PLAN_EVERY  # tokens generated at the last plan
        # what the last plan priced from: the cost curves and the n-gram window's boundaries (all rounds', per class)
        self._curves: Curves | None = None
        self._ngram_boundary: Boundary | None = None
        self._class_boundaries: dict[int, Boundary] = {}

    # -- the loop ----------------------------------------------------------------------------------------------
    def next_route(self, tokens: int, cls: int | None = None, remaining: int | None = None,
                   setup_ms: SetupMs | None = None) -> Route:
        """The route of the round about to run, `tokens` having been generated, `cls` the match class of the
        round's n-gram lookup (NGramWindow.propose). `remaining`: the tokens the run may still generate (None: no
        limit); `setup_ms(family)`: what starting a family now would cost before its first round."""
        r = self.round
        route = self.by_class.get(cls, self.route)
        if self.force is not None and (forced := self.force(r)) is not None:
            route = forced
        elif 1 <= r <= MIN_ROUNDS and len(self.start.levels) > 1:
            # a round of poor drafts costs little, and acceptance is measured per token whatever the gamma
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

    # -- measurements that need the round index ----------------------------------------------------------------
    def observe(self, below: int, above: int, asked: int, drafted: int, accepted: int) -> None:
        """A verification at boundary (below, above) of the round in progress (Level.on_round)."""
        self.measured.observe(below, above, asked, accepted, self.round)

    def record_round(self, route: Route, cls: int | None, ms: float, tokens: int | None = None) -> None:
        """A round of `route` (for a round of n-gram match class `cls`) took `ms` of its own time (RoundCosts) and
        made `tokens` (LookupCalibration, for n-gram lookup verified directly), from the first plan on: the first
        round runs code paths for the first time, and the stack's first rounds cannot be priced."""
        if self._curves is None or self.round <= 1:
            return
        ngram = self._class_boundaries.get(cls, self._ngram_boundary)
        calibration = self.measured.lookup_calibration
        if tokens is not None and ngram is not None and calibration is not None and route.levels == (0, self.top):
            calibration.add(ngram.tokens(route.gammas[0]), tokens)
        modelled = self.pricer.modelled(route, self._curves, ngram)
        if modelled is None:
            return
        ms_per_token, per_round = modelled
        self.measured.round_costs[route.levels].add(ms, ms_per_token * per_round)

    # -- plan --------------------------------------------------------------------------------------------------
    def plan(self, remaining: int | None = None, setup_ms: SetupMs | None = None) -> tuple[Curves, Prices]:
        """Re-choose the route -> (the cost curves, every family's price) it was chosen from, for _probe.
        `remaining`, `setup_ms`: as next_route's (a switch must repay what starting its family costs)."""
        self.plans += 1
        self._ngram_boundary = self.measured.ngram_top.boundary() if self.ngram else None
        curves = self._curves = self.measured.curves()
        priced = {f: self.pricer.price(f, curves, self._ngram_boundary) for f in self.families}
        self.predicted = {p[1].text(self.kinds): round(p[0], 3) for p in priced.values() if p is not None}
        if all(p is None for p in priced.values()):
            return curves, priced
        self.route = self._choose(priced, self.route, remaining, setup_ms)
        if self.ngram:
            self._plan_classes(curves, priced, remaining, setup_ms)
        return curves, priced

    def _choose(self, priced: Prices, route: Route, remaining: int | None = None,
                setup_ms: SetupMs | None = None) -> Route:
        """The cheapest priced route, unless it beats `route`'s family by less than SWITCH_GAIN. Plain decoding
        needs no margin: it is the baseline every route must beat, and a route kept for being within the margin of
        it would run behind `ar`. Nor a route whose family costs more to start (`setup_ms(family)`: levels that sat
        out re-fed or rebuilt) than it saves over the `remaining` tokens."""
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

    def _plan_classes(self, curves: Curves, priced: Prices, remaining: int | None = None,
                      setup_ms: SetupMs | None = None) -> None:
        """A route per n-gram match class: a round's lookup is made before its route is chosen, and how often a
        proposal is accepted depends much on the length of the match it came from. The families through n-gram
        lookup are re-priced with that class's rounds only; the others cost what they cost for any class. A class
        with too few judged rounds takes the route planned for all."""
        window = self.measured.ngram_top
        through_ngram = [f for f in self.families if f[0] == 0]
        self._class_boundaries = {}
        for cls in window.classes():
            b = window.boundary(cls)
            if b is None:
                self.by_class.pop(cls, None)
                continue
            self._class_boundaries[cls] = b
            by_cls = dict(priced)
            by_cls.update({f: self.pricer.price(f, curves, b) for f in through_ngram})
            self.by_class[cls] = self._choose(by_cls, self.by_class.get(cls, self.route), remaining, setup_ms)

    # -- probe -------------------------------------------------------------------------------------------------
    def _settle_probe(self, priced: Prices) -> Route | None:
        """After a probe round: its route again while the family cannot be priced yet (else one round would be
        spent for nothing, and counted as a probe that lost); else the probe is over, and one that did not win
        makes the next come later."""
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

    def _stale(self, family: tuple[int, ...]) -> bool:
        """Whether a boundary of the family went unmeasured for probe_gap rounds: only running a route through a
        level measures the acceptance of its drafts (n-gram lookup against the top excepted: NGramWindow)."""
        seen = self.measured.seen
        return any(self.round - seen.get(b, -10 ** 9) > self.probe_gap
                   for b in zip(family, family[1:]) if not (self.ngram and b == (0, self.top)))

    def _probe(self, curves: Curves, priced: Prices, remaining: int | None = None,
               setup_ms: SetupMs | None = None) -> Route | None:
        """A family that only running measures, unmeasured for probe_gap rounds, and that could still win: one round
        of its best-priced route. "Could win": priced at its best case, it beats the current route, by more than
        what starting it costs (`setup_ms(family)`) over the `remaining` tokens; and PROBE_HORIZON tokens are left."""
        if remaining is not None and remaining < PROBE_HORIZON:
            return None
        stale = [f for f in self.families if f != self.route.levels and self._stale(f)]
        if not stale:
            return None
        current = priced[self.route.levels]
        options = []
        for f in stale:
            best_case = self.pricer.price(f, curves, self._ngram_boundary, optimistic=True)
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
        # short drafts: a probe measures acceptance, which is per token whatever the gamma, and a long one costs
        # much when it fails
        _, family, route = options[0]
        self.probe_route = Route(family, tuple(min(g, START_GAMMA) for g in route.gammas))
        self.probing, self.probe_rounds = family, 1
        return self.probe_route

    def _start_of(self, family: tuple[int, ...]) -> Route:
        """An unmeasured family's first gammas: the given stack's at the boundaries they share, else its top gamma."""
        given = dict(zip(zip(self.start.levels, self.start.levels[1:]), self.start.gammas))
        top_gamma = self.start.gammas[-1] if self.start.gammas else 1
        return Route(family, tuple(given.get(b, top_gamma) for b in zip(family, family[1:])))

    # -- refresh and explore -----------------------------------------------------------------------------------
    def _refresh(self, route: Route, priced: Prices, cls: int | None) -> Route | None:
        """One round of another route whose top forward's cost is stale, where that cost could change the choice
        (its price within PLAIN_REFRESH of the other's), when the round would run `route`:
        - plain decoding, when `route` is not plain and the top's 1-token cost is stale: plain decoding is what
          every route must beat, its cost is only measured by running it, and LevelCosts keeps it however old;
        - while decoding plainly, n-gram lookup verified directly (its priced gammas), for a round whose lookup
          found a proposal (`cls`), when the forward that takes has a stale cost: the route is priced from the
          window without running it, so its verification's cost would otherwise be the one measured in the first
          rounds for the rest of the run."""
        costs, plain = self.measured.costs[self.top], (self.top,)
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
        """`route`, or once with one more draft at the top when the forward that would take has no fresh cost."""
        if not route.gammas:
            return route
        g = route.gammas[-1]
        if g >= self.pricer.max_gamma(route.levels[-2], self.top) or self.measured.costs[self.top].fresh(g + 2):
            return route
        return Route(route.levels, route.gammas[:-1] + (g + 1,))
