"""Batched serving: several requests' forwards in one (execution/batching.py, execution/runner.py's forward_batch,
kernels/decode_layer.cpp's decode_layers_batch) give each request exactly what it gets alone.

- A batched forward's logits are bit for bit each request's forward alone, for decode steps and verifications
  (and the caches it writes, and the queries it records for retrieval builds).
- Greedy generations of several requests run together through one gate are token-identical to each alone, with
  their forwards really batched.
- Sampled generations through the gate follow the target's distribution (chi-square against the exact marginals,
  tests/test_speculation_distribution.py's check), and a wrong acceptance rule is caught by the same check.

The models have head_dim 64, so that their forwards take the compiled one-call path that batching runs on.
"""
from __future__ import annotations

import collections
import functools
import threading
import time

import pytest
import torch

import triforce.speculation.level as level_mod
from conftest import hf_tiny, ours_from_hf
from test_speculation_distribution import CFG, POSITIONS, exact_marginals, p_values, wrong_verify
from triforce.caches import new_cache
from triforce.execution import batching
from triforce.execution.batching import ForwardGate, GatedRunner
from triforce.execution.runner import DIRECT, batch_tokens, forward_batch
from triforce.generate import generate
from triforce.sampling import SamplingParams
from triforce.speculation.settings import SpecConfig
from triforce.speculation.stack import StackSpec

KERNEL_SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)


@pytest.fixture(scope="module")
def model():
    m = ours_from_hf(hf_tiny("llama", seed=3, vocab_size=300, max_position_embeddings=2048, **KERNEL_SHAPE))
    if m.backend.ops is None:
        pytest.skip("the CPU kernels are not built here: batched forwards run on them")
    return m


def _prefilled(model, n: int, seed: int, dtype=None):
    cache = new_cache(model, 512, record_queries=True, dtype=dtype)
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    model(ids, cache)
    return cache


@torch.inference_mode()
def test_batched_forward_logits_equal_each_requests_forward_alone(model):
    """Decode steps and verifications of several requests, over caches of several K/V dtypes (a drafting level's
    fp16 cache batches with another request's full bf16 one: the same model's weights)."""
    lengths = [5, 40, 100, 17, 63, 30]
    rows = [1, 5, 3, 9, 1, 2]  # decode steps and verifications of several drafts
    dtypes = [None, "fp16", "bf16", "fp16", "fp32", "bf16"]
    g = torch.Generator().manual_seed(1)
    calls = [torch.randint(0, 300, (1, t), generator=g) for t in rows]
    alone_caches = [_prefilled(model, n, i, d) for i, (n, d) in enumerate(zip(lengths, dtypes))]
    batch_caches = [_prefilled(model, n, i, d) for i, (n, d) in enumerate(zip(lengths, dtypes))]
    lasts = [1, 5, 1, 9, 1, 2]  # (the kept rows: a forward's last ones)
    alone = [model(tokens, cache, last=t) for tokens, cache, t in zip(calls, alone_caches, lasts)]
    batched = forward_batch(model, [(tokens, cache, t) for tokens, cache, t in zip(calls, batch_caches, lasts)])
    for a, b in zip(alone, batched):
        assert a.shape == b.shape and torch.equal(a, b)
    for a, b in zip(alone_caches, batch_caches):
        assert a.length == b.length
        assert torch.equal(a.k[..., :a.length, :], b.k[..., :b.length, :])
        assert torch.equal(a.v[..., :a.length, :], b.v[..., :b.length, :])
        assert all(torch.equal(x, y) for x, y in zip(a.recorder.layers, b.recorder.layers))
    # and a batch of one is the plain forward's own path (decode_layers is decode_layers_batch with one segment)
    one = _prefilled(model, 30, 9)
    again = _prefilled(model, 30, 9)
    assert torch.equal(model(calls[1], one, last=2), forward_batch(model, [(calls[1], again, 2)])[0])


