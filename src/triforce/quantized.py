"""Weights kept in GGML block formats (GGUF's quantized tensors) and how to read their values.

A GGUF weight of shape [N, K] is N rows of K / QK blocks, each block QK weights in `block_bytes` bytes
(Q4_K: 256 weights in 144 bytes). We keep exactly those bytes, as a uint8 tensor [N, row_bytes]
(a view of the memory-mapped file where possible), and compute with them: kernels/quant_linear.cpp
dequantizes blocks in registers; without the kernels, `dequantize` below turns a few rows at a time
into fp32 with gguf's own reader code (never a whole matrix at once, see model.QuantLinear).

The values are gguf.quants.dequantize's (bit for bit for Q4_0, Q5_0, Q8_0, Q6_K, F16, BF16 in the
kernel; within one rounding for the formats with a min): a model computed from these bytes is the
model computed from the dequantized fp32 weights, up to fp32 summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# GGML type id -> (name, weights per block, bytes per block) for the types the kernels compute with.
# (gguf.GGMLQuantizationType / gguf.GGML_QUANT_SIZES hold the same numbers.)
FORMATS: dict[int, tuple[str, int, int]] = {
    1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
F32, F16, BF16 = 0, 1, 30
SUPPORTED_NAMES = ", ".join(name for name, _, _ in FORMATS.values())
# F16 / BF16 are computed 32 weights at a time: rows must be whole such groups (else: dequantized to fp32)
KERNEL_GROUP = 32


def type_name(qtype: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(qtype).name
    except (ImportError, ValueError):
        return f"GGML type {qtype}"


@dataclass
class QuantTensor:
    """A [N, K] weight in GGML type `qtype`, as its raw bytes `raw` uint8 [N, row_bytes] (contiguous)."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    @classmethod
    def from_numpy(cls, data: np.ndarray, qtype: int, k: int) -> QuantTensor:
        """`data`: a GGUF tensor's data as gguf's reader gives it ([N, row_bytes] uint8 for block types,
        [N, K] float16 / bfloat-as-uint16 for F16 / BF16), possibly a read-only memory map: no copy is made."""
        raw = np.ascontiguousarray(data).view(np.uint8)
        raw = raw.reshape(raw.shape[0] if raw.ndim > 1 else 1, -1)
        import warnings

        with warnings.catch_warnings():  # a read-only map: we never write to it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(raw)
        return cls(t, int(qtype), (t.shape[0], k))

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def rows(self, index: torch.Tensor | np.ndarray | slice) -> QuantTensor:
        """The rows at `index` (a copy for an index array, a view for a slice)."""
        raw = self.raw[index] if isinstance(index, slice) else self.raw[torch.as_tensor(index, dtype=torch.long)]
        return QuantTensor(raw.contiguous(), self.qtype, (raw.shape[0], self.shape[1]))

    def kernel_ready(self) -> bool:
        """Whether the compiled kernels compute with this tensor as it is."""
        return self.qtype in FORMATS and (FORMATS[self.qtype][1] > 1 or self.shape[1] % KERNEL_GROUP == 0)


def dequantize(t: QuantTensor, ops=None) -> torch.Tensor:
    """fp32 values [N, K] of `t` (meant for a few rows: callers slice first). `ops`: the compiled
    kernels (their dequantize_rows), or None for gguf's numpy code."""
    if ops is not None and t.kernel_ready():
        return ops.dequantize_rows(t.raw, t.qtype)
    from gguf.quants import dequantize as gguf_dequantize

    if t.qtype == F32:
        return t.raw.view(torch.float32).reshape(t.shape)
    return torch.from_numpy(gguf_dequantize(t.raw.numpy(), t.qtype).astype(np.float32, copy=False).reshape(t.shape))


def to_bf16(t: QuantTensor, ops=None) -> QuantTensor:
    """The same weight as BF16 bytes (rounded to nearest even), converted a few rows at a time."""
    n, k = t.shape
    out = torch.empty(n, k, dtype=torch.bfloat16)
    step = max(1, (1 << 22) // max(k, 1))
    for r in range(0, n, step):
        out[r:r + step] = dequantize(t.rows(slice(r, r + step)), ops)
    return QuantTensor(out.view(torch.uint8), BF16, (n, k))


# Weight standard deviation per unit of a block's scale, for random_blocks: the spread of the stored
# integers (uniform codes) times the typical sub-scale of the K-quants.
_CODE_STD = {2: 4.6, 3: 4.6, 6: 9.2, 7: 9.2, 8: 74.0, 12: 32 * 4.6, 13: 32 * 9.2, 14: 24 * 18.5}


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator, std: float = 0.02) -> QuantTensor:
    """A valid random [n, k] weight in GGML type `qtype` whose values spread about `std`: random codes
    with sane fp16 scales (for tests, and model shapes too large to quantize from fp32 in a benchmark)."""
    name, qk, size = FORMATS[qtype]
    if qk == 1:
        w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * std)
        w = w.to(torch.float16 if qtype == F16 else torch.bfloat16)
        return QuantTensor(w.view(torch.uint8).contiguous(), qtype, (n, k))
    nb = k // qk
    raw = rng.integers(0, 256, (n, nb, size), dtype=np.uint8)
    d = (std / _CODE_STD[qtype] * rng.uniform(0.5, 1.5, (n, nb))).astype(np.float32)

    def put(offset: int, values: np.ndarray) -> None:
        raw[:, :, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(n, nb, 2)

    put(208 if qtype == 14 else 0, d)
    if qtype in (3, 7):  # Q4_1 / Q5_1: min about -half the code range
        put(2, -d * (7.5 if qtype == 3 else 15.5))
    elif qtype in (12, 13):  # Q4_K / Q5_K: dmin
        put(2, d * (7.5 if qtype == 12 else 15.5))
    elif qtype == 14:  # Q6_K: 16 int8 sub-scales
        raw[:, :, 192:208] = rng.integers(8, 40, (n, nb, 16), dtype=np.int8).view(np.uint8)
    return QuantTensor(torch.from_numpy(raw.reshape(n, nb * size)), qtype, (n, k))
