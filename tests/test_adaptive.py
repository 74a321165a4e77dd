"""The adaptive stack: the planner picks each round's route from what it measured, and switching keeps the output
exact (greedy: ar's tokens; sampled: the target's distribution, with a wrong switching rule caught)."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_tiny, ours_from_hf
from test_speculation_distribution import ALPHA, POSITIONS, V, exact_marginals, p_values

import triforce.speculation.builder as builder_mod
from triforce.generate import generate
from triforce.sampling import SamplingParams
from triforce.speculation.cost_model import expected_tokens
from triforce.speculation.adaptive import AdaptiveTop
from triforce.speculation.measurements import MIN_ROUNDS
from triforce.speculation.planner import PROBE_HORIZON, PROBE_MAX, Planner
from triforce.speculation.routes import Route
from triforce.speculation.settings import SpecConfig
from triforce.speculation.stack import StackSpec, method_stack

CFG = SpecConfig(gamma=3, gamma_draft=2, budget=20, chunk_size=4, recent=4, rebuild_every=8, sink=2, window=6,
                 ngram=2, prefill_chunk=64)
# the default stack's routes (levels: 0 ngram, 1 retrieval, 2 full)
AR, NGRAM, RETRIEVAL, STACK = (2,), (0, 2), (1, 2), (0, 1, 2)


def cycling(round_index: int) -> Route:
    """A forced schedule through every route and several gammas, independent of what the rounds give."""
    routes = [Route(AR, ()), Route(NGRAM, (2,)), Route(RETRIEVAL, (1,)), Route(STACK, (1, 2)), Route(STACK, (2, 3)),
              Route(NGRAM, (4,)), Route(RETRIEVAL, (3,))]
    return routes[round_index % len(routes)]


def seeded(round_index: int) -> Route:
    """Routes and gammas drawn per round from the round index alone."""
    rng = random.Random(round_index * 7919)
    fam = rng.choice([AR, NGRAM, RETRIEVAL, STACK])
    return Route(fam, tuple(rng.randint(1, 4) for _ in fam[1:]))


@pytest.fixture(scope="module")
def models():
    target = ours_from_hf(hf_tiny("llama", seed=21, vocab_size=V, initializer_range=0.5, max_position_embeddings=256))
    return target


@pytest.fixture(scope="module")
def prompt():
    base = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    return (base * 4)[:48]


def test_the_named_triforce_stack_is_adaptive_and_fixed_flags_fix_it():
    assert method_stack("triforce", adaptive=True).adaptive
    assert not method_stack("triforce").adaptive
    assert not method_stack("ngram", adaptive=True).adaptive  # only triforce re-plans
    assert not StackSpec.parse("ngram,retrieval,full", "3,4").adaptive
    assert "adaptive" in str(method_stack("triforce", adaptive=True))


@pytest.mark.parametrize("force", [None, cycling, seeded], ids=["planner", "cycling", "seeded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_switching_routes_keeps_greedy_output_identical_to_ar(force, arch):
    model = ours_from_hf(hf_tiny(arch, seed=3, vocab_size=48, max_position_embeddings=512))
    base = torch.randint(0, 48, (25,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt = (base * 6)[:140] + torch.randint(0, 48, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    ar = generate(model, prompt, 70, method="ar", config=CFG)
    res = generate(model, prompt, 70, method="triforce", config=CFG, force_route=force)
    assert res.tokens == ar.tokens
    stats = res.stats["adaptive"]
    levels = res.stats["levels"]
    full_rounds = sum(x["rounds"] for x in levels if x["level"] == "full" and x["role"] == "verify")
    ar_steps = sum(x["tokens"] for x in levels if x["level"] == "full" and x["role"] == "draft")
    assert sum(stats["routes"].values()) == full_rounds + ar_steps  # every round ran one of the routes
    if force is not None:
        assert len(stats["routes"]) >= 4  # the schedule ran every family
        assert stats["route_changes"] > 10


def test_streaming_bottom_and_a_prompt_within_the_budget_adapt_too():
    model = ours_from_hf(hf_tiny("llama", seed=5, vocab_size=40, max_position_embeddings=512))
    prompt = torch.randint(0, 40, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = generate(model, prompt, 40, method="ar", config=CFG)
    cfg = SpecConfig(**{**CFG.__dict__, "draft": "streaming"})
    res = generate(model, prompt, 40, method="triforce", config=cfg, force_route=cycling)
    assert res.tokens == ar.tokens and "adaptive" in res.stats
    small = generate(model, prompt[:16], 40, method="triforce", config=CFG)  # retrieval skipped: ngram,full
    assert small.tokens == generate(model, prompt[:16], 40, method="ar", config=CFG).tokens
    assert set(small.stats["adaptive"]["routes"]) <= {"full"} | {f"ngram,full@{g}" for g in range(1, 9)}


def test_no_adapt_runs_the_stack_as_given(models, prompt):
    res = generate(models, prompt, 20, method="triforce", config=SpecConfig(**{**CFG.__dict__, "adapt": False}))
    assert "adaptive" not in res.stats
    assert [lvl["level"] for lvl in res.stats["levels"]][:2] == ["full", "retrieval"]


@pytest.mark.parametrize("force", [cycling, seeded], ids=["cycling", "seeded"])
def test_sampled_tokens_follow_the_target_distribution_while_routes_switch(models, prompt, force):
    params = SamplingParams(temperature=1.0)
    exact = exact_marginals(models, prompt, params)
    counts = torch.zeros(POSITIONS, V)
    for seed in range(1000):
        res = generate(models, prompt, POSITIONS, params, method="triforce", config=CFG, seed=seed, force_route=force)
        for i, t in enumerate(res.tokens):
            counts[i, t] += 1
    pv = p_values(counts, exact)
    assert min(pv) > ALPHA, f"chi-square p-values {pv}"


class OutcomeSwitchingTop(AdaptiveTop):
    """A wrong planner: it looks at a round's outcome before keeping it, and when the full level rejected the n-gram
    proposal's first token it throws the round away and runs plain decoding instead. The route then depends on the
    round's own draws: the output leans towards the proposal."""

    def step(self, ctx, committed, limit):
        proposal = self.ngram.lookup(ctx, committed, 1)[0]
        tokens = super().step(ctx, committed, limit)
        if proposal and tokens[0] != proposal[0]:
            self.planner.force = lambda r: Route(AR, ())
            tokens = super().step(ctx, committed, limit)
            self.planner.force = lambda r: Route(NGRAM, (2,))
        return tokens


