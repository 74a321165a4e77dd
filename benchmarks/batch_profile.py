"""Where the time of a serving batch goes: N concurrent requests through the engine (serving/engine.py, no HTTP), a
shared document cached by a warm-up request, against the same N requests' batched forwards run back to back and
the bytes-over-bandwidth bound.

    python benchmarks/batch_profile.py --context 2048 --requests 8 --max-tokens 128 --method ar
    python benchmarks/batch_profile.py --context 8192 --requests 8 --max-tokens 128 --method triforce

It prints, over the decode phase (the first request's first token to the last request's end):
- the aggregate tokens/s and the bound: (weight bytes + N x KV bytes) / measured read bandwidth per batched step;
- the gate's time: batched forwards (their count, mean size, ms each) and solo forwards, and the gate's idle time
  (every forward done, the request threads' host work: sampling, acceptance, the planner, Python and the GIL);
- the same batched forward run back to back (runner.forward_batch over N caches of that length): the kernels' floor.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time

import torch

from decode_step import random_cache, time_ours
from triforce.bench.hardware import measure_bandwidth
from triforce.corpus import demo_text
from triforce.execution.linear import Linear, QuantLinear
from triforce.execution.runner import forward_batch, weight_bytes
from triforce.loading import load_model
from triforce.memory import kv_bytes, kv_value_bytes
from triforce.sampling import SamplingParams
from triforce.serving.assembly import build
from triforce.serving.engine import Job
from triforce.speculation.settings import SpecConfig
from triforce.speculation.stack import METHODS, method_stack


class GateClock:
    """Wraps a gate's _execute to record each run: (start, seconds, batched?, forwards)."""

    def __init__(self, gate):
        self.runs: list[tuple[float, float, bool, int]] = []
        real = gate._execute

        def timed(chosen):
            t = time.perf_counter()
            real(chosen)
            self.runs.append((t, time.perf_counter() - t, chosen[0].key is not None, len(chosen)))

        gate._execute = timed


