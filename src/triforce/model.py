"""The Llama-family forward (Llama 2/3.x, SmolLM/SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 3) in one file.

Native grouped-query attention: the g = Hq / Hkv query heads sharing a KV head are folded into the
query-length axis ([B, Hkv, g*T, D]), so K/V are never repeated per query head. The KV cache is an
argument of every forward (see caches/base.py); positions are the cache's logical length onwards.

Gemma 3 differs by configuration flags (config.ModelConfig): (1 + w) RMSNorms (the 1 is added to the
weights at load time), norms on the attention and MLP outputs too, embeddings scaled by sqrt(hidden),
GeGLU, QK-norm, query_pre_attn_scalar, final logit softcapping, and sliding-window layers with their own
RoPE, whose window the KV cache implements (caches/sliding.py).
"""
from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import ModelConfig
from .errors import TriforceError
from .caches.base import KVCache, TokenBlock, WindowGap, causal_mask, kv_dtype
from .caches.static import SlotMask, StaticView
from .caches.quantized import QuantizedCache, QuantizedKV
from .quantized import BF16, FORMATS, QuantTensor, dequantize, pack_rows, packable, release, unpack_rows
from .rope import Rotary, apply_rotary

# Transformer -> (ops, its layers, ops.LayerStack) for the fused decode layers: outside the model, so that a
# deepcopy of a model (tests, drafting copies) carries no compiled module (it rebuilds its own)
_LAYER_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# The full-precision buffer of an int8 KV cache (its newest one or two groups of 64 tokens).
INT8_BUFFER_DTYPE = torch.float16


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
    backend: kernels.Backend = kernels.TORCH  # the model's, set by Transformer.select_backend

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.panels is not None and rows <= PANEL_MAX_ROWS and (ops := self.backend.ops) is not None:
            y = ops.linear_panels(x, self.panels, self.out_features)
            return y if self.bias is None else y + self.bias
        if self.packed is not None and rows > 1:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    """A linear layer whose weight stays in GGML block formats (quantized.py): `parts`, [N_i, K] each
    in its own type (a fused projection may mix them: Q4_K_M files keep some V in Q6_K), outputs
    concatenated. Up to KERNEL_CHUNKS_MAX_ROWS rows of fp32 x go through a compiled kernel,
    PANEL_MAX_ROWS at a time: once `pack()`ed on a CPU with the kernels, Q4_0 / Q4_1 / Q5_0 / Q5_1 /
    Q8_0 / Q4_K / Q5_K / Q6_K weights are held interleaved 16 rows at a time (the same bytes) for the
    integer kernel (kernels/quant_packed.cpp: x taken to 16 bits per 32-element block), other formats
    as stored for the block kernel (kernels/quant_linear.cpp: fp32 arithmetic). Longer inputs (prefill),
    or no kernels, dequantize a few thousand rows at a time (about 8 MB of fp32) and use F.linear: never
    a whole fp32 matrix. Either way a row's result does not depend on the other rows."""

    backend: kernels.Backend = kernels.TORCH  # the model's, set by Transformer.select_backend
    PANEL_BYTES = 8 << 20

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.types = [p.qtype for p in parts]
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
        if any(self.packed) or ops is None or not hasattr(ops, "linear_packed") or self.in_features % 32:
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


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32. Gemma's (1 + w) norms hold 1 + w as
    `weight` (load_hf_state_dict adds the 1 in fp32), which is what transformers multiplies by."""

    backend: kernels.Backend = kernels.TORCH  # the model's, set by Transformer.select_backend

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := self.backend.ops) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _causal_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention under the CAUSAL marker, split in two and merged by log-sum-exp: the g*T folded
    query rows against the past keys with no mask, and each query head against the T new keys with
    is_causal. Building and applying a [g*T, S] mask made long prefill chunks about 1.7x slower.
    q [B, Hq, T, D], k/v [B, Hkv, S, D] -> [B, Hkv, g*T, D]."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    o1, l1 = _flash_cpu(q.reshape(B, Hkv, g * T, D), k[:, :, :S - T], v[:, :, :S - T], scale=scale)[:2]
    kb = k[:, :, S - T:].repeat_interleave(g, dim=1)  # only the T new keys are repeated
    vb = v[:, :, S - T:].repeat_interleave(g, dim=1)
    o2, l2 = _flash_cpu(q, kb, vb, is_causal=True, scale=scale)[:2]
    o2, l2 = o2.reshape(B, Hkv, g * T, D), l2.reshape(B, Hkv, g * T)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]


# The compiled decode-attention kernel (kernels/attention.cpp) takes up to this many query rows per KV
# head (g*T: 21 tokens for SmolLM2's g = 3; more tokens, up to this many, take several calls), over any
# number of keys. (It once started at 1,024 keys, where attention alone was no faster than PyTorch's; but
# below that a forward also lost the one-call path through every layer: a 1-token forward over 256 keys
# took 8.4 ms instead of 3.0 on Zen 5, 5 tokens 11.6 instead of 4.4.)
KERNEL_MAX_ROWS = 64
KERNEL_HEAD_DIMS = (64, 128, 256)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None = None,
              ops=None) -> torch.Tensor:
    """q [B, Hq, T, D]; k, v [B, Hkv, S, D]; mask None, CAUSAL, a TokenBlock (the T new tokens are the last T
    keys, every older key visible to all) or [T, S] bool -> [B, Hq, T, D]. (k a
    caches.quantized.QuantizedKV instead: the quantized cache's attention, v and mask unused.)
    `ops`: the compiled kernels (the model's backend) or None for PyTorch's attention.

    k and v are the cache's (its dtype: fp32, bf16 or fp16; q keeps the model's). The kernel reads fp32
    k/v, and bf16 / fp16 k/v where it says it can (`ops.HALF_KV`); PyTorch's path casts k/v to q's dtype.
    Over a bf16 cache (fp32 q, CPU) attention takes bf16 x bf16 products on every path (`bf16_attention`), so
    that the kernel may run a verification on AMX tiles and still compute what `ar` computes.

    Scores are q . k * scale (None: D ** -0.5). Query head h uses KV head h // g (the transformers convention).
    """
    B, Hq, T, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    if isinstance(mask, SlotMask):  # a forward with fixed shapes (a CUDA graph)
        return slot_attention(q, k, v, mask, scale)
    if isinstance(k, QuantizedKV):  # a quantized cache: its planes and buffer, read by its own attention
        return k.attend(q, scale, ops if q.device.type == "cpu" else None)
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    if B == 1 and T <= KERNEL_MAX_ROWS and D in KERNEL_HEAD_DIMS and q.device.type == "cpu" \
            and (mask is None or isinstance(mask, (str, TokenBlock, WindowGap))) and ops is not None \
            and (k.dtype == torch.float32 or getattr(ops, "HALF_KV", False)):
        # a draft tree: the kernel's causal path with the block's own visibility; a StreamingLLM window: its gap
        window = mask if isinstance(mask, WindowGap) else None
        block = window.block if window is not None else mask if isinstance(mask, TokenBlock) else None
        extra = {"visible": block.visible.contiguous()} if block is not None else {}
        if window is not None:
            extra["gap"] = window.gap
        causal = mask is not None and T > 1
        if g * T <= KERNEL_MAX_ROWS:
            out = ops.decode_attention(q.reshape(Hkv, g * T, D), k[0], v[0], T, causal, scale, **extra)
        else:  # a large tree or chain: as many query heads of each group per call as fit (the K/V read again)
            n = KERNEL_MAX_ROWS // T
            qg = q.view(Hkv, g, T, D)
            out = torch.cat([ops.decode_attention(qg[:, j:j + n].reshape(Hkv, -1, D), k[0], v[0], T, causal, scale,
                                                  **extra).view(Hkv, -1, T, D) for j in range(0, g, n)], dim=1)
        return out.view(B, Hq, T, D)
    if isinstance(mask, WindowGap):  # PyTorch's attention takes the window as a bool mask
        mask = mask.dense
    if k.dtype == torch.bfloat16 and q.dtype == torch.float32 and q.device.type == "cpu":
        if isinstance(mask, str) and B == 1 and D in KERNEL_HEAD_DIMS and ops is not None \
                and getattr(ops, "bf16_dot_attention", lambda: False)():
            # a causal prefill over a bf16 cache, on AMX's tiles or AVX512-BF16's dot products: the kernel's
            # verification path, a few tokens at a time, each against the keys up to its own (an 8K prefill of the
            # embedded model on AMX: 13.4 s, against 36.7 s through bf16_attention and 15.8 s for an fp16 cache's
            # flash kernel)
            n = max(1, KERNEL_MAX_ROWS // g)
            return torch.cat([attention(q[:, :, t0:t0 + n], k[:, :, :S - T + min(T, t0 + n)],
                                        v[:, :, :S - T + min(T, t0 + n)], mask if min(n, T - t0) > 1 else None,
                                        scale, ops) for t0 in range(0, T, n)], dim=2)
        return bf16_attention(q, k, v, mask, scale)  # a bf16 cache's arithmetic, the kernel's on every path
    if k.dtype != q.dtype:  # a KV cache in another dtype: the visible keys only, in the activations' dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    if isinstance(mask, str) and q.device.type == "cpu" and _flash_cpu is not None and S > T:  # CAUSAL
        return _causal_block_attention(q, k, v, scale).view(B, Hq, T, D)
    mask = _dense_mask(mask, T, S, q.device)
    q = q.reshape(B, Hkv, g * T, D)
    if mask is not None and g > 1:
        mask = mask.repeat(g, 1)  # rows are (group head, token)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, T, D)  # CUDA's memory-efficient kernel returns a transposed layout


def _dense_mask(mask, T: int, S: int, device) -> torch.Tensor | None:
    """`attention`'s mask as None or [T, S] bool (True: new token t sees key j; the T new tokens are the last T keys)."""
    if isinstance(mask, TokenBlock):
        return mask.mask(S - T)
    if isinstance(mask, str):  # CAUSAL
        return causal_mask(T, S - T, device)
    return mask


LOG2E = 1.4426950408889634


def bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """A bf16 cache's attention (kernels/attention.cpp, run(), computes the same up to the order of its sums):
    q [B, Hq, T, D] fp32, k / v [B, Hkv, S, D] bf16, mask as `attention` takes it -> [B, Hq, T, D] fp32.

    Every product is bf16 x bf16, exact in fp32, as on AMX tiles: the scaled queries are rounded to bf16, and
    the probabilities too, taken in base 2 against an integer reference, p = 2^(s log2 e - M) with
    M = ceil(max s log2 e), so that their rounding does not depend on how the keys are cut into blocks (a
    block's p differ from these by an exact power of two). The normaliser l sums the unrounded p."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    mask = _dense_mask(mask, T, S, q.device)
    visible = None if mask is None else mask.repeat(g, 1)  # rows are (group head, token)
    qs = (q * scale).bfloat16().float().reshape(B, Hkv, g * T, D)
    out = torch.empty_like(qs)
    step = max(1, (1 << 22) // max(S, 1))  # rows per product: scores of at most 4M values at a time
    for b in range(B):
        for h in range(Hkv):
            kh, vh = k[b, h].float(), v[b, h].float()
            for r0 in range(0, g * T, step):
                s = qs[b, h, r0:r0 + step] @ kh.T
                if visible is not None:
                    s.masked_fill_(~visible[r0:r0 + step], float("-inf"))
                s2 = s * LOG2E
                p = torch.exp2(s2 - torch.ceil(s2.amax(-1, keepdim=True)))
                out[b, h, r0:r0 + step] = (p.bfloat16().float() @ vh) / p.sum(-1, keepdim=True)
    return out.view(B, Hq, T, D)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [N, R, D] @ k [N, S, D]^T -> fp32 [N, R, S], accumulated in fp32 whatever the inputs' dtype: on
    CUDA straight to fp32 (bmm's out_dtype, no fp32 copy of K), elsewhere through an fp32 product."""
    if q.dtype != torch.float32 and q.is_cuda:
        try:
            return torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without bmm's out_dtype
            pass
    return torch.bmm(q.float(), k.transpose(1, 2).float())


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SlotMask, scale: float) -> torch.Tensor:
    """Attention of a fixed-shape forward (a CUDA graph; caches/static.py): q [B, Hq, T, D]; k, v
    [B, Hkv, C, D], a cache layer's whole capacity C in q's dtype -> [B, Hq, T, D]. Nothing depends on
    how many slots are filled, so the same kernels replay at every length.

    With the CUDA kernel (mask.last): split-KV decoding that reads the keys up to the last visible slot
    only, each query row's arithmetic independent of the other rows (kernels/cuda_decode.py). Without:
    two batched matrix products over every slot under mask.bias (scores and softmax in fp32), whose cost
    is the capacity's."""
    B, Hq, T, D = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    g = Hq // Hkv
    if mask.last is not None:
        from .kernels import cuda_decode

        out = cuda_decode.decode_attention(q.reshape(Hkv, g * T, D), k[0], v[0], mask.last, scale,
                                           mask.block_m, mask.split)
        return out.view(B, Hq, T, D)
    qg = (q * scale).reshape(B * Hkv, g * T, D)  # rows (head in group, token): K is never repeated
    s = _scores(qg, k.reshape(B * Hkv, C, D)).view(B * Hkv, g, T, C) + mask.bias
    p = torch.softmax(s, dim=-1).to(v.dtype).view(B * Hkv, g * T, C)
    return torch.bmm(p, v.reshape(B * Hkv, C, D)).view(B, Hq, T, D)