def _solo_order(prompts: list[tuple[str, int]]) -> list[str]:
    """Each (name, chunks) a member that prefills `chunks` 100-token chunks through one gate, the members' first
    chunks arriving in list order; -> the names in the order the gate ran their chunks."""
    gate, order = ForwardGate(), []

    def prompt(name, chunks):
        for i in range(chunks):
            with batching.prefilling((chunks - i) * 100):
                gate.solo(lambda: order.append(name), 100)

    _run_together(gate, *(functools.partial(prompt, *p) for p in prompts))
    return order


def test_gate_runs_the_shortest_remaining_prefill_first_without_starving_a_long_one(monkeypatch):
    # a one-chunk prompt that arrives behind a three-chunk one is prefilled first
    assert _solo_order([("long", 3), ("short", 1)]) == ["short", "long", "long", "long"]
    # two shorter prompts may pass a waiting chunk, the third may not
    monkeypatch.setattr(batching, "STARVATION", 2)
    assert _solo_order([("long", 2), ("a", 1), ("b", 1), ("c", 1)]) == ["a", "b", "long", "c", "long"]


def test_gate_runs_a_request_s_forwards_before_its_first_token_ahead_of_prefill_chunks():
    """A request past its prefill, before its first token, does not wait a prefill chunk per forward."""
    gate, order = ForwardGate(prefill_budget=100), []

    def prefill():  # arrives first
        for i in range(3):
            with batching.prefilling((3 - i) * 100):
                gate.solo(lambda: order.append("chunk"), 100)

    def first_round(due: bool):
        batching.first_token_due(due)
        try:
            for _ in range(3):
                gate.batched("model", None, 1, lambda runs: [order.append("round")] * len(runs))
        finally:
            batching.first_token_due(False)

    for due, expected in ((True, ["round"] * 3 + ["chunk"] * 3), (False, ["round", "chunk"] * 3)):
        order.clear()
        _run_together(gate, prefill, lambda: first_round(due))
        assert order == expected, due
    # but a prompt with at most SHORT_PREFILL tokens left (a question after a cached document) goes first: its own
    # first round then batches with the due one's
    tokens_left = batching.SHORT_PREFILL

    def short_prefill():
        with batching.prefilling(tokens_left):
            gate.solo(lambda: order.append("short"), tokens_left)

    for tokens_left, expected in ((batching.SHORT_PREFILL, ["short"] + ["round"] * 3),
                                  (batching.SHORT_PREFILL + 1, ["round"] * 3 + ["short"])):
        order.clear()
        _run_together(gate, short_prefill, lambda: first_round(True))
        assert order == expected, tokens_left


def _run_together(gate: ForwardGate, *members) -> list:
    """Each member() started on `gate` together, in order -> their results."""
    return [f.result(60) for f in gate.submit(*members)]


def test_each_batched_forward_is_timed_as_its_share_of_the_batch():
    """forward_seconds after a batched forward: the batch's time split by ForwardGate.batched's costs (the shared
    part evenly, the own parts in proportion), so a 1-token step beside longer verifications is not charged the whole
    batch; forwards without a cost are charged the whole batch, as one alone is."""

    def batch_of(costs: list) -> list[float]:
        gate = ForwardGate()

        def one(cost):
            gate.batched("model", None, 1, lambda runs: (time.sleep(0.2), [None] * len(runs))[1], cost=cost)
            return batching.forward_seconds(time.perf_counter())

        seconds = _run_together(gate, *(functools.partial(one, c) for c in costs))
        assert gate.stats.sizes == {len(costs): 1}
        return seconds

    costs = [(100.0, 100.0), (100.0, 300.0), (100.0, 500.0)]  # shares (100 / 3 + own) / 1000
    seconds = batch_of(costs)
    batch = sum(seconds)
    assert batch >= 0.2
    for s, (shared, own) in zip(seconds, costs):
        assert s == pytest.approx(batch * (shared / 3 + own) / 1000, rel=1e-9)
    seconds = batch_of([(100.0, 100.0), None])
    assert seconds[0] == seconds[1] >= 0.2


