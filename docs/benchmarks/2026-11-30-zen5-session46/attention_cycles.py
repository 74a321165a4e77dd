"""Cycles per cached key and KV head of the decode-attention kernel's path 0 over bf16 K/V, cache-resident (the
arithmetic, not the reads): 3 KV heads x S keys x 64 dims, 3 query rows per token, T tokens (causal when T > 1).

    python attention_cycles.py 4096 1      # a decode step's 3 rows
    python attention_cycles.py 4096 21     # a 63-row prefill chain call
    python attention_cycles.py 4096 21 1 1 3000   # path 1 (per row), 1 thread, 3000 calls (for perf record)

Cycles at 4 GHz (this host's clock under load, from its FMA peak: 2 FMAs a cycle x 16 lanes x 2 FLOPs).
"""
import sys
import time

import torch

from triforce import kernels

ops = kernels.cpu()
S, T = int(sys.argv[1]), int(sys.argv[2])
path = int(sys.argv[3]) if len(sys.argv) > 3 else 0
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
n = int(sys.argv[5]) if len(sys.argv) > 5 else 200
H, D, R = 3, 64, 3 * T
k, v = torch.randn(H, S, D).to(torch.bfloat16), torch.randn(H, S, D).to(torch.bfloat16)
q = torch.randn(H, R, D)
for _ in range(5):
    ops.decode_attention(q, k, v, T, T > 1, D ** -0.5, path)
t = time.perf_counter()
for _ in range(n):
    ops.decode_attention(q, k, v, T, T > 1, D ** -0.5, path)
dt = (time.perf_counter() - t) / n
print(f"S={S} R={R} path {path}: {dt * 1e6:.1f} us a call, {dt * 4e9 / (H * S):.0f} cycles a key and head at 4 GHz "
      f"({torch.get_num_threads()} threads)")