def _kernel_weights(lin) -> tuple[list, list, list] | None:
    """A linear layer's weights as kernels/decode_layer.cpp takes them: the packed parts of a QuantLinear
    whose parts are all packed (linear_packed), or a Linear's panels ({panels}, {-1}, {out_features});
    None for anything else (those layers run the Python path)."""
    if isinstance(lin, QuantLinear) and lin.kernel_ready and all(lin.packed):
        return [lin._buffers[name] for name in lin._names], list(lin.types), list(lin.rows)
    if isinstance(lin, Linear) and lin.panels is not None:
        return [lin.panels], [-1], [lin.out_features]
    return None


class Block(nn.Module):
    backend: kernels.Backend = kernels.TORCH  # the model's, set by Transformer.select_backend

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.sliding = index in cfg.sliding_layers  # attends within cfg.sliding_window, with cfg.rope_local
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale, self.activation = cfg.attention_scale, cfg.activation
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wqkv = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)  # fused: one weight read
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # QK-norm (Qwen3, Gemma 3): RMSNorm over head_dim of every q and k head, before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Gemma's sandwich norms: on the attention and MLP outputs, before each residual add
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.w_gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x [B, T, hidden]; cos/sin [T, D] of this layer's RoPE -> [B, T, hidden]."""
        B, T, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(self.attn_norm(x))
        if self.q_norm is not None:
            qkv = self.qk_norm(qkv)
        if (ops := self.backend.ops) is not None:  # the same operations, fused (kernels/layer_ops.cpp)
            q, k, v = ops.rope_split(qkv, cos, sin, Hq, Hkv)
        else:
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = apply_rotary(q.view(B, T, Hq, D), cos, sin).transpose(1, 2)
            k = apply_rotary(k.view(B, T, Hkv, D), cos, sin).transpose(1, 2)
            v = v.view(B, T, Hkv, D).transpose(1, 2)
        keys, values, mask = cache.update(self.index, q, k, v)
        a = self.wo(attention(q, keys, values, mask, self.scale, ops).transpose(1, 2).reshape(B, T, Hq * D))
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = x + a
        m = self.w_down(self.gated(self.w_gate_up(self.mlp_norm(x)), ops))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return x + m

    def _fused(self, ops):
        """ops.LayerStack's arguments for this layer (Transformer._layer_stack) (norm weights and eps, each linear
        as the kernels take it), or None where this layer has something the fused call does not do (QK-norm,
        sandwich norms, GeGLU, a sliding window, a head dim without the attention kernel, a projection
        without the panel or integer kernel, biases but the qkv one). Cached per (ops, modules): a draft
        copy of the layer (Transformer.with_draft_weights) holds other modules."""
        key = (id(ops), id(self.wqkv), id(self.wo), id(self.w_gate_up), id(self.w_down))
        cached = self.__dict__.get("_fused_args")
        if cached is not None and cached[0] == key:
            return cached[1]
        args = None
        if (hasattr(ops, "decode_layers") and self.q_norm is None and self.post_attn_norm is None
                and self.post_mlp_norm is None and self.activation == "silu" and not self.sliding
                and self.head_dim in KERNEL_HEAD_DIMS
                and all(m.bias is None for m in (self.wo, self.w_gate_up, self.w_down))):
            specs = [_kernel_weights(m) for m in (self.wqkv, self.wo, self.w_gate_up, self.w_down)]
            if all(spec is not None for spec in specs):
                (qp, qt, qr), (op, ot, orow), (gp, gt, gr), (dp, dt, dr) = specs
                args = (self.attn_norm.weight, self.mlp_norm.weight, self.attn_norm.eps, qp, qt, qr, self.wqkv.bias,
                        op, ot, orow, gp, gt, gr, dp, dt, dr)
        self.__dict__["_fused_args"] = (key, args)
        return args

    def gated(self, gate_up: torch.Tensor, ops) -> torch.Tensor:
        """[..., 2F] (gate, up) -> act(gate) * up [..., F]: SwiGLU, or Gemma's GeGLU."""
        if self.activation == "silu" and ops is not None:
            return ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh" if self.activation == "gelu_tanh" else "none") * up

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [B, T, (Hq + 2 Hkv) D] -> the same with each q and k head RMS-normalised over D.
        Done on the fused projection so that RoPE, fused or not, follows unchanged."""
        B, T, _ = qkv.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = self.q_norm(q.reshape(B, T, Hq, D)).reshape(B, T, Hq * D)
        k = self.k_norm(k.reshape(B, T, Hkv, D)).reshape(B, T, Hkv * D)
        return torch.cat([q, k, v], dim=-1)


class Transformer(nn.Module):
    backend: kernels.Backend = kernels.TORCH  # chosen by select_backend (build_model, to())
    # On CUDA: the CUDA graphs of its decode-sized forwards (graphs.py), made by select_backend; None
    # elsewhere, or to run every forward eagerly (--no-cuda-graphs).
    graphs = None
    # Keep the target's full KV cache in pinned host memory, streamed to the GPU per layer (--offload-kv;
    # caches/offload.py); drafting caches stay on the GPU.
    offload_kv = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.windows = cfg.layer_windows  # what the KV cache must implement (KVCache.windows)
        self.init_rotary()

    def init_rotary(self) -> None:
        """RoPE frequencies (fp32, CPU): the global layers', and the sliding-window layers' own if any."""
        cfg = self.cfg
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_context)
        self.rotary_local = Rotary(cfg.rope_local, cfg.head_dim, cfg.max_context) if cfg.rope_local else None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (and the weights', unless they are kept quantized: QuantLinear)."""
        return self.norm.weight.dtype

    @property
    def quantized(self) -> bool:
        """Whether the weights are kept in GGML block formats (QuantLinear), not as fp32/bf16 tensors."""
        return isinstance(self.lm_head, QuantLinear)

    _kv_dtype: torch.dtype | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of this model's KV cache (new_cache): set it with a torch dtype or a name of
        config.KV_DTYPES ('fp32', 'bf16', 'fp16', 'int8': torch.int8, the quantized layout of
        caches/quantized.py); default (None): the weights' dtype. Only the stored K/V change: a model with
        another KV dtype is, exactly, another model (ar and every stack use it)."""
        return self._kv_dtype or self.dtype

    @kv_dtype.setter
    def kv_dtype(self, value) -> None:
        self._kv_dtype = None if value is None else kv_dtype(value)

    def _apply(self, fn, recurse=True):  # to(), cuda(), half(), ...: RoPE frequencies follow, the backend is re-chosen
        out = super()._apply(fn, recurse)
        for rotary in (out.rotary, out.rotary_local):
            if rotary is not None:
                rotary.inv_freq = rotary.inv_freq.to(out.device)
        if out.device.type != "meta":
            out.select_backend()
        return out

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: int | None = None,
                block: TokenBlock | None = None, hidden: bool = False, layers: tuple[int, ...] | None = None):
        """tokens [B, T] at positions cache.length .. cache.length + T - 1, a causal chain (or, with a
        TokenBlock, at positions cache.length + block.offsets, each seeing the tokens block.visible
        says: a draft tree) -> fp32 logits [B, T, V] (only the last `last` positions if given). The
        tokens are committed to the cache (a tree: until cache.keep() keeps its accepted path).
        `hidden`: -> (logits, features [B, T, hidden]), the final norm's output at every position (what
        the LM head reads; a trained draft head drafts from it, drafthead/). `layers` (with `hidden`): the
        features are instead the residual stream entering each of these layers (ascending; layer i's input is
        layer i - 1's output), concatenated [B, T, len(layers) * hidden]: what an EAGLE-3 head reads
        (drafthead/eagle.py). The layers then run one by one (the fused decode call gives no intermediates)."""
        if cache.windows != self.windows:
            raise TriforceError(f"{type(cache).__name__} does not implement the sliding-window layers of this "
                                f"{self.cfg.arch} model: use a SlidingWindowCache (any cache can hold its "
                                f"global layers)"
                                if self.windows is not None else
                                f"{type(cache).__name__} was made for a model with sliding-window layers")
        B, T = tokens.shape
        cache.prepare(T, block)
        positions = cache.length + (torch.arange(T, device=tokens.device) if block is None else block.offsets)
        rope = self.rotary.cos_sin(positions, self.dtype)
        rope_local = rope if self.rotary_local is None else self.rotary_local.cos_sin(positions, self.dtype)
        x = self._embed(tokens)
        taps = []
        if layers is None and (fused := self._decode_layers(x, rope, cache)) is not None:
            x = fused
        else:
            for i, layer in enumerate(self.layers):
                if layers is not None and i in layers:
                    taps.append(x)
                x = layer(x, *(rope_local if layer.sliding else rope), cache)
        cache.commit(T)
        if hidden:
            features = self.norm(x)
            logits = self._head_logits(features if last is None else features[:, -last:])
            return logits, (features if layers is None else torch.cat(taps, dim=-1))
        if last is not None:
            x = x[:, -last:]
        return self._logits(x)

    def _decode_layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache
                       ) -> torch.Tensor | None:
        """Every layer in one C++ call (kernels/decode_layer.cpp: the kernel path of Block.forward, bit for bit)
        for a decode-sized forward through a slot-causal cache, a quantized one or a StreamingLLM one (its window's
        gap) on CPU, where each layer has the fused form (Block._fused) and the attention kernel runs; None
        otherwise (the layers run one by one)."""
        ops = self.backend.ops
        B, T, _ = x.shape
        c = self.cfg
        g = c.n_heads // c.n_kv_heads
        if ops is None or T > PANEL_MAX_ROWS or B != 1 or x.dtype != torch.float32 or g * T > KERNEL_MAX_ROWS:
            return None
        quantized = isinstance(cache, QuantizedCache) and cache.batch == 1
        gap = None
        if quantized:  # its attention kernel takes any length (the buffer's keys by the per-row path)
            if not hasattr(ops, "decode_layers_quant") or x.device.type != "cpu":
                return None
        else:  # a slot-causal cache, or a StreamingLLM one less each token's gap (KVCache.fused_decode_slot)
            fused = cache.fused_decode_slot()
            if fused is None:
                return None
            slot, gap = fused
        stack = self._layer_stack(ops)
        if stack is None:
            return None
        record = getattr(cache, "queries", None) is not None
        if quantized:
            out = ops.decode_layers_quant(x, stack, *rope, c.n_heads, c.n_kv_heads, *cache.fused_inputs(g), record)
        else:
            window = {} if gap is None else {"gap": gap}  # (a slot-causal cache's call as it always was)
            out = ops.decode_layers(x, stack, *rope, c.n_heads, c.n_kv_heads, cache.k, cache.v, slot, record, **window)
        if record:  # as FullCache.update records them
            cache.queries[:] = out[1:]
        return out[0]

    def _layer_stack(self, ops):
        """ops.LayerStack of every layer's Block._fused arguments and attention scale, or None where a layer has
        none. Built once per (ops, layers): a draft copy (with_draft_weights) has its own layers; select_backend
        and pack_weights drop it."""
        cached = _LAYER_STACKS.get(self)
        if cached is not None and cached[0] is ops and cached[1] is self.layers:
            return cached[2]
        args = [block._fused(ops) for block in self.layers]
        stack = None
        if hasattr(ops, "LayerStack") and all(a is not None for a in args):
            stack = ops.LayerStack([(*a, b.head_dim ** -0.5 if b.scale is None else b.scale)
                                    for a, b in zip(args, self.layers)])
        _LAYER_STACKS[self] = (ops, self.layers, stack)
        return stack

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.cfg.scale_embeddings:  # as transformers: sqrt(hidden) as an fp32 tensor, cast to the dtype
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5).to(x.dtype)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm, the LM head and Gemma's softcap -> fp32 logits."""
        return self._head_logits(self.norm(x))

    def _head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The LM head and Gemma's softcap over the final norm's output -> fp32 logits."""
        logits = self.lm_head(features)
        if (cap := self.cfg.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def forward_static(self, tokens: torch.Tensor, positions: torch.Tensor, view: StaticView) -> torch.Tensor:
        """The forward with fixed shapes and no host synchronisation, for capture in a CUDA graph:
        tokens [B, T] at RoPE positions [T] (device tensors), stored at `view`'s slots of its cache,
        each token seeing the slots up to its own (view.prepare) -> fp32 logits [B, T, V]. The cache's
        Python-side length is not touched (the caller commits). Not for dynamic RoPE (its frequencies
        follow the length) or sliding-window models."""
        view.prepare()
        rope = self.rotary.cos_sin(positions, self.dtype)
        x = self._embed(tokens)
        for layer in self.layers:
            x = layer(x, *rope, view)
        return self._logits(x)

    def select_backend(self) -> None:
        """Choose, once, the operations every layer runs (kernels.Backend) for this model's device and
        dtype; called when the model is built and when it moves."""
        backend = kernels.Backend.for_model(self.device, self.dtype)
        _LAYER_STACKS.pop(self, None)
        self.graphs = None
        if self.device.type == "cuda":
            from .graphs import GraphedForwards

            self.graphs = GraphedForwards(self)
        for m in self.modules():
            if isinstance(m, Linear) and self.device.type != "cpu":  # CPU-only copies of the weights: dropped
                m.panels = m.packed = None
            if isinstance(m, (RMSNorm, Block)):
                m.backend = backend
            elif isinstance(m, (Linear, QuantLinear, QuantEmbedding)):  # matrix kernels: the CPU's only
                m.backend = backend if backend.enabled else kernels.TORCH
        self.backend = backend

    def pack_weights(self) -> None:
        """Pre-pack the linear layers' weights for decode and verification forwards on CPU (see Linear)."""
        _LAYER_STACKS.pop(self, None)  # the fused layers' arguments name the packed weights
        for block in self.layers:
            block.__dict__.pop("_fused_args", None)
        for m in self.modules():
            if isinstance(m, (Linear, QuantLinear)):
                m.pack()

    def with_draft_weights(self) -> Transformer:
        """This model with its linear layers' weights in bf16 (panel kernel, fp32 activations), sharing
        everything else (embedding, norms, the fp32 weights): half the weight bytes per forward, for
        draft levels whose output the fp32 model verifies. Returns self where the kernels are unavailable,
        and for weights kept quantized (already fewer bytes than bf16)."""
        if not self.backend.enabled or self.quantized:
            return self

        def lowp(lin: Linear) -> Linear:
            new = copy.copy(lin)  # shares the parameters; gets its own panels
            new.pack(torch.bfloat16)
            return new

        draft = copy.copy(self)
        draft._modules = dict(self._modules)
        layers = []
        for block in self.layers:
            b = copy.copy(block)
            b._modules = dict(block._modules)
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                b._modules[name] = lowp(block._modules[name])
            layers.append(b)
        draft._modules["layers"] = nn.ModuleList(layers)
        draft._modules["lm_head"] = lowp(self.lm_head)
        return draft

    def weights_to_bf16(self) -> None:
        """Hold every projection and the embedding as bf16 bytes (QuantLinear / QuantEmbedding of GGML
        type BF16, converted a few rows at a time), activations staying fp32: half of fp32's bytes."""
        from .quantized import to_bf16

        ops = self.backend.ops

        def bf16(weight) -> QuantTensor:
            if isinstance(weight, QuantTensor):
                return to_bf16(weight, ops)
            w = weight.detach().to(torch.bfloat16).contiguous()
            return QuantTensor(w.view(torch.uint8), BF16, tuple(w.shape))

        def bf16_linear(lin: Linear | QuantLinear) -> QuantLinear:
            parts = lin.parts if isinstance(lin, QuantLinear) else [lin.weight]
            return QuantLinear([bf16(p) for p in parts], None if lin.bias is None else lin.bias.detach())

        for block in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(block, name, bf16_linear(getattr(block, name)))
        table = bf16(self.embed.table if isinstance(self.embed, QuantEmbedding) else self.embed.weight)
        self.lm_head = QuantLinear([table]) if self.cfg.tie_word_embeddings else bf16_linear(self.lm_head)
        self.embed = QuantEmbedding(table)
        self.select_backend()

    def new_cache(self, capacity: int | None = None, *, record_queries: bool = False, batch: int = 1, dtype=None):
        """The full-attention cache of this model for `capacity` tokens: a FullCache, or with sliding-window
        layers a SlidingWindowCache (their keys in a ring of the window plus a few slots). Its dtype is
        `dtype` (a torch dtype or a name of config.KV_DTYPES; drafting caches) or the model's kv_dtype;
        int8: a QuantizedCache (8 bits, the newest tokens in an INT8_BUFFER_DTYPE buffer)."""
        from .caches import FullCache, QuantizedCache, SlidingWindowCache

        cfg = self.cfg
        dtype = self.kv_dtype if dtype is None else kv_dtype(dtype)
        if dtype == torch.int8:
            if self.windows is not None:
                raise TriforceError(f"--kv-dtype int8 is not supported for models with sliding-window layers "
                                    f"({cfg.arch}): use fp32, bf16 or fp16")
            return QuantizedCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity or cfg.max_context, bits=8,
                                  batch=batch, dtype=INT8_BUFFER_DTYPE, device=self.device,
                                  record_queries=record_queries)
        if self.offload_kv:
            from .caches.offload import OffloadedCache

            if self.windows is not None or self.device.type != "cuda":
                raise TriforceError("--offload-kv needs a CUDA device and a model without sliding-window layers")
            return OffloadedCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity or cfg.max_context,
                                  batch=batch, dtype=dtype, device=self.device, record_queries=record_queries)
        if self.graphs is not None:  # room for the padding rows of a graph forward (graphs.py)
            from .graphs import GRAPH_ROWS

            capacity = (capacity or cfg.max_context) + GRAPH_ROWS
        kw = dict(batch=batch, dtype=dtype, device=self.device, record_queries=record_queries)
        if self.windows is not None:
            return SlidingWindowCache(self.windows, cfg.n_kv_heads, cfg.head_dim, capacity or cfg.max_context, **kw)
        return FullCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity or cfg.max_context, **kw)