def test_the_distribution_check_catches_a_switch_that_depends_on_the_round(models, prompt, monkeypatch):
    monkeypatch.setattr(builder_mod, "AdaptiveTop", OutcomeSwitchingTop)
    params = SamplingParams(temperature=1.0)
    exact = exact_marginals(models, prompt, params)
    counts = torch.zeros(POSITIONS, V)
    for seed in range(1000):
        res = generate(models, prompt, POSITIONS, params, method="triforce", config=CFG, seed=seed,
                       force_route=lambda r: Route(NGRAM, (2,)))
        for i, t in enumerate(res.tokens):
            counts[i, t] += 1
    assert min(p_values(counts, exact)) < ALPHA


# -- the planner alone, against a simulated machine and text ------------------------------------------------------

class Machine:
    """Forward costs (ms) by level and tokens, and per-token acceptances by boundary that change with the round.
    `round_extra(route)`: ms each round of the route costs beyond its forwards, told to the planner as the
    round's time (AdaptiveTop.step) when `report_rounds`."""

    def __init__(self, full=(20.0, 2.0), retrieval=(5.0, 0.5), accept=None, ngram_match=None, seed=0,
                 round_extra=None, report_rounds=True, cls=None):
        self.full, self.retrieval = full, retrieval
        self.accept = accept or (lambda r, boundary: 0.0)
        self.ngram_match = ngram_match or (lambda r: 0)
        self.rng = random.Random(seed)
        self.round_extra = round_extra or (lambda route: 0.0)
        self.report_rounds = report_rounds
        self.cls = cls  # the n-gram match class each round's lookup reports (None: not told)

    def cost(self, level: int, k: float) -> float:
        base, per = self.full if level == 2 else self.retrieval
        return base + per * (k - 1)

    def run(self, planner: Planner, rounds: int, start_round: int = 0, tokens: int = 0, total: int | None = None,
            setup_ms=None) -> tuple[list[Route], float, int]:
        """`total`: the run's max new tokens (None: no limit); `setup_ms`: Planner.next_route's."""
        routes, ms = [], 0.0
        for r in range(start_round, start_round + rounds):
            route = planner.next_route(tokens, self.cls, None if total is None else total - tokens, setup_ms)
            routes.append(route)
            emitted = self._round(planner, route, r)
            self._ms += self.round_extra(route)
            if self.report_rounds:
                planner.record_round(route, None, self._ms)
            ms += self._ms
            match = self.ngram_match(r)
            planner.measured.ngram_top.rounds.append((3, 8, match))  # the text repeats for `match` tokens
            tokens += emitted
        return routes, ms, tokens

    def _draft(self, planner, route, pos, k, r) -> int:
        """Level route.levels[pos] makes k tokens for the level above (drafted by the levels below it)."""
        level = route.levels[pos]
        if pos == 0:
            if level != 0:  # a model drafting one forward per token
                for _ in range(k):
                    planner.measured.costs[level].add(1, self.cost(level, 1) / 1e3)
                    self._ms += self.cost(level, 1)
            return k
        made = 0
        while made < k:
            made += self._verify(planner, route, pos, min(route.gammas[pos - 1], k - made), r)
        return k

    def _verify(self, planner, route, pos, g, r) -> int:
        below, level = route.levels[pos - 1], route.levels[pos]
        self._draft(planner, route, pos - 1, g, r)
        if (below, level) == (0, 2):  # n-gram lookup verified directly: the text repeats for ngram_match tokens
            j = min(g, self.ngram_match(r))
        else:
            j = 0
            while j < g and self.rng.random() < self.accept(r, (below, level)):
                j += 1
        planner.measured.costs[level].add(g + 1, self.cost(level, g + 1) / 1e3)
        self._ms += self.cost(level, g + 1)
        planner.observe(below, level, g, g, j)
        return j + 1

    def _round(self, planner, route, r) -> int:
        self._ms = 0.0
        if len(route.levels) == 1:
            planner.measured.costs[2].add(1, self.cost(2, 1) / 1e3)
            self._ms = self.cost(2, 1)
            return 1
        return self._verify(planner, route, len(route.levels) - 1, route.gammas[-1], r)


