"""Decode speed with the round provenance (speculation/provenance.py) on and off, in one process, alternated
generation by generation from one prefill, and what it costs per round measured directly.

    PYTHONPATH=src python benchmarks/provenance_ab.py CONTEXT PAIRS [fixed|adaptive]
    e.g. PYTHONPATH=src python benchmarks/provenance_ab.py 8000 12 fixed

Greedy, 64 tokens a generation, the triforce stack (fixed: no planner, whose route choices follow the machine's
timings, so only the machine's noise is left). Off: BuiltStack.provenance, the text split over the tokens and
RoundLog.record are no-ops (the Level's own few list operations stay). Each pair runs both, in alternating order;
every run's tokens are checked equal. Then one more generation with the provenance timed from inside: microseconds
per round in BuiltStack.provenance and in the text split, against the round's milliseconds.
"""
import importlib
import json
import statistics
import sys
import time

from triforce.corpus import demo_tokens
from triforce.generate import generate
from triforce.loading import load_model
from triforce.speculation import builder, provenance
from triforce.speculation.builder import full_capacity
from triforce.speculation.settings import SpecConfig
from triforce.speculation.stack import method_stack
from triforce.speculation.state import PrefilledPrompt

gen_module = importlib.import_module("triforce.generate")
n_ctx, pairs, adapt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "adaptive"
on = (builder.BuiltStack.provenance, gen_module._StopText.take_pieces, provenance.RoundLog.record)
off = (lambda self, tokens, texts=None: None, lambda self, final=False: (self.take(final), None), lambda *a: None)


def use(fns):
    builder.BuiltStack.provenance, gen_module._StopText.take_pieces, provenance.RoundLog.record = fns


m = load_model(progress=False)
ids = demo_tokens(m.tokenizer, n_ctx)
config = SpecConfig(adapt=adapt)
stack = method_stack("triforce", config.gamma, config.gamma_draft, config.draft, adaptive=config.adapt)
pre = PrefilledPrompt(m.model, ids, full_capacity(len(ids), 64, stack) + 64)
rates = {"off": [], "on": []}
ref = None
for i in range(pairs):
    for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
        use(on if mode == "on" else off)
        r = generate(m.model, ids, 64, stack=stack, config=config, prefilled=pre, tokenizer=m.tokenizer,
                     eos_ids=m.eos_token_ids)
        ref = ref or r.tokens
        assert r.tokens == ref
        rates[mode].append(round(r.tokens_per_second, 2))
        print(json.dumps({"pair": i, "mode": mode, "tps": rates[mode][-1], "load": open("/proc/loadavg").read().split()[0]}),
              flush=True)
print(json.dumps({"context": n_ctx, "adaptive": adapt, **{k: v for k, v in rates.items()},
                  "median_off": statistics.median(rates["off"]), "median_on": statistics.median(rates["on"])}))

# the cost from inside: the time in the provenance's own functions, per round
use(on)
spent = {"provenance": 0.0, "pieces": 0.0}


def timed(fn, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t
    return wrapper


builder.BuiltStack.provenance = timed(on[0], "provenance")
gen_module._StopText.take_pieces = timed(on[1], "pieces")  # (take() included: the text as before, plus the split)
stream = gen_module.generate_stream(m.model, ids, 64, stack=stack, config=config, prefilled=pre, tokenizer=m.tokenizer,
                                    eos_ids=m.eos_token_ids)
rounds = sum(1 for _ in stream)
seconds = stream.result.decode_seconds
print(json.dumps({"rounds": rounds, "ms_per_round": round(1e3 * seconds / rounds, 2),
                  "us_per_round": {k: round(1e6 * v / rounds, 1) for k, v in spent.items()},
                  "share_of_decode": round(sum(spent.values()) / seconds, 5)}))
