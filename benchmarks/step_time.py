"""Median time of one decode step of the embedded model over N random cached tokens (no prefill).

    python benchmarks/step_time.py 1024 8192      # ms per step at each context, 2 threads
"""
import sys
import time

import torch

from decode_step import random_cache
from triforce.loading import load_model

torch.set_num_threads(2)
model = load_model(progress=False).model
tok = torch.tensor([[1]])
for n in [int(a) for a in sys.argv[1:]] or [8192]:
    cache = random_cache(model, n, 1)
    with torch.inference_mode():
        for _ in range(5):
            model(tok, cache)
            cache.rollback(n)
        times = []
        for _ in range(30):
            t = time.perf_counter()
            model(tok, cache)
            cache.rollback(n)
            times.append(time.perf_counter() - t)
    print(f"{n}: {sorted(times)[15] * 1e3:.2f} ms per step")
