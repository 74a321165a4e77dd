"""A prefill chunk's linear layer on the integer kernel (linear_packed, as the decode step computes every row)
against PyTorch's GEMM on the dequantized weights (what QuantLinear ran for prefill before packed_prefill), per
GGML format, random blocks: GFLOP/s of each and their ratio.

    python benchmarks/linear_prefill.py            # 512 rows, 2 threads
    python benchmarks/linear_prefill.py --rows 1024 --threads 1

Each figure is the best of 5 calls in one process, the two alternated.
"""
import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from triforce import kernels
from triforce.ggml_blocks import dequantize, pack_rows, random_blocks

FORMATS = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
K_QUANTS = (12, 13, 14)  # rows of 256-weight blocks


def best(fn, n=5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.cpu()
    if ops is None:
        raise SystemExit("no compiled CPU kernels here")
    print(f"{ops.ISA} build, packed_prefill {bool(getattr(ops, 'PACKED_PREFILL', False))}, {args.rows} rows, "
          f"{args.threads} threads")
    rng = np.random.default_rng(0)
    for qtype, name in FORMATS.items():
        shapes = ((1536, 1024), (1024, 1536), (2048, 2048)) if qtype in K_QUANTS else \
            ((1536, 576), (576, 1536), (2048, 2048))
        for n, k in shapes:
            t = random_blocks(qtype, n, k, rng)
            raw, w = pack_rows(t), dequantize(t, ops)
            x = torch.randn(args.rows, k)
            F.linear(x, w), ops.linear_packed(x, [raw], [qtype], [n])
            gemm = best(lambda: F.linear(x, w))
            packed = best(lambda: ops.linear_packed(x, [raw], [qtype], [n]))
            flop = 2 * args.rows * n * k
            print(f"{name} {n}x{k}: GEMM on dequantized weights {flop / gemm / 1e9:.0f} GFLOP/s, integer kernel "
                  f"{flop / packed / 1e9:.0f} GFLOP/s ({gemm / packed:.2f}x)")


if __name__ == "__main__":
    main()