def new_planner() -> Planner:
    return Planner(["ngram", "retrieval", "full"], Route(STACK, (3, 4)))


def test_planner_falls_back_to_plain_decoding_when_nothing_is_accepted():
    p = new_planner()
    routes, ms, tokens = Machine().run(p, 200)
    assert p.route.levels == AR
    assert ms / tokens < 1.05 * 20.0  # within 5% of ar's 20 ms/token, probes included
    assert sum(r.levels != AR for r in routes[50:]) <= 5  # probes back off


def test_planner_keeps_the_whole_stack_when_it_pays():
    machine = Machine(accept=lambda r, b: {(0, 1): 0.7, (1, 2): 0.9}[b])
    p = new_planner()
    routes, ms, tokens = machine.run(p, 150)
    assert p.route.levels in (STACK, RETRIEVAL)
    assert ms / tokens < 0.6 * 20.0


def test_planner_comes_back_when_the_text_becomes_predictable_again():
    hard = lambda r, b: 0.0  # noqa: E731
    easy = lambda r, b: {(0, 1): 0.8, (1, 2): 0.95}[b]  # noqa: E731
    p = new_planner()
    Machine(accept=lambda r, b: hard(r, b) if r < 150 else easy(r, b)).run(p, 150)
    assert p.route.levels == AR
    routes, ms, _ = Machine(accept=lambda r, b: easy(r, b)).run(p, 2 * PROBE_MAX + 20, start_round=150, tokens=150)
    assert p.route.levels in (STACK, RETRIEVAL)