def test_members_and_every_forward_run_on_the_gate_s_one_thread():
    """Members (greenlets) and their solo and batched forwards all run on one thread of the gate's, whichever thread
    started them: OpenMP gives each thread that opens a parallel region a team, and with more teams than cores every
    region waits for sleeping workers (execution/omp_threads.py)."""
    gate, ran = ForwardGate(), collections.defaultdict(set)

    def record(kind):
        ran[kind].add(threading.get_ident())
        return kind

    def member():
        record("member")
        return [x for _ in range(4) for x in (gate.batched("model", None, 1, lambda runs: [record("batched")
                                                                                         for _ in runs]),
                                              gate.solo(lambda: record("solo"), 1))]

    starters, results = set(), []

    def start():
        starters.add(threading.get_ident())
        results.extend(gate.run(member))

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == ["batched"] * 12 + ["solo"] * 12
    assert set(ran) == {"member", "batched", "solo"}
    assert len(set().union(*ran.values())) == 1
    assert not set().union(*ran.values()) & starters


def test_a_member_s_error_reaches_its_caller_and_the_gate_goes_on():
    """A member's exception (its own, or its forward's) is raised to the caller of ForwardGate.run; the other
    members' forwards still run; a gate with no member lets its thread go after IDLE_SECONDS and starts another."""
    gate = ForwardGate()

    def failing_forward():
        gate.batched("model", None, 1, lambda runs: 1 / 0)

    def good():
        return gate.solo(lambda: "ran", 1)

    with pytest.raises(ZeroDivisionError):
        gate.run(failing_forward)
    with pytest.raises(KeyError):
        gate.run(lambda: {}["missing"])
    assert gate.run(good) == "ran"
    with pytest.raises(RuntimeError, match="members only"):
        gate.solo(lambda: None, 1)  # (not a member)
    first = gate._thread
    first.join(batching.IDLE_SECONDS + 5)
    assert not first.is_alive() and gate._thread is None
    assert gate.run(good) == "ran" and gate.members == 0


def test_a_members_own_clock_counts_its_forwards_shares_and_its_cpu_not_its_waits():
    """batching.own_clock (the adaptive planner's round costs): on a gate, a member's forwards' shares plus its
    own CPU time; a wait (here a sleep, as for the other members' turns) adds nothing. Off a gate, the wall clock."""
    gate, grew = ForwardGate(), {}

    def member():
        t0 = batching.own_clock()
        time.sleep(0.3)
        grew["sleep"] = batching.own_clock() - t0
        t0 = batching.own_clock()
        gate.solo(lambda: time.sleep(0.2), 1)
        grew["forward"] = batching.own_clock() - t0

    gate.run(member)
    assert grew["sleep"] < 0.05
    assert grew["forward"] >= 0.2
    t0 = batching.own_clock()
    time.sleep(0.1)
    assert batching.own_clock() - t0 >= 0.1


def test_exclusive_work_of_a_member_runs_between_batches_and_counts_in_its_own_clock():
    """batching.exclusive (a retrieval level's build): on a gate, fn runs in the gate's turn, like a solo forward
    of no tokens, and its time is the member's own (own_clock); it is no forward, so the next forward_seconds is
    not given its time. Off a gate, fn runs at once."""
    gate, seen = ForwardGate(), {}

    def work():
        seen.setdefault("ran on", set()).add(threading.get_ident())
        time.sleep(0.2)
        return "built"

    def member():
        t0 = batching.own_clock()
        seen["result"] = batching.exclusive(work)
        seen["own"] = batching.own_clock() - t0
        started = time.perf_counter()
        seen["after"] = batching.forward_seconds(started)

    gate.run(member)
    assert seen["result"] == "built"
    assert seen["own"] >= 0.2
    assert seen["after"] < 0.1
    assert gate.stats.solo == 1 and gate.stats.batches == 0
    assert batching.exclusive(work) == "built" and threading.get_ident() in seen["ran on"]


