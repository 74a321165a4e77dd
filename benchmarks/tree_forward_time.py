"""Median time of a full-level forward of the embedded model over a random cache of N tokens (fp16 KV,
native weights, 2 threads): a decode step, chains, and draft trees' token blocks of the same sizes
(docs/trees.md), then chains of 32 and 64 tokens.

    python benchmarks/tree_forward_time.py 32768      # 5 timed forwards each
    python benchmarks/tree_forward_time.py 32768 3    # 3
"""
import statistics
import sys
import time

import torch

from decode_step import random_cache
from triforce.loading import load_model
from triforce.speculation.state import _tree_block
from triforce.speculation.tree import DraftTree, fixed_tree

torch.set_num_threads(2)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
model = load_model(None, progress=False).model


def timed(T: int, block=None) -> float:
    """Median ms of a T-token forward (a chain, or `block`'s tree) at n cached tokens; 2 forwards warm up."""
    cache = random_cache(model, n, 32)
    tokens = torch.full((1, T), 42)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            cache.rollback(n)
            t = time.perf_counter()
            model(tokens, cache, block=block)
            if i >= 2:
                times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


out = {"step": timed(1), "chain 5": timed(5)}
for widths in ((3, 1, 1, 1, 1), (2, 2, 2, 1), (4, 1, 1, 1)):
    parents = fixed_tree(widths)
    tree = DraftTree(tuple([42] * len(parents)), parents)
    out[f"chain {len(tree) + 1}"] = timed(len(tree) + 1)
    out[f"tree {','.join(map(str, widths))} ({len(tree)} nodes + 1)"] = timed(len(tree) + 1, _tree_block(1, tree, "cpu"))
for T in (32, 64):  # long verifications: their linear layers on the integer kernel's many-row path, where it has one
    out[f"chain {T}"] = timed(T)
print(" | ".join(f"{name} {ms:.1f}" for name, ms in out.items()))
