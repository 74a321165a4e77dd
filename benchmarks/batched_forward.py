"""Batched forwards against the same forwards one request at a time (runner.forward_batch vs forward): N
requests, each with its own KV cache of CTX random tokens (caches/synthetic.py), each feeding ROWS tokens (1: a
decode step; 5: a verification of 4 drafts). A and B alternate, so both come from the same minutes of a drifting
host; the medians and their ratio are printed, with the weight and KV bytes each reads.

    python benchmarks/batched_forward.py --context 8192 --requests 8 --rows 1,5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from triforce.caches import new_cache
from triforce.caches.synthetic import fill_random
from triforce.execution.runner import forward_batch, weight_bytes
from triforce.loading import load_model
from triforce.memory import kv_bytes, kv_value_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rows", default="1,5")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--draft-weights", action="store_true", help="the retrieval level's weights (the draft copy)")
    a = p.parse_args()
    loaded = load_model(progress=False)
    model = loaded.model
    if a.draft_weights:
        from triforce.speculation.kinds import draft_weights_model

        model = draft_weights_model(model)
    weights = weight_bytes(model)
    kv = kv_bytes(model.cfg, a.context, kv_value_bytes(model.kv_dtype))
    print(f"{loaded.source}: weights {weights / 2**20:.0f} MiB read per forward (linear layers), KV "
          f"{kv / 2**20:.0f} MiB per request at {a.context} ({model.kv_dtype}), {torch.get_num_threads()} threads")
    with torch.inference_mode():
        caches = []
        for _ in range(a.requests):
            c = new_cache(model, a.context + 64)
            fill_random(c, a.context)
            caches.append(c)
        for rows in [int(r) for r in a.rows.split(",")]:
            tokens = [torch.randint(0, model.cfg.vocab_size, (1, rows)) for _ in caches]

            def alone():
                for t, c in zip(tokens, caches):
                    model(t, c, last=rows)
                    c.rollback(a.context)

            def batched():
                forward_batch(model, [(t, c, rows) for t, c in zip(tokens, caches)])
                for c in caches:
                    c.rollback(a.context)

            times = {"alone": [], "batched": []}
            for rep in range(a.reps + 2):
                for name, fn in (("alone", alone), ("batched", batched)):
                    t0 = time.perf_counter()
                    fn()
                    if rep >= 2:
                        times[name].append(time.perf_counter() - t0)
            ta, tb = statistics.median(times["alone"]), statistics.median(times["batched"])
            print(f"{a.requests} requests x {rows} rows at {a.context}: one at a time {ta * 1e3:.1f} ms "
                  f"({ta / a.requests * 1e3:.1f} per request), batched {tb * 1e3:.1f} ms: {ta / tb:.2f}x")


if __name__ == "__main__":
    main()