def test_a_retrieval_build_on_a_gate_runs_there(model):
    """A retrieval level's build in a serving batch goes through the gate (batching.exclusive), not beside its
    forwards on the request's thread."""
    config = SpecConfig(chunk_size=8, recent=8, prefill_chunk=32)
    prompt = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    stack = StackSpec.parse("retrieval:48,full", "3")
    gate = ForwardGate(prefill_budget=32)
    alone = generate(model, prompt, 20, stack=stack, config=config)
    together = _together(lambda _, runner: generate(model, prompt, 20, stack=stack, config=config, runner=runner),
                         [0], gate)[0]
    assert together.tokens == alone.tokens
    builds = together.stats["retrieval_rebuilds"]
    prefill_chunks = -(-(len(prompt) - 1) // config.prefill_chunk)
    assert builds >= 1 and gate.stats.solo == prefill_chunks + builds, (gate.stats, builds)


def test_a_level_that_sat_out_catches_up_in_forwards_that_batch(model):
    """A retrieval level that sat out some tokens (fewer than a rebuild takes) is fed them before its next draft;
    on a gate with other requests it feeds them in forwards a batch takes (runner.batch_tokens), not in one
    longer forward that would run alone with every other request waiting. The tokens stay generate()'s alone."""
    from dataclasses import replace

    from triforce.speculation.routes import Route

    config = SpecConfig(chunk_size=8, recent=8, prefill_chunk=32)
    prompt = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    stack = replace(StackSpec.parse("ngram,retrieval:48,full", "3,4"), adaptive=True)  # (force_route: adaptive)
    behind = batch_tokens(model, new_cache(model, 64)) + 6  # plain rounds: tokens the retrieval level misses
    assert behind < 32  # (rebuild.CATCH_UP: more would rebuild it instead)

    def route(r):  # retrieval drafting first (built), then plain decoding, then retrieval drafting again
        return Route((1, 2), (2,)) if r == 0 or r > behind else Route((2,), ())

    def run(_, runner=DIRECT):
        return generate(model, prompt, behind + 12, stack=stack, config=config, force_route=route,
                        runner=runner)

    alone = run(0)
    gate = ForwardGate(prefill_budget=32)
    together = _together(run, [0, 1], gate)  # (two requests: one alone would wait for nobody, and feeds at once)
    assert [r.tokens for r in together] == [alone.tokens] * 2
    assert [r.stats["retrieval_rebuilds"] for r in together] == [1, 1]  # caught up by feeding, not rebuilt
    assert gate.stats.solo_rows == 2 * (len(prompt) - 1), gate.stats  # only the prefills ran alone (builds: 0 rows)


def _together(run, jobs: list, gate: ForwardGate) -> list:
    """run(job, runner) for every job at once, each a member of `gate`, its forwards run by the gate's runner (as the
    server's engine runs them) -> their results in order."""
    runner = GatedRunner(gate)
    return [f.result(300) for f in gate.submit(*(functools.partial(run, j, runner) for j in jobs))]


def test_greedy_generations_batched_together_equal_each_alone(model):
    config = SpecConfig(chunk_size=8, recent=8, prefill_chunk=32)
    stacks = ["ngram,retrieval:48,full", "full", "ngram,full", "retrieval:48,full", "ngram,streaming:64,full"]
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 300, (40,), generator=g).tolist()
    prompts = [(base * 5)[:150 + 13 * i] if i % 2 else torch.randint(0, 300, (120 + 7 * i,), generator=g).tolist()
               for i in range(8)]
    jobs = [(p, stacks[i % len(stacks)]) for i, p in enumerate(prompts)]  # (a streaming window runs alone)

    def run(job, runner=DIRECT):
        prompt, stack = job
        return generate(model, prompt, 40, stack=StackSpec.parse(stack, "3,4" if stack.count(",") == 2 else "4"),
                        config=config, runner=runner).tokens

    alone = [run(j) for j in jobs]
    gate = ForwardGate(prefill_budget=32)
    together = _together(run, jobs, gate)
    assert together == alone
    assert gate.stats.batches > 0 and max(gate.stats.sizes) > 1, gate.stats  # they did share forwards
    assert gate.stats.solo > 0  # the prefill chunks ran alone, in turn


V = 8
N_SAMPLES = 600


