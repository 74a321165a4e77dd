#!/usr/bin/env python
"""Tokens per top-level round (timing-free) of chains vs Sequoia trees, embedded model, 8K prompt."""
import json
import statistics
import sys
import time

import torch

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
from triforce.corpus import demo_tokens
from triforce.generate import generate
from triforce.loading import load_model
from triforce.sampling import SamplingParams
from triforce.speculation.builder import full_capacity
from triforce.speculation.settings import SpecConfig
from triforce.speculation.stack import StackSpec
from triforce.speculation.state import PrefilledPrompt

n_ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
lm = load_model(progress=False)
model = lm.model
prompt = demo_tokens(lm.tokenizer, n_ctx)
stacks = [("streaming,full", "4", None), ("streaming,full", "4", "2,2,1"), ("streaming,full", "4", "3,2,1"),
          ("streaming,full", "4", "4,1,1,1"), ("streaming,full", "4", "2,2,2,1"), ("streaming,full", "4", "3,1,1,1,1"),
          ("ngram,full", "4", None), ("streaming,retrieval,full", "3,4", None), ("streaming,retrieval,full", "3,4", "2,2,1"),
          ("ngram,retrieval,full", "3,4", None)]
specs = [StackSpec.parse(l, g, tree=t) for l, g, t in stacks]
NEW = 128
pre = PrefilledPrompt(model, prompt, max(full_capacity(n_ctx, NEW, s) for s in specs))
cfg = SpecConfig()
out = []
for temp, seeds in ((0.0, [0]), (0.6, [0, 1, 2, 3])):
    params = SamplingParams(temperature=temp, top_p=0.9 if temp else 1.0)
    for spec in specs:
        tpr, fw, secs, acc = [], [], [], []
        for seed in seeds:
            t = time.perf_counter()
            r = generate(model, prompt, NEW, params, stack=spec, config=cfg, prefilled=pre, seed=seed)
            secs.append(time.perf_counter() - t)
            top = r.stats["levels"][0]
            tpr.append(top["tokens_per_round"]); acc.append(top["acceptance_rate"])
            fw.append({l["level"]: l.get("forwards") for l in r.stats["levels"]})
        row = {"T": temp, "stack": str(spec), "tokens_per_round": round(statistics.mean(tpr), 3),
               "per_seed": tpr, "forwards": fw[0], "s_per_run": round(statistics.mean(secs), 2)}
        out.append(row)
        print(json.dumps(row), flush=True)
