"""The adaptive stack's rounds by route: their time against their forwards' and against the planner's price.

    PYTHONPATH=src python benchmarks/round_times.py CONTEXT GENRE T [NEW REPEATS]
    e.g. TRIFORCE_ISA=avx2 PYTHONPATH=src python benchmarks/round_times.py 32000 dialogue 0.6 128 4

One prefill; then REPEATS times `ar` and the adaptive default, interleaved, each with its own seed. Per run and route
family: rounds, tokens, wall ms per token, the forwards' ms per token, what a round took beyond its forwards, and
the planner's price of the route when it ran (median); the planner's last prices; each level's forward ms by tokens
fed. Where the planner's price and a route's wall time part is where its choices go wrong (docs/journal.md,
2026-11-27, session 30).
"""
import collections
import statistics
import sys
import time

import triforce.speculation.adaptive as A
import triforce.speculation.measurements as M
from triforce.commands.common import default_draft_kv
from triforce.corpus import genre_tokens
from triforce.generate import generate
from triforce.loading import load_model
from triforce.speculation.settings import SpecConfig
from triforce.speculation.state import PrefilledPrompt
from triforce.tuning.measure import sampling_params

n, genre, temp = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
new = int(sys.argv[4]) if len(sys.argv) > 4 else 128
repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 3
loaded = load_model()
model = loaded.model
cfg = SpecConfig(draft_kv_dtype=default_draft_kv(type("Args", (), {"device": "cpu"})))
prompt = genre_tokens(loaded.tokenizer, genre, n)
t0 = time.perf_counter()
shared = PrefilledPrompt(model, prompt, n + 300, 512)
print(f"{genre} {n} T={temp}: prefill {time.perf_counter() - t0:.1f} s", flush=True)

fwd = {"ms": 0.0, "cur": []}  # the forwards of the round being timed: their ms, and (level, k, ms) each
_add = M.LevelCosts.add


def add(self, k, seconds):
    fwd["ms"] += seconds * 1e3
    fwd["cur"].append((self.level_name, k, round(seconds * 1e3, 1)))
    return _add(self, k, seconds)


M.LevelCosts.add = add
_init = A.AdaptiveTop.__init__


def init(self, *a, **kw):
    _init(self, *a, **kw)
    for i, c in self.planner.measured.costs.items():
        c.level_name = self.names[i]


A.AdaptiveTop.__init__ = init
rounds = []
_step = A.AdaptiveTop.step


def step(self, ctx, committed, limit):
    fwd["ms"], fwd["cur"] = 0.0, []
    t = time.perf_counter()
    out = _step(self, ctx, committed, limit)
    wall = (time.perf_counter() - t) * 1e3
    route = self.route_text
    fam = route.split("@")[0]
    pred = self.planner.predicted.get(route)
    rounds.append(dict(route=route, fam=fam, wall=wall, fwd=fwd["ms"], tokens=len(out), pred=pred,
                       feeds=fwd["cur"], predicted=dict(self.planner.predicted)))
    return out


A.AdaptiveTop.step = step
params = sampling_params(temp)
for method in ("ar", "triforce"):
    generate(model, prompt, 4, params, method=method, config=cfg, prefilled=shared, seed=0)
ar_ms, tf_ms = [], []
for rep in range(repeats):
    r = generate(model, prompt, new, params, method="ar", config=cfg, prefilled=shared, seed=rep + 1)
    ar_ms.append(r.decode_seconds / len(r.tokens) * 1e3)
    rounds.clear()
    r = generate(model, prompt, new, params, method="triforce", config=cfg, prefilled=shared, seed=rep + 1)
    tf_ms.append(r.decode_seconds / len(r.tokens) * 1e3)
    by = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, []])
    for x in rounds:
        b = by[x["fam"]]
        b[0] += 1
        b[1] += x["wall"]
        b[2] += x["fwd"]
        b[3] += x["tokens"]
        if x["pred"] is not None:
            b[4].append(x["pred"])
    print(f"rep {rep}: ar {ar_ms[-1]:.2f} ms/token, triforce {tf_ms[-1]:.2f} ({ar_ms[-1] / tf_ms[-1]:.3f}x)")
    for fam, (k, wall, f, tok, preds) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"  {fam:24s} rounds {k:3d} tokens {tok:3d}  wall {wall / tok:6.2f} ms/token  fwd {f / tok:6.2f}"
              f"  overhead/round {(wall - f) / k:5.2f} ms  predicted(median) "
              f"{statistics.median(preds) if preds else float('nan'):.2f}")
    print("  last predicted:", rounds[-1]["predicted"])
    topk = collections.defaultdict(list)
    for x in rounds:
        for name, k, ms in x["feeds"]:
            topk[(name, k)].append(ms)
    print("  forward ms median by (level, k):", {k: (round(statistics.median(v), 1), len(v))
                                                   for k, v in sorted(topk.items())})
print(f"ar {statistics.median(ar_ms):.2f} triforce {statistics.median(tf_ms):.2f} "
      f"ratio {statistics.median(ar_ms) / statistics.median(tf_ms):.3f}")