@pytest.fixture(scope="module")
def small_vocab():
    target = ours_from_hf(hf_tiny("llama", seed=21, vocab_size=V, initializer_range=0.5, max_position_embeddings=256,
                                  **KERNEL_SHAPE))
    if target.backend.ops is None:
        pytest.skip("the CPU kernels are not built here")
    draft = ours_from_hf(hf_tiny("llama", seed=22, vocab_size=V, initializer_range=0.5, max_position_embeddings=256,
                                 **KERNEL_SHAPE))
    prompt = (torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist() * 4)[:48]
    return (target, draft), prompt, exact_marginals(target, prompt, SamplingParams(temperature=1.0))


def _batched_counts(models, prompt, gate: ForwardGate) -> torch.Tensor:
    """Counts [POSITIONS, V] of the first generated tokens over N_SAMPLES seeds, 8 generations at a time through
    the gate (n-gram lookup, a draft model and the target: every forward but the prefill batched)."""
    target, draft = models
    stack = StackSpec.parse("ngram,draft,full", "2,3")
    counts = torch.zeros(POSITIONS, V)

    def run(seed, runner):
        return generate(target, prompt, POSITIONS, SamplingParams(temperature=1.0), stack=stack, config=CFG,
                        draft_model=draft, seed=seed, runner=runner).tokens

    for start in range(0, N_SAMPLES, 8):
        for tokens in _together(run, list(range(start, start + 8)), gate):
            for i, t in enumerate(tokens):
                counts[i, t] += 1
    return counts


def test_batched_sampling_follows_target_distribution(small_vocab):
    target, prompt, exact = small_vocab
    gate = ForwardGate()
    pv = p_values(_batched_counts(target, prompt, gate), exact)
    assert min(pv) > 1e-3, f"chi-square p-values {pv}"
    assert max(gate.stats.sizes) > 1


@pytest.mark.slow  # the check's power in the fast tier: test_speculation_distribution's test_check_detects_a_wrong_sampler
def test_batched_check_detects_a_wrong_sampler(small_vocab, monkeypatch):
    """The research code's bug (a rejection resampled from p, not the residual) at the boundary that has draft
    distributions (draft -> full; the n-gram level's drafts are one-hot and keep the real rule)."""
    target, prompt, exact = small_vocab
    right = level_mod.verify_tree
    monkeypatch.setattr(level_mod, "verify_tree", lambda tree, q, p, generator: (
        right if q is None else wrong_verify)(tree, q, p, generator))
    pv = p_values(_batched_counts(target, prompt, ForwardGate()), exact)
    assert min(pv) < 1e-6, f"the wrong sampler went undetected: p-values {pv}"


# ---- the server: continuous batching, cancellation, admission, memory ---------------------------------------------

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_serving import CONFIG, DOC, char_tokenizer, serving, wait_for  # noqa: E402
from triforce.loading import LoadedModel  # noqa: E402

SERVE_STACK = StackSpec.parse("ngram,retrieval:48,full", "3,4")


@pytest.fixture(scope="module")
def loaded():
    from pathlib import Path

    tok = char_tokenizer()
    m = ours_from_hf(hf_tiny("llama", seed=1, vocab_size=len(tok), max_position_embeddings=12000, **KERNEL_SHAPE))
    if m.backend.ops is None:
        pytest.skip("the CPU kernels are not built here")
    return LoadedModel(m, tok, m.cfg, "tiny", Path("."))


def _reference(loaded, prompt: str, max_tokens: int) -> str:
    ids = loaded.tokenizer(prompt)["input_ids"]
    return generate(loaded.model, ids, max_tokens, SamplingParams(temperature=0), stack=SERVE_STACK, config=CONFIG,
                    eos_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer).text


async def _stream(client, url: str, prompt: str, max_tokens: int, cancel_after: int | None) -> dict:
    import json

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out = {"text": "", "finished": None, "cancelled": False, "status": None}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            choice = obj["choices"][0]
            out["text"] += choice["text"]
            out["finished"] = choice["finish_reason"] or out["finished"]
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                out["cancelled"] = True
                break
    return out


