import sys, time, statistics, torch
sys.path.insert(0, "/work/main/benchmarks")
from triforce import kernels
from triforce.loading import load_model
from decode_step import random_cache
from triforce.tuning.measure import time_forwards
torch.set_num_threads(1)
print(kernels.cpu().__file__, file=sys.stderr)
m = load_model(progress=False).model
ctx = int(sys.argv[1])
cache = random_cache(m, ctx, 600)
out = []
for tokens in (1, 5):
    ts = [time_forwards(m, cache, ctx, tokens, 5, warmup=1) for _ in range(3)]
    out.append(min(ts))
ids = torch.randint(0, 1000, (1, 512))
from triforce.caches import new_cache
c2 = new_cache(m, 600)
t = time.perf_counter(); m(ids, c2) if False else None
print(" ".join(f"{x*1e3:.2f}" for x in out))
