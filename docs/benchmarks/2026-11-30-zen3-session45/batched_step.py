# one batched decode step of N requests (1 row each) over CTX random cached tokens: median and min ms over REPS
# usage: python batched_step.py CTX N REPS [THREADS]   (alternated across builds with PYTHONPATH=<tree>/src)
import sys, time, torch
from triforce.caches import new_cache
from triforce.caches.synthetic import fill_random
from triforce.execution.runner import forward_batch
from triforce.loading import load_model
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
ctx = int(sys.argv[1]); n = int(sys.argv[2]); reps = int(sys.argv[3])
model = load_model(progress=False).model
with torch.inference_mode():
    caches = []
    for _ in range(n):
        c = new_cache(model, ctx + 64); fill_random(c, ctx); caches.append(c)
    tokens = [torch.randint(0, model.cfg.vocab_size, (1, 1)) for _ in caches]
    import os,sys
    ts = []
    for r in range(reps):
        t0 = time.perf_counter()
        forward_batch(model, [(t, c, 1) for t, c in zip(tokens, caches)])
        for c in caches: c.rollback(ctx)
        ts.append(time.perf_counter() - t0)
    ts.sort(); print("median ms", ts[len(ts)//2]*1e3, "min", ts[0]*1e3)
