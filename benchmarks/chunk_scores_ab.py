"""The retrieval cache's chunk scores (caches/retrieval.py chunk_scores: q . each chunk's mean key), the compiled kernel
against PyTorch's operations, alternated in one process: the embedded model's 30 layers x 3 KV heads at 32K, chunks
of 8, as a retrieval build at 32K scores them.

    python benchmarks/chunk_scores_ab.py fp16                        # or bf16
    TRIFORCE_ISA=avx2 python benchmarks/chunk_scores_ab.py fp16      # the AVX2 build
"""
import sys
import time

import torch

from triforce import kernels
from triforce.caches import retrieval

torch.set_num_threads(2)
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[1]]
H, N, D, C, LAYERS = 3, 32000, 64, 8, 30
keys = [torch.randn(1, H, N + 200, D).to(dtype) for _ in range(LAYERS)]  # each layer a slice of a longer buffer
q = torch.randn(1, H, D)
n = (N - 64) // C * C  # the chunks a build scores (the 64 recent tokens kept whole)
ops = kernels.cpu()


def run(module) -> float:
    with kernels.override(module):
        t = time.perf_counter()
        for k in keys:
            retrieval.chunk_scores(k[:, :, :n], q, C)
        return (time.perf_counter() - t) * 1e3


times = {"kernel": [], "pytorch": []}
for _ in range(5):
    times["kernel"].append(run(ops))
    times["pytorch"].append(run(None))
print(f"{ops.ISA} {sys.argv[1]} 30 layers x 3 KV heads, 32K keys, chunks of 8: "
      + ", ".join(f"{k} {sorted(v)[2]:.1f} ms (median of 5; {min(v):.1f}-{max(v):.1f})" for k, v in times.items()))
