"""Median time of the decode attention kernel over 30 layers of random fp16 K/V (the embedded model's
shapes: 3 KV heads, 3 query rows each per token, head dim 64), and the K/V read rate it implies.

    python benchmarks/attention_time.py 8192          # 2 threads, a decode step (1 token)
    python benchmarks/attention_time.py 8192 1        # 1 thread
    python benchmarks/attention_time.py 32768 2 5     # a 5-token verification (15 rows per KV head, causal)
    python benchmarks/attention_time.py 32768 2 5 bf16 3   # bf16 K/V, path 3: the scores on AMX tiles (0: auto,
                                                         # 1: per row, 2: rows in lanes on FMAs, 4: per row
                                                         # with the scores rows-in-lanes in the per-row order)

Each layer's K/V are distinct (as in a decode step), so above a few thousand tokens they come from DRAM.
"""
import sys
import time

import torch

from triforce import kernels

ops = kernels.cpu()
if ops is None:
    sys.exit("no compiled CPU kernels here (TRIFORCE_ISA=off, or no compiler)")
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
S, L, H, D = int(sys.argv[1]) if len(sys.argv) > 1 else 8192, 30, 3, 64
T = int(sys.argv[3]) if len(sys.argv) > 3 else 1
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[4] if len(sys.argv) > 4 else "fp16"]
path = int(sys.argv[5]) if len(sys.argv) > 5 else 0
R = 3 * T
ks = [torch.randn(H, S, D).to(dtype) for _ in range(L)]
vs = [torch.randn(H, S, D).to(dtype) for _ in range(L)]
q = torch.randn(H, R, D)


def step():
    for layer in range(L):
        ops.decode_attention(q, ks[layer], vs[layer], T, T > 1, D ** -0.5, path)


for _ in range(3):
    step()
times = []
for _ in range(15):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
ms = sorted(times)[len(times) // 2] * 1e3
gb = L * H * S * D * 2 * ks[0].element_size() / 1e9
gflop = L * H * R * S * D * 4 / 1e9  # q k and p v: 2 flops per multiply-add
print(f"{S} tokens, {T} query token(s), {dtype}, path {path}, {torch.get_num_threads()} threads, {ops.ISA}: {ms:.2f} ms for 30 layers, "
      f"{gb / ms * 1e3:.1f} GB/s, {gflop / ms * 1e3:.0f} GFLOP/s")
