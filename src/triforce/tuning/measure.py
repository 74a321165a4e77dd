"""What `triforce tune` measures with, shared with the benchmarks: forward timings on a cache rolled back
between forwards, and the sampling settings every measurement runs at."""
from __future__ import annotations

import statistics
import time

import torch

from ..sampling import SamplingParams


def sampling_params(temperature: float):
    """The benchmarks' sampling: greedy at T = 0, else temperature T with top-p 0.9."""
    return SamplingParams(temperature=temperature, top_p=0.9 if temperature > 0 else 1.0)


def time_forwards(model, cache, length: int, k: int, repeats: int, warmup: int = 1) -> float:
    """Median seconds of a k-token forward on `cache` rolled back to `length` before each one
    (and after the last); the first `warmup` forwards are not timed."""
    return time_forwards_interleaved(model, cache, length, (k,), repeats, warmup)[0]


def time_forwards_interleaved(model, cache, length: int, ks: tuple[int, ...], repeats: int,
                              warmup: int = 2) -> list[float]:
    """Median seconds of a k-token forward for each k of `ks`, the sizes taking turns (k1, k2, k1, k2, ...) on one
    cache rolled back to `length` before each forward: their ratio (a verification against a decode step) then
    comes from the same minutes of a host whose speed drifts, not from two stretches one after the other."""
    toks = {k: torch.full((1, k), 42, device=model.device) for k in ks}
    times = {k: [] for k in ks}
    with torch.inference_mode():
        for i in range(warmup + repeats):
            for k in ks:
                cache.rollback(length)
                t = time.perf_counter()
                model(toks[k], cache)
                if i >= warmup:
                    times[k].append(time.perf_counter() - t)
    cache.rollback(length)
    return [statistics.median(times[k]) for k in ks]
