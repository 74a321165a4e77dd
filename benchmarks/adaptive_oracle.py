"""The adaptive stack against fixed n-gram stacks at T = 0, from one prefill, with the arithmetic in between.

    PYTHONPATH=src python benchmarks/adaptive_oracle.py CONTEXT GENRE [NEW REPEATS GAMMAS]
    e.g. PYTHONPATH=src python benchmarks/adaptive_oracle.py 32000 prose 128 3 2,3,4

Runs `ngram,full --gammas g` for each g in GAMMAS (default 1,2,3,4,5,6,8) and the adaptive default, interleaved,
REPEATS times, on one genre's prompt of CONTEXT tokens prefilled once. Prints per run its decode time split into
the levels' forwards, retrieval rebuilds and the planner; then the full level's forward cost by tokens fed
(medians over every fixed run), each gamma's rounds simulated over the greedy output (exact at T = 0: a proposal
is accepted as far as it equals the greedy text) priced with those medians beside its measured ms/token, and what
the planner predicted at its last plans (its n-gram window's tokens per round by gamma: compare with the
simulated ones). Every run's tokens are checked against `ar`'s.
"""
import collections
import statistics
import sys
import time

import triforce.speculation.planner as planner_mod
from triforce.commands.common import default_draft_kv
from triforce.corpus import genre_tokens
from triforce.generate import generate
from triforce.loading import load_model
from triforce.speculation.drafters import NGramDrafter
from triforce.speculation.settings import SpecConfig
from triforce.speculation.state import ModelState, PrefilledPrompt
from triforce.tuning.measure import sampling_params

n, genre = int(sys.argv[1]), sys.argv[2]
new = int(sys.argv[3]) if len(sys.argv) > 3 else 128
repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 2
gammas = [int(x) for x in sys.argv[5].split(",")] if len(sys.argv) > 5 else [1, 2, 3, 4, 5, 6, 8]
loaded = load_model()
model = loaded.model
cfg = SpecConfig(draft_kv_dtype=default_draft_kv(type("Args", (), {"device": "cpu"})))
prompt = genre_tokens(loaded.tokenizer, genre, n)
t0 = time.perf_counter()
shared = PrefilledPrompt(model, prompt, n + 300, 512)
print(f"{genre} {n}: prefill {time.perf_counter() - t0:.1f} s", flush=True)

recording: dict = {"forwards": None}  # (tokens fed, seconds) of every forward of the run being recorded
_init = ModelState.__init__


def _recording_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.on_forward = lambda k, dt: recording["forwards"] is not None and recording["forwards"].append((k, dt))


ModelState.__init__ = _recording_init  # the adaptive stack sets its own on_forward after this: not recorded
plans: list = []
_plan = planner_mod.Planner.plan


def _logging_plan(self):
    out = _plan(self)
    b = self.measured.ngram_top.boundary()
    plans.append((self.round, self.route.text(self.kinds), b and [round(b.tokens(g), 2) for g in range(1, 9)]))
    return out


planner_mod.Planner.plan = _logging_plan
greedy = sampling_params(0.0)
for method in ("ar", "triforce", "ngram"):  # warm-up
    generate(model, prompt, 4, greedy, method=method, config=cfg, prefilled=shared)
reference = list(generate(model, prompt, new, greedy, method="ar", config=cfg, prefilled=shared).tokens)


def simulated_feeds(gamma: int) -> list[int]:
    """Tokens fed to the full level by each round of ngram,full@gamma over the greedy output."""
    drafter = NGramDrafter(model.cfg.vocab_size, cfg.ngram)
    seq, pos, end, feeds = prompt + reference, len(prompt), len(prompt) + new, []
    while pos < end:
        proposal, _ = drafter.lookup(seq[:pos], pos, max(min(gamma, end - pos - 1), 0))
        m = 0
        while m < len(proposal) and seq[pos + m] == proposal[m]:
            m += 1
        feeds.append(1 + len(proposal))
        pos += m + 1
    return feeds


measured = collections.defaultdict(list)
full_ms = collections.defaultdict(list)
for _ in range(repeats):
    for g in gammas + ["adaptive"]:
        recording["forwards"], plans[:] = [], []
        if g == "adaptive":
            r = generate(model, prompt, new, greedy, method="triforce", config=cfg, prefilled=shared)
        else:
            fixed = SpecConfig(gamma=g, adapt=False, draft_kv_dtype=cfg.draft_kv_dtype)
            r = generate(model, prompt, new, greedy, method="ngram", config=fixed, prefilled=shared)
            for k, dt in recording["forwards"]:
                full_ms[k].append(dt * 1e3)
        recording["forwards"] = None
        assert list(r.tokens) == reference, f"{g}: not ar's greedy output"
        measured[g].append(r.decode_seconds / len(r.tokens) * 1e3)
        st = r.stats
        levels = [(lv["level"], lv["role"], lv.get("forwards"), round(lv.get("seconds", 0) * 1e3))
                  for lv in st["levels"]]
        line = f"  {g}: decode {r.decode_seconds * 1e3:.0f} ms; levels (name, role, forwards, ms) {levels}"
        if g == "adaptive":
            a = st["adaptive"]
            line += (f"; rebuilds {st.get('retrieval_rebuilds')} ({st.get('retrieval_rebuild_seconds')} s); planner"
                     f" {a['planner_seconds']} s\n    routes {a['routes']}\n    last plans (round, route, window's"
                     f" tokens/round by gamma 1-8) {plans[-2:]}")
        print(line, flush=True)
medians = {k: statistics.median(v) for k, v in full_ms.items()}
print("full forward ms by tokens fed (median, count):",
      {k: (round(medians[k], 1), len(full_ms[k])) for k in sorted(medians)})
for g in gammas:
    feeds = simulated_feeds(g)
    priced = sum(medians.get(k, float("nan")) for k in feeds) / new
    print(f"ngram,full@{g}: {len(feeds)} rounds, {new / len(feeds):.2f} tokens/round, forwards priced "
          f"{priced:.2f} ms/token, measured {' '.join(f'{x:.2f}' for x in measured[g])}")
print("adaptive measured", " ".join(f"{x:.2f}" for x in measured["adaptive"]))
