#!/usr/bin/env python
"""How well would the target with some of its layers skipped draft for itself?

Teacher forcing on the demo corpus: a prompt of N tokens, then the next NEW tokens of the same text in one
forward; per position, the full model's next-token distribution p and a layer-skipped copy's q (the same
weights, the kept layers only, each over its own full cache: an upper bound on what a skipped-layer drafter
over a StreamingLLM cache could reach). Reported per subset: alpha = sum(min(p, q)) at T = 0.6 (top-p 1),
the expected acceptance of one sampled draft, and greedy agreement (same argmax).

    python benchmarks/layer_skip_acceptance.py [N] [NEW]
"""
import copy
import statistics
import sys

import torch

from triforce.corpus import demo_tokens
from triforce.loading import load_model
from triforce.caches import new_cache

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 128
CHUNK = 512

lm = load_model(progress=False)
model = lm.model
ids = demo_tokens(lm.tokenizer, N + NEW)
L = model.cfg.n_layers


@torch.inference_mode()
def logits_of(m) -> torch.Tensor:
    """Logits [NEW, V] of positions N - 1 .. N + NEW - 2 (each predicting the next token)."""
    cache = new_cache(m, N + NEW + 8)
    for s in range(0, N - 1, CHUNK):
        m(torch.tensor([ids[s:min(s + CHUNK, N - 1)]]), cache)
    return m(torch.tensor([ids[N - 1:N - 1 + NEW]]), cache)[0].float()


def subset(keep: list[int]):
    m = copy.copy(model)  # shares the weights; its own module table, layer list and config
    m._modules = dict(model._modules)
    m.layers = torch.nn.ModuleList([model.layers[i] for i in keep])
    # (the config and so the cache keep every layer: a Block writes its own index's slots; skipped ones stay empty)
    return m


def compare(p_logits, q_logits, temp=0.6):
    p = torch.softmax(p_logits / temp, -1)
    q = torch.softmax(q_logits / temp, -1)
    alpha = torch.minimum(p, q).sum(-1)
    greedy = (p_logits.argmax(-1) == q_logits.argmax(-1)).float()
    return float(alpha.mean()), float(greedy.mean())


full = logits_of(model)
subsets = {
    "all 30 (check)": list(range(L)),
    "skip 2 (layers 14, 15)": [i for i in range(L) if i not in (14, 15)],
    "skip 4 middle (13-16)": [i for i in range(L) if not 13 <= i <= 16],
    "skip 8 middle (11-18)": [i for i in range(L) if not 11 <= i <= 18],
    "skip every other of 4-25 (11)": [i for i in range(L) if i < 4 or i > 25 or i % 2 == 0],
    "even layers only (15)": [i for i in range(L) if i % 2 == 0],
}
print(f"embedded model, {N}-token prompt, {NEW} teacher-forced positions")
print("| layers kept | alpha T=0.6 | greedy agreement | weight bytes read vs all |")
print("|---|---:|---:|---:|")
for name, keep in subsets.items():
    a, g = compare(full, logits_of(subset(keep)))
    print(f"| {name} | {a:.3f} | {g:.3f} | {len(keep) / L:.2f} |", flush=True)