def test_planner_takes_ngram_lookup_without_probing_when_the_text_repeats():
    p = new_planner()
    Machine(ngram_match=lambda r: 0).run(p, 60)
    assert p.route.levels == AR
    routes, _, _ = Machine(ngram_match=lambda r: 8).run(p, 20, start_round=60, tokens=60)
    assert p.route.levels == NGRAM and p.route.gammas[0] >= 4
    assert sum(r.levels == NGRAM for r in routes) >= 6  # learnt from the plain steps' own tokens, at the next plan


def test_a_probe_runs_until_its_route_can_be_priced():
    # a planner that starts on plain decoding learns the retrieval level's worth only by probing it: one round
    # cannot price a boundary, so the probe goes on for MIN_ROUNDS rounds (not counted as lost after one)
    machine = Machine(accept=lambda r, b: {(0, 1): 0.0, (1, 2): 0.9}[b])
    p = Planner(["ngram", "retrieval", "full"], Route(AR, ()))
    routes, ms, tokens = machine.run(p, 120)
    first = next(i for i, r in enumerate(routes) if r.levels != AR)
    assert all(r.levels == routes[first].levels for r in routes[first:first + MIN_ROUNDS])
    assert p.route.levels in (RETRIEVAL, STACK)
    assert ms / tokens < 0.7 * 20.0


def test_no_probe_when_too_few_tokens_are_left_or_a_rebuild_would_cost_more_than_it_could_win():
    # n-gram proposals are accepted one token a round; the retrieval level's drafts never (but could be: probed)
    machine = Machine(accept=lambda r, b: 0.0, ngram_match=lambda r: 1)
    probes = lambda routes: sum(1 in r.levels for r in routes[1 + MIN_ROUNDS:])  # noqa: E731
    routes, _, _ = machine.run(new_planner(), 150)
    assert probes(routes) > 0  # the control: without a limit, the retrieval routes are probed now and then
    routes, _, _ = machine.run(new_planner(), 150, total=PROBE_HORIZON + 1 + MIN_ROUNDS)
    assert probes(routes) == 0  # past the start, fewer than PROBE_HORIZON tokens are ever left
    routes, _, _ = machine.run(new_planner(), 150, total=10 ** 6, setup_ms=lambda family: 0.0)
    assert probes(routes) > 0
    routes, _, _ = machine.run(new_planner(), 150, total=10 ** 6,
                               setup_ms=lambda family: 1e12 if 1 in family else 0.0)
    assert probes(routes) == 0


def test_the_first_rounds_measure_the_stack_as_given():
    p = new_planner()
    routes, _, _ = Machine().run(p, 10)
    assert routes[0].levels == AR and all(r == Route(STACK, (2, 2)) for r in routes[1:1 + MIN_ROUNDS])
    assert all(p.measured.boundary(*b, p._ngram_boundary) is not None for b in ((0, 1), (1, 2)))  # priced from here on


def test_forward_costs_never_fall_with_more_tokens_and_forget_stale_counts():
    from triforce.speculation.measurements import LevelCosts
    c = LevelCosts()
    for _ in range(3):
        for k, ms in ((1, 20.0), (3, 30.0), (4, 60.0), (5, 34.0)):  # 4 tokens timed in a noisy minute
            c.add(k, ms / 1e3)
    cost = c.curve()
    assert cost(1) == 20.0 and cost(3) == 30.0
    assert cost(4) == cost(5) == pytest.approx(47.0)  # pooled: never above a longer forward's cost
    assert cost(7) > cost(5)  # beyond the counts, still growing
    for _ in range(LevelCosts.STALE + 1):  # only 1- and 3-token forwards from here on
        c.add(1, 0.020)
        c.add(3, 0.030)
    assert not c.fresh(4) and c.fresh(3)
    assert c.curve()(4) == pytest.approx(35.0)  # the old 4- and 5-token costs are gone: the 1-3 slope goes on
    cascade = LevelCosts()  # 5 pools with 4, and that block with 3: every count keeps the pooled level
    for _ in range(2):
        for k, ms in ((1, 20.0), (3, 50.0), (4, 60.0), (5, 10.0)):
            cascade.add(k, ms / 1e3)
    assert [cascade.curve()(k) for k in (3, 4, 5)] == pytest.approx([40.0, 40.0, 40.0])


