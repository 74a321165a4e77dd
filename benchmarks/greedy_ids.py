"""Greedy token ids of every named method and a few user stacks on the bench's prompts, as JSON: run it on two
checkouts and compare the files to show that a change left the output alone (the methods are lossless, so each
should also equal `ar`'s ids; this records them as they are).

    PYTHONPATH=src python benchmarks/greedy_ids.py --context 8192 --new 64 > ids.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

METHODS = ("ar", "triforce", "ngram", "retrieval", "streaming", "quantspec", "sequoia")
STACKS = ("h2o,full", "kv4,full", "ngram,retrieval,full", "streaming,full", "kv4,retrieval,full")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--genres", default="dialogue,prose,code")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--stacks", default=";".join(STACKS))
    args = p.parse_args()

    from triforce.corpus import genre_tokens
    from triforce.generate import generate
    from triforce.loading import load_model
    from triforce.sampling import SamplingParams
    from triforce.speculation.builder import full_capacity
    from triforce.speculation.settings import SpecConfig
    from triforce.speculation.stack import StackSpec, method_stack
    from triforce.speculation.state import PrefilledPrompt

    config = SpecConfig()
    loaded = load_model(None, progress=False)
    model, tok = loaded.model, loaded.tokenizer
    runs = {m: method_stack(m, config.gamma, config.gamma_draft, config.draft, adaptive=config.adapt)
            for m in args.methods.split(",") if m}
    runs.update({s: StackSpec.parse(s) for s in args.stacks.split(";") if s})
    greedy = SamplingParams(temperature=0.0)
    out = {}
    for genre in args.genres.split(","):
        prompt = genre_tokens(tok, genre, args.context)
        t = time.perf_counter()
        shared = PrefilledPrompt(model, prompt, max(full_capacity(args.context, args.new, s) for s in runs.values()),
                                 config.prefill_chunk)
        print(f"{genre}: prefill {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        for name, stack in runs.items():
            t = time.perf_counter()
            res = generate(model, prompt, args.new, greedy, stack=stack, config=config, prefilled=shared)
            out[f"{genre} {name}"] = res.tokens
            print(f"  {name}: {time.perf_counter() - t:.1f} s, equal to ar: {res.tokens == out[f'{genre} ar']}",
                  file=sys.stderr, flush=True)
        del shared
    out["torch"] = torch.__version__
    json.dump(out, sys.stdout, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