def test_forty_concurrent_streams_with_cancellations_lose_nothing(loaded):
    import asyncio
    import random

    rng = random.Random(45)
    prompts = [DOC[:60 + 7 * i] + f" Q{i}:" for i in range(40)]
    cancel = {i: rng.randint(1, 4) for i in rng.sample(range(40), 10)}
    with serving(loaded, SERVE_STACK, max_batch=8, max_queue=40) as (url, server):
        async def main():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*(_stream(client, url, p, 24, cancel.get(i)) for i, p in enumerate(prompts)))

        results = asyncio.run(main())
        wait_for(lambda: server.engine.depth() == (0, 0), 60)
        gate = server.engine.gate.stats
        cancelled = server.metrics.finished.labels("cancelled")._value.get()
        usage = server.engine.kv_usage()
    for i, r in enumerate(results):
        assert r["status"] == 200
        if not r["cancelled"]:
            assert r["finished"] in ("stop", "length") and r["text"] == _reference(loaded, prompts[i], 24), i
    assert sum(r["cancelled"] for r in results) >= 1 and cancelled >= sum(r["cancelled"] for r in results) - 2
    assert max(gate.sizes) > 1  # requests shared forwards
    assert usage == 0.0  # every request gave its memory back


def test_a_request_is_admitted_by_the_bytes_its_caches_really_take(model):
    """request_bytes, what admission counts, is the bytes of the caches a generation of that request makes: the full
    cache and each drafting level's own (a retrieval level's budget and appended tokens, a streaming window and its
    slack, in the drafting KV dtype), for stacks of each kind that has one."""
    from triforce.memory import kv_bytes, kv_value_bytes
    from triforce.serving.engine import EngineSettings, full_cache_tokens, request_bytes
    from triforce.speculation.builder import BuiltStack

    config = SpecConfig(chunk_size=8, recent=8, prefill_chunk=32, draft_kv_dtype="bf16")
    for text, gammas in [("ngram,retrieval:48,full", "3,4"), ("streaming:64,full", "4"),
                         ("ngram,h2o:48,full", "3,4"), ("full", None)]:
        stack = StackSpec.parse(text, gammas)
        s = EngineSettings(model, None, stack, text, config, ())
        built = BuiltStack(stack, model, SamplingParams(), config, torch.Generator(), 150, 20)
        drafting = sum(t.numel() * t.element_size() for st in built.states[:-1] if st is not None
                       for t in (st.cache.k, st.cache.v))  # (a retrieval cache's are allocated here, at first use)
        full = kv_bytes(model.cfg, full_cache_tokens(150, 20, stack), kv_value_bytes(model.kv_dtype))
        assert request_bytes(s, 150, 20) - full == drafting, text