def test_a_noisy_first_measurement_does_not_keep_long_gammas_out():
    class NoisyStart(Machine):
        def cost(self, level, k):  # forwards of 4 or more tokens cost 3x in the first 15 rounds
            return super().cost(level, k) * (3.0 if k >= 4 and self.r < 15 else 1.0)

        def _round(self, planner, route, r):
            self.r = r
            return super()._round(planner, route, r)

    p = new_planner()
    routes, _, _ = NoisyStart(ngram_match=lambda r: 8).run(p, 120)
    assert p.route.levels == NGRAM and p.route.gammas[0] >= 5
    assert sum(r.levels == NGRAM and r.gammas[0] >= 5 for r in routes[60:]) >= 40


def test_planner_does_not_flip_on_near_ties():
    machine = Machine(full=(20.0, 0.0), accept=lambda r, b: 0.0, ngram_match=lambda r: 0)
    p = new_planner()
    routes, _, _ = machine.run(p, 100)
    changes = sum(a != b for a, b in zip(routes[30:], routes[31:]))
    assert changes <= 8  # probes and plain-step refreshes (out and back) only
    held = max(sum(r.levels == f for r in routes[30:]) for f in (AR, NGRAM))
    assert held >= 0.85 * len(routes[30:])


def test_the_ngram_window_judges_each_proposal_against_the_text_that_followed():
    p = new_planner()
    w = p.measured.ngram_top
    seq = [5, 6, 7]
    w.propose(3, [1, 2, 3, 4], 1)  # made before a round at position 3, from a 1-token match
    w.judge(seq + [1, 2])  # still matching where the text ends: undecided
    assert not w.rounds
    w.judge(seq + [1, 2, 9])
    assert list(w.rounds) == [(1, 4, 2)]
    w.propose(6, [1, 2], 2)
    w.judge(seq + [1, 2, 9, 1, 2])  # all of it matched: decided
    w.propose(8, [])  # no match to propose from
    assert list(w.rounds) == [(1, 4, 2), (2, 2, 2), (0, 0, 0)]
    b = w.boundary()  # three judged rounds and the prior's PRIOR_MISSES (2) drafting gamma, none accepted
    assert b.tokens(1) == pytest.approx(1 + 2 / 5) and b.tokens(4) == pytest.approx(1 + 4 / 5)
    assert b.drafted(4) == pytest.approx((6 + 2 * 4) / 5) and b.drafted(1) == pytest.approx((2 + 2 * 1) / 5)
    assert w.boundary(2) is None  # one round of the class: too few to price it apart
    assert expected_tokens(0.0, 3) == 1.0


def test_each_ngram_match_class_gets_its_own_route():
    # long matches (class 3) repeat the text, short ones (class 1) never do: lookup verified directly pays for
    # the first, plain decoding for the second; the rounds of each class take their own route
    p = new_planner()
    w = p.measured.ngram_top
    for i in range(12):
        w.rounds.append((3, 8, 8))
        w.rounds.append((1, 8, 0))
    for k in (1, 2, 9):
        for _ in range(3):
            p.measured.costs[2].add(k, (20.0 + 2.0 * (k - 1)) / 1e3)
    p.round = 10
    p.plan()
    assert p.by_class[3].levels == NGRAM and p.by_class[3].gammas[0] >= 6
    assert p.by_class[1].levels == AR
    p.plans, p.planned_at = 100, 40  # between plans: each round takes its class's route
    assert p.next_route(41, 3) == p.by_class[3] and p.next_route(42, 1).levels == AR


def test_the_server_metrics_count_the_adaptive_routes(models, prompt):
    pytest.importorskip("prometheus_client")
    from triforce.serving.metrics import ServerMetrics

    res = generate(models, prompt, 30, method="triforce", config=CFG, force_route=cycling)
    m = ServerMetrics()
    m.speculation(res.stats)
    text = m.render()[0].decode()
    for route, rounds in res.stats["adaptive"]["routes"].items():
        assert f'triforce:spec_decode_route_rounds_total{{route="{route}"}} {float(rounds)}' in text
    assert f"triforce:spec_decode_route_changes_total {float(res.stats['adaptive']['route_changes'])}" in text


