"""What a second OpenMP team costs a decode forward: eight batched decode steps over synthetic caches
(execution/runner.forward_batch), timed from the main thread, then from another thread, then from that thread again once
the main thread has given up its team (execution/omp_threads.release_this_thread), then from the main thread again.
GNU OpenMP gives each thread that opens a parallel region a team of its own; while the process holds more OpenMP
threads than cores, idle workers sleep between regions instead of spinning, and each of a forward's few hundred
regions waits for them to wake. This is why the serving gate runs every forward on one thread of its own.

    python benchmarks/omp_teams.py --context 8192 --requests 8
"""
from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

import torch

from triforce.caches import new_cache
from triforce.caches.synthetic import fill_random
from triforce.execution import omp_threads
from triforce.execution.runner import forward_batch
from triforce.loading import load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--reps", type=int, default=8)
    a = p.parse_args()
    model = load_model(progress=False).model
    caches = []
    for _ in range(a.requests):
        c = new_cache(model, a.context + 8)
        fill_random(c, a.context)
        caches.append(c)
    tokens = [torch.tensor([[100 + i]]) for i in range(a.requests)]

    def step_ms() -> float:
        times = []
        with torch.inference_mode():
            for _ in range(a.reps + 1):
                t0 = time.perf_counter()
                forward_batch(model, [(t, c, 1) for t, c in zip(tokens, caches)])
                times.append(1e3 * (time.perf_counter() - t0))
                for c in caches:
                    c.rollback(a.context)
        return statistics.median(times[1:])  # (the first runs code paths for the first time)

    other = concurrent.futures.ThreadPoolExecutor(1)
    print(f"{a.requests} batched decode steps at {a.context}, {torch.get_num_threads()} threads, median of "
          f"{a.reps} (ms):")
    print(f"  main thread, one team:                        {step_ms():.1f}")
    print(f"  another thread (two teams):                   {other.submit(step_ms).result():.1f}")
    print(f"  main thread again (two teams):                {step_ms():.1f}")
    released = omp_threads.release_this_thread()
    print(f"  the other thread, main's team given up ({released}): {other.submit(step_ms).result():.1f}")


if __name__ == "__main__":
    main()
