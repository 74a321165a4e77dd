"""The top of an adaptive stack: each round runs through the route its planner (planner.py) chooses, over level
states that every route shares (a state rolls itself back to each round's context), and feeds the planner's
measurements: forward costs, acceptance per boundary, n-gram lookup judged against the committed text, each
round's own time.
"""
from __future__ import annotations

import time

import torch

from .drafters import Drafter, ModelDrafter, NGramDrafter
from .level import Level, chain_of, verify_rates
from .measurements import MAX_GAMMA_NGRAM
from .planner import Planner
from .provenance import drafted_by
from .routes import Route
from .stack import DRAFT_ONLY
from .state import ModelState


class AdaptiveTop:
    """Runs each round through the route its planner chooses. `states`: the levels' model states (None for a
    model-less bottom level, `bottom_drafter`: n-gram lookup or a draft head); `catch_up(i, ctx, committed)`
    rebuilds a retrieval or H2O level that sat out too long (rebuild.RebuildPolicy.catch_up), and
    `catch_up_ms(i, committed)` is what that would cost now (0: no rebuild needed)."""

    SWITCH_LOG = 64  # route changes kept in the stats

    def __init__(self, kinds: list[str], names: list[str], states: list[ModelState | None],
                 bottom_drafter: Drafter | None, start: Route, generator: torch.Generator, catch_up, catch_up_ms=None,
                 force=None, sampled: bool = False, log=None):
        self.log = log  # provenance.RoundLog shared by the routes' levels
        # provenance of the last round (provenance.py): its tokens' levels, the draft tail cut at the top, its route
        self.origins: list[str] = []
        self.rejected: list[int] = []
        self.route_text: str | None = None
        # n-gram lookup is judged every round whatever the route; a draft head is timed per drafted token, as a
        # level's forward
        self.ngram: NGramDrafter | None = bottom_drafter if kinds[0] == "ngram" else None
        self.head = bottom_drafter if kinds[0] == "head" else None
        self.kinds, self.names, self.states = kinds, names, states
        self.generator, self.catch_up, self.catch_up_ms = generator, catch_up, catch_up_ms
        self.clock = states[-1].runner.own_clock  # a round's own time (execution/runner.py)
        self.planner = Planner(kinds, start, force, sampled)
        costs = self.planner.measured.costs
        for i, state in enumerate(states):
            if state is not None:
                state.on_forward = costs[i].add
        if self.head is not None:
            self.head.on_forward = costs[0].add
        self._chains: dict[tuple[int, ...], Level | Drafter] = {}  # family -> its levels, top first
        self._drafters: dict[int, ModelDrafter] = {}
        self.rounds_by_route: dict[str, int] = {}
        self.switches: list[dict] = []
        self.n_switches = 0
        self.planner_seconds = 0.0
        self.tokens = 0
        self._route: Route | None = None  # the last round's
        self._texts: dict[Route, str] = {}

    def _chain(self, route: Route) -> Level | Drafter:
        """The route's family as levels (made once, shared by its routes), set to the route's gammas."""
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
        curve = self.planner.measured.costs[i].curve()
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
            self.planner.measured.ngram_top.judge(ctx)
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
            self.planner.measured.ngram_top.propose(len(ctx), proposal, cls)
        for i in route.levels[:-1]:
            self.catch_up(i, ctx, committed)
        started = self.clock()
        tokens = chain.step(ctx, committed, limit)
        t = time.perf_counter()
        self.planner.record_round(route, cls, 1e3 * (self.clock() - started), len(tokens))
        self.planner_seconds += time.perf_counter() - t
        self.tokens += len(tokens)
        self.origins, self.rejected = drafted_by(chain, len(tokens)), (chain.rejected if isinstance(chain, Level)
                                                                         else [])
        self.route_text = text
        return tokens

    def level_stats(self) -> list[dict]:
        """Per verifying level, its rounds over every route summed (top first); then the drafters."""
        verify: dict[str, dict] = {}
        drafters: dict[str, dict] = {}
        for chain in self._chains.values():
            for node in chain_of(chain):
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
        out = []
        for i in reversed(range(len(self.names))):
            v = verify.get(self.names[i])
            if v is None:
                continue
            v.update(verify_rates(v["rounds"], v["proposed"], v["accepted"]), seconds=round(v["seconds"], 4))
            out.append(v)
        return out + list(drafters.values())

    def stats(self) -> dict:
        p, measured = self.planner, self.planner.measured
        return {"routes": dict(self.rounds_by_route), "route_changes": self.n_switches, "switches": self.switches,
                "final_route": p.route.text(self.names), "plans": p.plans,
                "planner_seconds": round(self.planner_seconds, 6),
                "acceptance": {f"{self.names[b]}->{self.names[a]}": round(x.alpha, 4)
                               for (b, a), x in measured.acceptance.items()},
                "predicted_ms_per_token": p.predicted,
                "lookup_calibration": (round(measured.lookup_calibration.factor, 3)
                                       if measured.lookup_calibration is not None else None),
                "round_extra_ms": {Route(f, ()).text(self.names): round(x, 2) for f, c in measured.round_costs.items()
                                   if (x := c.extra_ms()) is not None}}