def test_an_undecided_proposal_counts_with_what_it_matched_so_far():
    w = new_planner().measured.ngram_top
    for pos in (0, 1, 2):
        w.propose(pos, [7] * 8)
    w.judge([7, 7, 7, 7])  # every proposal still matches where the text ends: none decided
    assert not w.rounds and [m for _, _, m in w.open] == [4, 3, 2]
    b = w.boundary()
    # long matches so far: long gammas pay (three rounds, each with a first token matched, and the prior's two
    # misses: 1 + 3 / 5 tokens at gamma 1)
    assert b is not None and b.tokens(8) > b.tokens(4) > b.tokens(1) == pytest.approx(1.6)


class SteepVerification(Machine):
    """The AVX2 build at 32K: a decode step 40 ms, and each token more in a forward about 20 ms more (2 tokens 53,
    3 tokens 74: from 2 and 3 down to 1 the line gives 32). `plain_first`: a 1-token forward's cost while the
    round is below 10 (a noisy start)."""

    def __init__(self, plain_first=40.0, **kwargs):
        kwargs.setdefault("retrieval", (12.0, 3.5))
        super().__init__(**kwargs)
        self.plain_first, self.r = plain_first, 0

    def cost(self, level, k):
        if level != 2:
            return super().cost(level, k)
        if k <= 1:
            return self.plain_first if self.r < 10 else 40.0
        return 53.0 + 21.0 * (k - 2)

    def _round(self, planner, route, r):
        self.r = r
        return super()._round(planner, route, r)


def test_a_plain_step_is_priced_from_its_own_cost_never_from_longer_forwards():
    from triforce.speculation.measurements import LevelCosts
    c = LevelCosts()
    for _ in range(2):
        c.add(1, 0.040)
    for _ in range(LevelCosts.STALE + 1):  # only verifications from here on
        c.add(2, 0.053)
        c.add(3, 0.074)
    assert not c.fresh(1) and c.curve()(1) == pytest.approx(40.0)  # not 2 * 53 - 74 = 32
    noisy = LevelCosts()  # a count measured high once, long ago, then again: the old cost ages out of its median
    for _ in range(3):
        noisy.add(4, 0.078)
    for _ in range(LevelCosts.STALE + 1):
        noisy.add(3, 0.024)
    noisy.add(4, 0.026)
    assert noisy.curve()(4) == pytest.approx(26.0)


def test_what_a_round_costs_beyond_its_forwards_is_measured_and_priced():
    # retrieval,full@1 accepted 90% of the time: its forwards price it at (53 + 6) / 1.9 = 31 ms/token, well below
    # plain decoding's 40; but each of its rounds costs 25 ms more than its forwards (say, the drafter's 2-token
    # feeds and sampling both rows), so it runs at 44: slower than `ar`, as routes near its price did on the AVX2
    # build
    def run(report):
        machine = SteepVerification(retrieval=(6.0, 2.0), accept=lambda r, b: {(0, 1): 0.0, (1, 2): 0.9}[b],
                                    round_extra=lambda route: 1.0 if route.levels == AR else 25.0,
                                    report_rounds=report)
        p = new_planner()
        routes, ms, tokens = machine.run(p, 300)
        return p, routes, ms / tokens
    p, routes, ms_per_token = run(report=True)
    assert p.route.levels == AR and sum(r.levels != AR for r in routes[50:]) <= 25  # probes only
    assert p.measured.round_costs[AR].extra_ms() == pytest.approx(1.0)
    _, blind_routes, blind = run(report=False)  # the control: priced by forwards alone, it runs retrieval
    assert sum(r.levels == AR for r in blind_routes[50:]) <= 25 and blind > 1.06 * 41.0
    assert ms_per_token < 1.04 * 41.0  # probes (a few rounds of retrieval now and then) included


