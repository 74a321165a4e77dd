"""The adaptive stack's planning time against its decode time, per genre and temperature (its worst case is a
short context, where decode steps are cheapest).

    python benchmarks/planner_overhead.py 8192
"""
import sys

from triforce import load_model
from triforce.commands.common import default_draft_kv as _default_draft_kv
from triforce.corpus import GENRES, genre_tokens
from triforce.generate import generate
from triforce.speculation.settings import SpecConfig
from triforce.speculation.state import PrefilledPrompt
from triforce.tuning.measure import sampling_params

n = int(sys.argv[1])
m = load_model(); model = m.model
cfg = SpecConfig(draft_kv_dtype=_default_draft_kv(type("Args", (), {"device": "cpu"})))  # as the CLI sets it
plan = dec = 0.0
for genre in GENRES:
    prompt = genre_tokens(m.tokenizer, genre, n)
    shared = PrefilledPrompt(model, prompt, n + 200, 512)
    generate(model, prompt, 4, sampling_params(0.0), method="triforce", config=cfg, prefilled=shared)
    for t in (0.0, 0.6):
        res = generate(model, prompt, 128, sampling_params(t), method="triforce", config=cfg, prefilled=shared, seed=0)
        a = res.stats["adaptive"]
        print(f"{n} {genre} T={t}: {res.decode_seconds / len(res.tokens) * 1e3:.2f} ms/token, planner "
              f"{a['planner_seconds'] * 1e3:.1f} ms of {res.decode_seconds * 1e3:.0f} ms = "
              f"{a['planner_seconds'] / res.decode_seconds * 100:.2f}%, {a['plans']} plans", flush=True)
        plan += a["planner_seconds"]; dec += res.decode_seconds
print(f"all: planner {plan / dec * 100:.2f}% of decode time")
