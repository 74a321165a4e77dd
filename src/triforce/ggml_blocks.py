"""Weights kept in GGML block formats (GGUF's quantized tensors) and how to read their values.

A GGUF weight of shape [N, K] is N rows of K / QK blocks, each block QK weights in `block_bytes` bytes
(Q4_K: 256 weights in 144 bytes). We keep exactly those bytes, as a uint8 tensor [N, row_bytes]
(a view of the memory-mapped file where possible), and compute with them: kernels/quant_linear.cpp
dequantizes blocks in registers; Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K are held
interleaved 16 rows at a time instead (`pack_rows`: the same bytes) for kernels/quant_packed.cpp's integer dot products, which take x to 16
bits per 32-element block; without the kernels, `dequantize` below turns a few rows at a time into
fp32 with gguf's own reader code (never a whole matrix at once, see execution.QuantLinear).

The values are gguf.quants.dequantize's (bit for bit for Q4_0, Q5_0, Q8_0, Q6_K, F16, BF16 in the
kernel; within one rounding for the formats with a min): a model computed from these bytes is the
model computed from the dequantized fp32 weights, up to fp32 summation order.
"""
from __future__ import annotations

import ctypes
import mmap
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .kernels.capabilities import capabilities

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
        import gguf  # start-up: gguf is 40 ms to import, only GGUF files need it

        return gguf.GGMLQuantizationType(qtype).name
    except (ImportError, ValueError):
        return f"GGML type {qtype}"


@dataclass
class QuantTensor:
    """A [N, K] weight in GGML type `qtype`, as its raw bytes `raw` uint8 [N, row_bytes] (contiguous)."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    mapped: bool = False  # raw is a view of a read-only file mapping (release may drop its pages)

    @classmethod
    def from_numpy(cls, data: np.ndarray, qtype: int, k: int) -> QuantTensor:
        """`data`: a GGUF tensor's data as gguf's reader gives it ([N, row_bytes] uint8 for block types,
        [N, K] float16 / bfloat-as-uint16 for F16 / BF16), possibly a read-only memory map: no copy is made."""
        raw = np.ascontiguousarray(data).view(np.uint8)
        raw = raw.reshape(raw.shape[0] if raw.ndim > 1 else 1, -1)
        base = raw
        while isinstance(base, np.ndarray) and not isinstance(base, np.memmap):
            base = base.base
        mapped = isinstance(base, np.memmap) and base.mode == "r"

        with warnings.catch_warnings():  # a read-only map: we never write to it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(raw)
        return cls(t, int(qtype), (t.shape[0], k), mapped)

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


# Formats the integer kernel (kernels/quant_packed.cpp) reads repacked 16 rows at a time: type -> the
# fp16 fields of a block (d; Q4_1: d, m; Q4_K: d, dmin) as (bytes at its start, bytes at its end: Q6_K
# keeps d last); the rest (codes, K-quant sub-block scales) is taken as 4-byte words.
# Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
PACKED_FIELDS = {2: (2, 0), 3: (4, 0), 6: (2, 0), 7: (4, 0), 8: (2, 0), 12: (4, 0), 13: (4, 0), 14: (0, 2)}
PACK_ROWS = 16


def packable(t: QuantTensor) -> bool:
    return t.qtype in PACKED_FIELDS


def release(t: QuantTensor) -> None:
    """Give back the resident pages of a file-mapped tensor once it has been copied (pack_rows): the
    mapping stays valid (a later read pages the file in again), the process's RSS no longer counts them.
    No-op for tensors in ordinary memory."""
    if not t.mapped or t.raw.numel() == 0:
        return

    page = mmap.PAGESIZE
    start = -(-t.raw.data_ptr() // page) * page
    stop = (t.raw.data_ptr() + t.raw.numel()) // page * page
    if stop > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)


def pack_rows(t: QuantTensor) -> torch.Tensor:
    """`t`'s bytes interleaved for kernels/quant_packed.cpp: [ceil(N / 16), 16 row_bytes] uint8 (rows
    padded with zero bytes to a multiple of 16). Group g, block b: the 16 rows' scale fields (each field
    of all rows together; PACKED_FIELDS), then each 4-byte word of the other bytes for all 16 rows. The same bytes as
    the file's (a permutation plus padding): no value changes."""
    n, k = t.shape
    _, qk, size = FORMATS[t.qtype]
    (head, tail), nb = PACKED_FIELDS[t.qtype], k // qk
    raw = t.raw.numpy()
    groups = -(-n // PACK_ROWS)
    if groups * PACK_ROWS != n:
        raw = np.concatenate([raw, np.zeros((groups * PACK_ROWS - n, raw.shape[1]), np.uint8)])
    blocks = raw.reshape(groups, PACK_ROWS, nb, size)
    fields = np.concatenate([blocks[..., :head], blocks[..., size - tail:]], axis=3)
    fields = fields.reshape(groups, PACK_ROWS, nb, (head + tail) // 2, 2).transpose(0, 2, 3, 1, 4)
    words = blocks[..., head:size - tail].reshape(groups, PACK_ROWS, nb, -1, 4).transpose(0, 2, 3, 1, 4)
    out = np.concatenate([fields.reshape(groups, nb, -1), words.reshape(groups, nb, -1)], axis=2)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(groups, nb * PACK_ROWS * size))


def unpack_rows(packed: torch.Tensor, qtype: int, shape: tuple[int, int], start: int = 0,
                stop: int | None = None, ops=None) -> QuantTensor:
    """Rows [start, stop) of a pack_rows tensor of `shape` [N, K], as the file's bytes (a copy). `ops`: the
    compiled kernels (their unpack_rows: the same bytes, 13x faster than numpy's transposes; prefill
    dequantizes every weight through here once per chunk)."""
    n, k = shape
    stop = n if stop is None else min(stop, n)
    _, qk, size = FORMATS[qtype]
    (head, tail), nb = PACKED_FIELDS[qtype], k // qk
    if capabilities(ops).unpack_rows:
        return QuantTensor(ops.unpack_rows(packed, head, tail, size, start, stop), qtype, (stop - start, k))
    g0, g1 = start // PACK_ROWS, -(-stop // PACK_ROWS)
    n_groups, f = g1 - g0, head + tail
    blocks = packed[g0:g1].numpy().reshape(n_groups, nb, PACK_ROWS * size)
    fields = blocks[..., :PACK_ROWS * f].reshape(n_groups, nb, f // 2, PACK_ROWS, 2).transpose(0, 3, 1, 2, 4)
    fields = fields.reshape(n_groups, PACK_ROWS, nb, f)
    words = blocks[..., PACK_ROWS * f:].reshape(n_groups, nb, -1, PACK_ROWS, 4).transpose(0, 3, 1, 2, 4)
    raw = np.concatenate([fields[..., :head], words.reshape(n_groups, PACK_ROWS, nb, -1), fields[..., head:]],
                         axis=3).reshape(n_groups * PACK_ROWS, nb * size)
    lo = start - g0 * PACK_ROWS
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(raw[lo:lo + stop - start])), qtype, (stop - start, k))


def dequantize(t: QuantTensor, ops=None) -> torch.Tensor:
    """fp32 values [N, K] of `t` (meant for a few rows: callers slice first). `ops`: the compiled
    kernels (their dequantize_rows), or None for gguf's numpy code."""
    if ops is not None and t.kernel_ready():
        return ops.dequantize_rows(t.raw, t.qtype)
    from gguf.quants import dequantize as gguf_dequantize  # start-up: gguf is 40 ms to import, only GGUF files need it

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
