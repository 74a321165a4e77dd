"""A batched forward of N requests' T-token chains (runner.forward_batch, every request over its own random cache of
C tokens) against one request's T-token forward alone, on the embedded model: what N questions arriving together
cost (T = a question's tokens), or N verifications (T = the drafts + 1). Prints each median and the attention's
FLOPs over it (the scores and p v of every query head and layer), the linear layers' included in the time.

    python benchmarks/batch_rows.py --context 8192 --requests 8 --tokens 1,4,12
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode_step import random_cache
from triforce.execution.runner import forward_batch
from triforce.loading import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192, help="each request's cached tokens")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", default="1,4,12", help="chain lengths T, comma-separated")
    p.add_argument("--reps", type=int, default=6, help="timed forwards of each kind (after 2 untimed)")
    a = p.parse_args()
    model = load_model(progress=False).model
    cfg, n = model.cfg, a.context
    caches = [random_cache(model, n, 64) for _ in range(a.requests)]

    def attention_flops(rows: int) -> float:
        return 4.0 * rows * n * cfg.n_heads * cfg.head_dim * cfg.n_layers

    def timed(fn) -> float:
        times = []
        for i in range(a.reps + 2):
            for c in caches:
                c.rollback(n)
            t = time.perf_counter()
            fn()
            if i >= 2:
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    print(f"{a.requests} requests, each over {n} cached tokens (bf16 K/V: {model.kv_dtype}), "
          f"{torch.get_num_threads()} threads")
    with torch.inference_mode():
        for T in (int(x) for x in a.tokens.split(",")):
            toks = [torch.full((1, T), 42) for _ in caches]
            batch = timed(lambda: forward_batch(model, [(x, c, T) for x, c in zip(toks, caches)]))
            alone = timed(lambda: model(toks[0], caches[0], last=T))
            print(f"T = {T}: batch of {a.requests} {batch * 1e3:.1f} ms ({batch / a.requests * 1e3:.1f} ms a request, "
                  f"{attention_flops(a.requests * T) / batch / 1e9:.0f} GFLOP/s of attention); one alone "
                  f"{alone * 1e3:.1f} ms ({attention_flops(T) / alone / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
