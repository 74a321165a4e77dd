# per-request overhead of a batched forward: 8 one-row requests against one 8-row request (same process, alternated),
# at CTX cached tokens (16: attention negligible). usage: python segments_overhead.py [CTX]
import sys, time, torch, statistics
from triforce.caches import new_cache
from triforce.caches.synthetic import fill_random
from triforce.execution.runner import forward_batch
from triforce.loading import load_model
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 16
model = load_model(progress=False).model
with torch.inference_mode():
    caches = []
    for _ in range(8):
        c = new_cache(model, ctx + 64); fill_random(c, ctx); caches.append(c)
    tokens = [torch.randint(0, model.cfg.vocab_size, (1, 1)) for _ in caches]
    t8 = torch.randint(0, model.cfg.vocab_size, (1, 8))
    a, b = [], []
    for r in range(40):
        t0 = time.perf_counter()
        forward_batch(model, [(t, c, 1) for t, c in zip(tokens, caches)])
        a.append(time.perf_counter() - t0)
        for c in caches: c.rollback(ctx)
        t0 = time.perf_counter()
        forward_batch(model, [(t8, caches[0], 8)])
        b.append(time.perf_counter() - t0)
        caches[0].rollback(ctx)
    print(f"ctx {ctx}: 8 segments x 1 row {statistics.median(a)*1e3:.2f} ms, 1 segment x 8 rows {statistics.median(b)*1e3:.2f} ms")
