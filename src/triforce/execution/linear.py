"""Linear layers and the token embedding over every weight format the model holds: fp32 (or bf16 panels for draft
levels) through the compiled panel kernel, GGML blocks (QuantLinear, QuantEmbedding) through the block and integer
kernels, and PyTorch's operations where the kernels are not there. Each layer holds its model's kernels.Backend
(execution.Execution sets it); a row's result never depends on the rows that come with it, which is what lets a
verification score a token exactly as a decode step does."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..ggml_blocks import FORMATS, QuantTensor, dequantize, pack_rows, packable, release, unpack_rows
from ..kernels.capabilities import capabilities


def _mkldnn_packing_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# Inputs of up to this many rows (decode steps, verification of drafts) use the panel kernel.
PANEL_MAX_ROWS = 16
# QuantLinear runs inputs of up to this many rows (a draft tree's verification) through its kernel 16 rows
# at a time, each row as a decode step computes it; past it (prefill) dequantized panels and F.linear are
# cheaper. Embedded model, 1K context: a 17-token forward 84 -> 28 ms, 64 tokens 146 -> 93 ms.
KERNEL_CHUNKS_MAX_ROWS = 64


class Linear(nn.Linear):
    """nn.Linear that, once `pack()`ed on CPU, runs inputs of up to PANEL_MAX_ROWS rows through the
    compiled panel kernel (kernels/linear_panels.cpp) with a copy of the weights cut into 16-output
    panels. It streams the weights at memory speed for 1 to 8 rows alike (MKL's GEMM with 2-16 rows
    read them at well under half its single-row speed, which made verifying k drafts cost up to 2x a
    decode step), and a row's result does not depend on how many rows come with it.
    `pack(torch.bfloat16)` keeps the panels in bf16: half the bytes, for draft levels only.
    Longer inputs (prefill) use F.linear; without the kernels, multi-row inputs use a oneDNN pre-packed
    copy of the weights instead of panels."""

    panels: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    backend: kernels.Backend = kernels.TORCH  # the model's, set by execution.Execution

    def pack(self, dtype: torch.dtype = torch.float32) -> None:
        w = self.weight.detach()
        if w.device.type != "cpu" or w.dtype != torch.float32:
            return
        if self.backend.enabled:
            n, k = w.shape
            p = (n + 15) // 16
            padded = torch.zeros(p * 16, k, dtype=dtype)
            padded[:n] = w
            self.panels = padded.view(p, 16, k).transpose(1, 2).contiguous()  # [P, K, 16]
        elif dtype == torch.float32 and _mkldnn_packing_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)

    @property
    def nbytes(self) -> int:
        """The weight bytes a decode-sized forward reads (its panels where packed)."""
        w = self.panels if self.panels is not None else self.weight
        return w.numel() * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.panels is not None and rows <= PANEL_MAX_ROWS and (ops := self.backend.ops) is not None:
            y = ops.linear_panels(x, self.panels, self.out_features)
            return y if self.bias is None else y + self.bias
        if self.packed is not None and rows > 1:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    """A linear layer whose weight stays in GGML block formats (ggml_blocks.py): `parts`, [N_i, K] each
    in its own type (a fused projection may mix them: Q4_K_M files keep some V in Q6_K), outputs
    concatenated. Up to KERNEL_CHUNKS_MAX_ROWS rows of fp32 x go through a compiled kernel,
    PANEL_MAX_ROWS at a time: once `pack()`ed on a CPU with the kernels, Q4_0 / Q4_1 / Q5_0 / Q5_1 /
    Q8_0 / Q4_K / Q5_K / Q6_K weights are held interleaved 16 rows at a time (the same bytes) for the
    integer kernel (kernels/quant_packed.cpp: x taken to 16 bits per 32-element block), other formats
    as stored for the block kernel (kernels/quant_linear.cpp: fp32 arithmetic); where the integer kernel
    has a many-row path for all the parts' types (capabilities' packed_many_rows: every packed type on the
    AVX2 build), a verification's rows go through it in one call, the same bits. Longer inputs (prefill) take
    the integer kernel too where it outruns a GEMM (capabilities' packed_prefill: AVX-512 VNNI builds), every row
    the decode step's; elsewhere, or with no kernels, they dequantize a few thousand rows at a time (about 8 MB of
    fp32) and use F.linear: never a whole fp32 matrix. Either way a row's result does not depend on the other rows."""

    backend: kernels.Backend = kernels.TORCH  # the model's, set by execution.Execution
    PANEL_BYTES = 8 << 20

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.types = [p.qtype for p in parts]
        self.types_set = frozenset(self.types)
        self.rows = [p.shape[0] for p in parts]
        self.n_parts = len(parts)
        self.packed = [False] * len(parts)  # per part: raw{i} holds pack_rows bytes instead of the file's
        self.mapped = [p.mapped for p in parts]
        self._names = tuple(f"raw{i}" for i in range(len(parts)))
        for name, p in zip(self._names, parts):
            self.register_buffer(name, p.raw, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel_ready = all(p.kernel_ready() for p in parts)  # types and shapes: fixed

    def pack(self) -> None:
        """Interleave the parts the integer kernel reads (quantized.PACKED_FIELDS: Q4_0 / Q4_1 / Q5_0 / Q5_1 /
        Q8_0 / Q4_K / Q5_K / Q6_K) where the kernels have it; the others stay as stored for the block kernel
        (a fused projection may mix both). The file's pages read here are given back (quantized.release)."""
        ops = self.backend.ops
        if any(self.packed) or ops is None or not capabilities(ops).linear_packed or self.in_features % 32:
            return
        for i, p in enumerate(self.parts):
            if packable(p):
                setattr(self, f"raw{i}", pack_rows(p))
                release(QuantTensor(p.raw, p.qtype, p.shape, self.mapped[i]))
                self.packed[i] = True

    def part_rows(self, i: int, start: int = 0, stop: int | None = None) -> QuantTensor:
        """Rows [start, stop) of part i in the file's layout (a view, or a copy from the packed bytes)."""
        raw, shape = getattr(self, f"raw{i}"), (self.rows[i], self.in_features)
        if self.packed[i]:
            return unpack_rows(raw, self.types[i], shape, start, stop, self.backend.ops)
        return QuantTensor(raw, self.types[i], shape).rows(slice(start, stop))

    @property
    def parts(self) -> list[QuantTensor]:
        """The weight in the file's layout (a copy where packed)."""
        return [self.part_rows(i) for i in range(self.n_parts)]

    @property
    def nbytes(self) -> int:
        return sum(n * FORMATS[t][2] * (self.in_features // FORMATS[t][1]) for n, t in zip(self.rows, self.types))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        ops = self.backend.ops
        raws = [self._buffers[name] for name in self._names]  # (Module.__getattr__ costs more: 121 calls a step)
        if ops is not None and rows > PANEL_MAX_ROWS and x.dtype == torch.float32 and self.kernel_ready \
                and all(self.packed):
            caps = capabilities(ops)
            # in one call of the integer kernel, the decode step's bits for every row: a verification's rows where
            # its many-row path takes the types (Zen 3, one thread, 64 rows of the embedded model's Q4_1 shapes 1.4x
            # the 16-row tiles), a prefill's where it outruns dequantized weights (AVX-512 VNNI: 1.56-3.6x MKL's GEMM
            # on Zen 5, so a prompt's cache does not depend on its chunking; on Zen 3 it measured 0.77-1.10x)
            one_call = caps.packed_prefill if rows > KERNEL_CHUNKS_MAX_ROWS else self.types_set <= caps.packed_many_rows
            if one_call:
                y = ops.linear_packed(x, raws, self.types, self.rows)
                return y if self.bias is None else y + self.bias
        if ops is not None and PANEL_MAX_ROWS < rows <= KERNEL_CHUNKS_MAX_ROWS and x.dtype == torch.float32 \
                and self.kernel_ready:  # a verification: the kernel 16 rows at a time, as the decode step computes
            x2 = x.reshape(rows, x.shape[-1])
            y = torch.cat([self(x2[r:r + PANEL_MAX_ROWS]) for r in range(0, rows, PANEL_MAX_ROWS)])
            return y.view(*x.shape[:-1], self.out_features)
        if ops is not None and rows <= PANEL_MAX_ROWS and x.dtype == torch.float32 and self.kernel_ready:
            if all(self.packed):
                y = ops.linear_packed(x, raws, self.types, self.rows)
            elif not any(self.packed):
                y = ops.linear_quant(x, raws, self.types)
            else:  # a mix: each part by its kernel, outputs in order
                y = torch.cat([ops.linear_packed(x, [r], [t], [n]) if packed else ops.linear_quant(x, [r], [t])
                               for r, t, n, packed in zip(raws, self.types, self.rows, self.packed)], dim=-1)
        elif 4 * self.out_features * self.in_features <= self.PANEL_BYTES:  # one panel: one product, no column copies
            parts = self.parts
            if len(parts) > 1 and len(set(self.types)) == 1:  # one dequantization of the parts' bytes together
                parts = [QuantTensor(torch.cat([p.raw for p in parts]), self.types[0],
                                     (self.out_features, self.in_features))]
            w = dequantize(parts[0], ops) if len(parts) == 1 else torch.cat([dequantize(p, ops) for p in parts])
            y = F.linear(x, w.to(x.dtype))
        else:
            y = x.new_empty(*x.shape[:-1], self.out_features)
            col, step = 0, max(16, self.PANEL_BYTES // (4 * self.in_features) // 16 * 16)
            for i, n in enumerate(self.rows):
                for r in range(0, n, step):
                    w = dequantize(self.part_rows(i, r, r + step), ops).to(x.dtype)
                    y[..., col + r:col + r + w.shape[0]] = F.linear(x, w)
                col += n
        return y if self.bias is None else y + self.bias


class QuantEmbedding(nn.Module):
    """The token embedding kept in a GGML block format: a lookup dequantizes the looked-up rows only."""

    backend: kernels.Backend = kernels.TORCH

    def __init__(self, table: QuantTensor):
        super().__init__()
        self.embedding_dim = table.shape[1]
        self.qtype = table.qtype
        self.register_buffer("raw", table.raw, persistent=False)

    @property
    def table(self) -> QuantTensor:
        return QuantTensor(self.raw, self.qtype, (self.raw.shape[0], self.embedding_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(tokens.reshape(-1))
        return dequantize(rows, self.backend.ops).view(*tokens.shape, self.embedding_dim)