def run_load(server, prompts, max_tokens: int) -> tuple[float, float, list[int]]:
    """Submit every prompt at once -> (first token time, last end time, tokens per request)."""
    done = threading.Event()
    state = {"left": len(prompts), "first": None}
    routes = collections.Counter()  # the adaptive default's rounds by route, over every request
    counts = [0] * len(prompts)
    lock = threading.Lock()

    def deliver_for(i):
        def deliver(ev):
            with lock:
                if ev["type"] == "delta" and ev["tokens"]:
                    counts[i] += len(ev["tokens"])
                    state["first"] = state["first"] or time.perf_counter()
                elif ev["type"] in ("done", "error"):
                    if ev["type"] == "done" and (ad := ev["triforce"]["stats"].get("adaptive")):
                        routes.update(ad["routes"])
                    if ev["type"] == "error":
                        print("error:", ev)
                    state["left"] -= 1
                    if state["left"] == 0:
                        state["end"] = time.perf_counter()
                        done.set()
        return deliver

    for i, p in enumerate(prompts):
        server.engine.submit(Job(p, max_tokens, SamplingParams(temperature=0.0), 0, (), deliver_for(i)))
    done.wait(3600)
    if routes:
        print("adaptive rounds by route:", dict(routes))
    return state["first"], state["end"], counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--method", default="ar", choices=list(METHODS))
    p.add_argument("--reps", type=int, default=10, help="back-to-back batched forwards timed")
    a = p.parse_args()
    loaded = load_model(progress=False)
    model, tok = loaded.model, loaded.tokenizer
    config = SpecConfig()
    stack = method_stack(a.method, adaptive=a.method == "triforce")
    bw = measure_bandwidth()
    kv = kv_bytes(model.cfg, a.context + a.max_tokens // 2, kv_value_bytes(model.kv_dtype))
    step_bound = (weight_bytes(model) + a.requests * kv) / bw
    floors = kernel_floor(model, a, step_bound)
    server = build(loaded, stack, a.method, config, max_batch=a.requests)
    server.engine.start()
    ids = tok.encode(demo_text())
    doc = ids[:a.context]
    questions = [tok.encode(f"\nQuestion {i}: what happens in part {i} of this text?\nAnswer:") for i in
                 range(a.requests)]
    prompts = [doc + q for q in questions]
    run_load(server, [doc + tok.encode("\nSummary:")], 4)  # warm-up: caches the document's blocks
    clock = GateClock(server.engine.gate)
    first, end, counts = run_load(server, prompts, a.max_tokens)
    server.engine.stop()
    span = end - first
    runs = [r for r in clock.runs if first <= r[0] <= end]
    batched = [r for r in runs if r[2]]
    solo = [r for r in runs if not r[2]]
    busy_b = sum(r[1] for r in batched)
    busy_s = sum(r[1] for r in solo)
    tokens = sum(counts)

    print(f"{loaded.source}: {a.method}, {a.requests} requests at {a.context} + {len(questions[0])} tokens, "
          f"{a.max_tokens} new each, {torch.get_num_threads()} threads, KV {model.kv_dtype}")
    print(f"bandwidth {bw / 1e9:.1f} GB/s; a batched step of {a.requests} reads {weight_bytes(model) / 2**20:.0f} MiB "
          f"of weights + {a.requests} x {kv / 2**20:.1f} MiB of K/V: {step_bound * 1e3:.1f} ms, bound "
          f"{a.requests / step_bound:.0f} tokens/s")
    print(f"decode phase {span:.2f} s, {tokens} tokens: {tokens / span:.1f} tokens/s aggregate "
          f"({tokens / span * step_bound / a.requests:.0%} of the bound)")
    sizes = statistics.mean(r[3] for r in batched) if batched else 0
    print(f"gate: batched forwards {len(batched)} (mean size {sizes:.2f}), {busy_b:.2f} s "
          f"({busy_b / span:.0%}), {busy_b / max(1, len(batched)) * 1e3:.1f} ms each; solo {len(solo)}, "
          f"{busy_s:.2f} s ({busy_s / span:.0%}); idle {span - busy_b - busy_s:.2f} s "
          f"({(span - busy_b - busy_s) / span:.0%}): host work between forwards")
    by_size = dict(sorted(collections.Counter(r[3] for r in batched).items()))
    print(f"tokens per request {counts}; batched forwards by size {by_size}")
    full = [r[1] for r in batched if r[3] == a.requests]
    if full:
        print(f"batched forwards of all {a.requests}: {len(full)}, median {statistics.median(full) * 1e3:.1f} ms")

    print(floors)


def kernel_floor(model, a, step_bound: float) -> str:
    """The same batched forward back to back (runner.forward_batch over N caches of that length) and the costs per
    row (row_costs), measured before the engine starts: the engine's start releases this thread's OpenMP team
    (execution/omp_threads.py), after which a forward from here runs on another team than the gate's."""
    filled = a.context + a.max_tokens // 2  # the mean context of the decode phase
    caches = [random_cache(model, filled, 1) for _ in range(a.requests)]
    calls = [(torch.randint(0, model.cfg.vocab_size, (1, 1)), c, 1) for c in caches]

    def batched():
        forward_batch(model, calls)
        for c in caches:
            c.rollback(filled)

    with torch.inference_mode():
        ms = _median_ms(batched, a.reps)
    line = (f"forward_batch of {a.requests} x 1 row back to back: {ms:.1f} ms ({step_bound * 1e3 / ms:.0%} of the "
            f"bound's speed): {a.requests / ms * 1e3:.0f} tokens/s if nothing else ran")
    return line + "\n" + row_costs(model, a.context, a.requests, a.reps)


def _median_ms(fn, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls after 2 untimed ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def row_costs(model, context: int, rows: int, reps: int) -> str:
    """What each row of a batched forward costs: the linear layers over 1 and `rows` rows (every layer once,
    as a forward runs them), and a decode step over 16 and `context` cached tokens (the difference: one row's
    attention over `context` tokens and its K/V reads)."""
    layers = [m for m in model.modules() if isinstance(m, (Linear, QuantLinear))]
    with torch.inference_mode():
        xs = {r: [torch.randn(1, r, m.in_features) for m in layers] for r in (1, rows)}
        lin = {r: _median_ms(lambda: [m(x) for m, x in zip(layers, xs[r])], reps) for r in (1, rows)}
    step = {n: time_ours(model, n, reps) * 1e3 for n in (16, context)}  # (decode_step.py's decode step)
    extra = (lin[rows] - lin[1]) / (rows - 1)
    return (f"linear layers: 1 row {lin[1]:.1f} ms, {rows} rows {lin[rows]:.1f} ms ({extra:.2f} ms per row after the "
          f"first); decode step at 16 tokens {step[16]:.1f} ms, at {context} {step[context]:.1f} ms (one row's "
          f"attention and K/V over {context} tokens: {step[context] - step[16]:.1f} ms)")


if __name__ == "__main__":
    main()