# Our block norms -> their Hugging Face names. Llama's post_attention_layernorm is the norm before the
# MLP, Gemma's the one on the attention output.
_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                   "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def hf_layout(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter -> the Hugging Face tensors it is made of, in order (fused projections: their
    parts concatenated along the outputs; q/k/v and gate/up)."""
    ours = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        ours["lm_head.weight"] = ["lm_head.weight"]
    norms = _SANDWICH_NORMS if cfg.sandwich_norms else _NORMS
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for name, hf_name in norms.items():
            ours[f"layers.{i}.{name}.weight"] = [p + hf_name + ".weight"]
        ours[f"layers.{i}.wqkv.weight"] = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        if cfg.qkv_bias:
            ours[f"layers.{i}.wqkv.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        ours[f"layers.{i}.wo.weight"] = [a + "o_proj.weight"]
        if cfg.qk_norm:
            ours[f"layers.{i}.q_norm.weight"] = [a + "q_norm.weight"]
            ours[f"layers.{i}.k_norm.weight"] = [a + "k_norm.weight"]
        ours[f"layers.{i}.w_gate_up.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        ours[f"layers.{i}.w_down.weight"] = [p + "mlp.down_proj.weight"]
    return ours


def load_hf_state_dict(model: Transformer, sd: dict[str, torch.Tensor | QuantTensor]) -> None:
    """Load a Hugging Face Llama-style (or Gemma 3) state dict, fusing q/k/v and gate/up projections.
    Norm weights get cfg.norm_weight_offset added in fp32 (Gemma's 1 + w).

    Weights given as QuantTensor (GGUF blocks kept as stored) become QuantLinear / QuantEmbedding
    modules holding those bytes; a fused projection with a part in plain fp32 is dequantized whole
    (no file we know of does that)."""
    cfg = model.cfg
    layout = hf_layout(cfg)
    quantized = {name: [sd[n] for n in names] for name, names in layout.items()
                 if all(isinstance(sd[n], QuantTensor) for n in names) and name.endswith("weight")
                 and not name.endswith("norm.weight")}
    ours: dict[str, torch.Tensor] = {}
    for name, names in layout.items():
        if name in quantized:
            continue
        parts = [dequantize(sd[n]) if isinstance(sd[n], QuantTensor) else sd[n] for n in names]
        ours[name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if cfg.norm_weight_offset:
        ours = {k: v.float() + cfg.norm_weight_offset if k.endswith("norm.weight") else v for k, v in ours.items()}
    for name, parts in quantized.items():
        owner_name = name.rsplit(".", 1)[0]
        parent, _, attr = owner_name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if owner_name == "embed":
            module = QuantEmbedding(parts[0])
        else:
            bias = ours.get(f"{owner_name}.bias")  # loaded below too (assign): a parameter of the module
            module = QuantLinear(parts, None if bias is None else bias.to(model.dtype))
        setattr(owner, attr, module)
    if cfg.tie_word_embeddings and "embed.weight" in quantized:
        model.lm_head = QuantLinear(quantized["embed.weight"])
    dtype = model.dtype
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in ours.items()}, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings and not model.quantized:
        model.lm_head.weight = model.embed.weight