def test_a_stale_plain_step_cost_is_measured_again():
    # the first plain steps ran in a noisy minute (50 ms): retrieval,full@1 at (53 + 12) / 1.6 = 40.6 ms/token
    # beat them, but plain decoding at 40 is cheaper; measuring it again brings the run back to it
    machine = SteepVerification(plain_first=50.0, accept=lambda r, b: {(0, 1): 0.0, (1, 2): 0.6}[b])
    p = new_planner()
    routes, ms, tokens = machine.run(p, 300)
    assert any(r.levels != AR for r in routes[5:20])  # the stale price sent it away from plain decoding
    assert p.route.levels == AR and sum(r.levels == AR for r in routes[100:]) >= 100  # without: only refreshes
    assert ms / tokens < 1.08 * 40.0  # the noisy start and the probes of a near tie (40.6 against 40) included


def test_a_route_within_the_switching_margin_gives_way_to_plain_decoding_but_not_the_reverse():
    p = new_planner()
    plain, retrieval = Route(AR, ()), Route(RETRIEVAL, (1,))
    assert p._choose({AR: (40.0, plain), RETRIEVAL: (41.0, retrieval)}, retrieval) == plain  # 2.5% cheaper: back
    assert p._choose({AR: (40.0, plain), RETRIEVAL: (39.0, retrieval)}, plain) == plain  # 2.5%: not worth leaving
    assert p._choose({AR: (40.0, plain), RETRIEVAL: (37.0, retrieval)}, plain) == retrieval
    ngram = Route(NGRAM, (2,))
    assert p._choose({NGRAM: (40.0, ngram), RETRIEVAL: (41.0, retrieval)}, retrieval) == retrieval  # hysteresis


def test_a_switch_must_repay_what_starting_its_family_costs_over_the_tokens_left():
    # retrieval,full@1 at 36 ms per token against plain decoding's 40, but its level sat out and costs 300 ms to
    # start (a re-feed or a rebuild): worth it over 100 tokens (400 ms saved), not over 50 (200 ms)
    p = new_planner()
    plain, retrieval = Route(AR, ()), Route(RETRIEVAL, (1,))
    priced = {AR: (40.0, plain), RETRIEVAL: (36.0, retrieval)}

    def setup(family):
        return 300.0 if 1 in family else 0.0
    assert p._choose(priced, plain, 50, setup) == plain
    assert p._choose(priced, plain, 100, setup) == retrieval
    assert p._choose(priced, plain) == retrieval  # no limit: nothing to repay it over
    assert p._choose(priced, Route(RETRIEVAL, (2,)), 10, setup) == retrieval  # already running: only re-tuned


def test_a_sampled_planner_scales_the_window_by_what_its_lookup_rounds_got():
    # the window promised 2 tokens per ngram,full@2 round; the rounds made 1 (each draft rejected): the drafts it
    # promises count (0 + PRIOR) / (16 + PRIOR) as much, and plain decoding wins again
    sampled = Planner(["ngram", "retrieval", "full"], Route(STACK, (3, 4)), sampled=True)
    greedy = new_planner()
    for p in (sampled, greedy):
        for _ in range(12):
            p.measured.ngram_top.rounds.append((1, 2, 1))  # half the proposals' tokens matched
        for k in (1, 2, 3):
            for _ in range(3):
                p.measured.costs[2].add(k, (20.0 + 4.0 * (k - 1)) / 1e3)
        p.round = 10
        p.plan()
    assert greedy.measured.lookup_calibration is None and greedy.route.levels == NGRAM
    window = sampled._ngram_boundary
    for _ in range(16):
        sampled.record_round(Route(NGRAM, (2,)), 1, 28.0, tokens=1)  # a 3-token forward's cost, nothing more
    f = sampled.measured.lookup_calibration.factor
    assert f == pytest.approx(2.0 / (16 * (window.tokens(2) - 1.0) + 2.0))
    assert sampled.measured.boundary(0, 2, window).tokens(2) == pytest.approx(1.0 + f * (window.tokens(2) - 1.0))
    sampled.plan()
    assert sampled.route.levels == AR