def test_admission_by_memory_400_and_429(loaded):
    from triforce.serving.engine import request_bytes

    with serving(loaded, SERVE_STACK, max_batch=1, max_queue=1) as (url, server):
        s = server.engine.s
        s.kv_budget = request_bytes(s, 80, 16)  # room for one short request at a time
        r = httpx.post(url + "/v1/completions", json={"prompt": DOC * 3, "max_tokens": 200})
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_budget_exceeded"
        assert "--kv-memory" in r.json()["error"]["message"]
        hold = threading.Event()
        real_run = server.engine._run
        server.engine._run = lambda job: (hold.wait(30), real_run(job))
        replies = []
        threads = [threading.Thread(target=lambda: replies.append(httpx.post(
            url + "/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0}, timeout=60)))
            for _ in range(2)]
        threads[0].start()
        wait_for(lambda: server.engine.depth() == (0, 1))
        threads[1].start()
        wait_for(lambda: server.engine.depth() == (1, 1))
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        hold.set()
        for t in threads:
            t.join(60)
        assert [x.status_code for x in replies] == [200, 200]
        metrics = httpx.get(url + "/metrics").text
    for name in ("triforce:num_requests_running", "triforce:num_requests_waiting", "triforce:kv_cache_usage_perc",
                 "triforce:batch_size_bucket", "triforce:iteration_tokens_total_bucket",
                 "triforce:spec_decode_num_accepted_tokens_total"):
        assert name in metrics, name


@pytest.mark.slow  # two 10K-token requests: about 2 minutes
def test_memory_stays_bounded_over_many_generated_tokens(loaded):
    """Two requests of 10K tokens each, batched: the server's resident memory after them is what it was after a
    warm-up of the same shape (every request's caches freed), and the KV budget is all given back."""
    import os

    def rss() -> int:
        with open(f"/proc/{os.getpid()}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    class WithoutEOS(LoadedModel):  # so that every request runs its 10K tokens
        eos_token_ids = ()

    body = {"max_tokens": 10000, "temperature": 0.8, "seed": 3}
    endless = WithoutEOS(loaded.model, loaded.tokenizer, loaded.config, loaded.source, loaded.directory)
    with serving(endless, StackSpec.parse("full"), max_batch=2) as (url, server):
        def run_two():
            replies = []
            threads = [threading.Thread(target=lambda i=i: replies.append(httpx.post(
                url + "/v1/completions", json={**body, "prompt": DOC[:20 + i]}, timeout=600)))
                for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            return replies

        warm = run_two()
        before = rss()
        replies = run_two()
        after = rss()
        # a request's reservation is given back just after its last event is sent, so the client may see the
        # reply first: wait (bounded) for the engine's request threads to finish
        deadline = time.monotonic() + 60
        while (usage := server.engine.kv_usage()) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert all(r.status_code == 200 for r in warm + replies), [r.text[:200] for r in warm + replies]
    assert [r.json()["usage"]["completion_tokens"] for r in replies] == [10000] * 2
    assert after - before < 64 << 20, (before, after)
    assert usage == 0.0


def test_requests_for_one_document_arriving_together_prefill_it_once(loaded):
    """Four requests with one long document and different questions, sent at once to a batching server: one
    prefills the document, the other three wait for its blocks and reuse them (rather than computing the same K/V
    beside it), and every answer equals `triforce generate`'s."""
    doc = DOC * 2  # ~380 tokens: 23 whole 16-token blocks
    prompts = [doc + f" Q{i}:" for i in range(4)]
    with serving(loaded, SERVE_STACK, max_batch=8) as (url, server):
        together = threading.Barrier(4, timeout=60)  # all four admitted before any starts (a tiny model is quick)
        real_serve = server.engine._serve
        server.engine._serve = lambda job: (together.wait(), real_serve(job))
        replies = [None] * 4

        def ask(i):
            replies[i] = httpx.post(url + "/v1/completions", timeout=300,
                                    json={"prompt": prompts[i], "max_tokens": 12, "temperature": 0})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert server.engine._prefilling == {}  # every claim released
        # the document is cached now: two requests that differ only after it claim their own tails, neither waits
        from triforce.serving.engine import Job

        engine = server.engine
        tails = [doc + f" Question {w}, with words enough to fill a block or two:" for w in ("eight", "nine")]
        a, b = (Job(loaded.tokenizer(t)["input_ids"], 4, SamplingParams(temperature=0), 0, (), lambda ev: None)
                for t in tails)
        b.deadline = time.perf_counter() + 5  # (were it to wait for a, it would give up and claim nothing)
        engine._claim_prefill(a)
        engine._claim_prefill(b)
        claimed = collections.Counter(engine._prefilling.values())
        assert claimed[a.claim] >= 2 and claimed[b.claim] == claimed[a.claim]
        engine._release_prefill(a)
        engine._release_prefill(b)
        assert engine._prefilling == {}
    assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies]
    reused = sorted(r.json()["triforce"]["prefix_cache_tokens"] for r in replies)
    whole = (len(loaded.tokenizer(doc)["input_ids"]) // CONFIG.prefill_chunk) * CONFIG.prefill_chunk
    assert reused == [0, whole, whole, whole]
    for i, r in enumerate(replies):
        assert r.json()["choices"][0]["text"] == _reference(loaded, prompts[i], 12), i
