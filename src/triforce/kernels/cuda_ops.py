"""A transformer layer's small operations on CUDA (Triton), one kernel each where PyTorch launches several.

A decode step on a GPU runs a few thousand kernels; inside a CUDA graph each still costs about two
microseconds, so PyTorch's RMSNorm (casts around the norm), RoPE (slices, a concatenation, products
and a sum per tensor) and SwiGLU (three kernels) cost more than the weights they touch. These are
the same operations as the CPU kernels' (kernels/layer_ops.cpp; same names and contracts, so
model.py calls them through the model's backend alike), each a single kernel with fp32 arithmetic,
one program per row: a row's result does not depend on the other rows (execution/graphs.py needs that).

    rms_norm(x [..., H], weight [H], eps) -> [..., H] in x's dtype
    rope_split(qkv [B, T, (Hq + 2 Hkv) D], cos, sin [T, D], Hq, Hkv) -> q [B, Hq, T, D], k, v [B, Hkv, T, D]
    silu_mul(gate_up [..., 2F]) -> silu(gate) * up [..., F]
"""
from __future__ import annotations

import torch

from ..rope import apply_rotary

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

HALF_KV = False  # (a CPU kernels attribute execution.attention reads; the CUDA decode attention is cuda_decode's)


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:
    @triton.jit
    def _rms_norm(X, W, Y, H, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < H
        x = tl.load(X + row * H + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        tl.store(Y + row * H + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _rope_split(QKV, COS, SIN, Q, K, V, T, HQ, HKV, HALF: tl.constexpr):
        bt = tl.program_id(0).to(tl.int64)  # b * T + t
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        b, t = bt // T, bt % T
        D = 2 * HALF
        i = tl.arange(0, HALF)
        src = QKV + bt * (HQ + 2 * HKV) * D + head * D
        x1 = tl.load(src + i).to(tl.float32)
        x2 = tl.load(src + HALF + i).to(tl.float32)
        if head < HQ + HKV:  # rotate: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
            c1 = tl.load(COS + t * D + i).to(tl.float32)
            c2 = tl.load(COS + t * D + HALF + i).to(tl.float32)
            s1 = tl.load(SIN + t * D + i).to(tl.float32)
            s2 = tl.load(SIN + t * D + HALF + i).to(tl.float32)
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        else:
            y1 = x1
            y2 = x2
        if head < HQ:
            dst = Q + ((b * HQ + head) * T + t) * D
        elif head < HQ + HKV:
            dst = K + ((b * HKV + head - HQ) * T + t) * D
        else:
            dst = V + ((b * HKV + head - HQ - HKV) * T + t) * D
        tl.store(dst + i, y1.to(Q.dtype.element_ty))
        tl.store(dst + HALF + i, y2.to(Q.dtype.element_ty))

    @triton.jit
    def _silu_mul(GU, Y, F, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < F
        g = tl.load(GU + row * 2 * F + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * F + F + cols, mask=inside, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(Y + row * F + cols, y.to(Y.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    H = x.shape[-1]
    y = torch.empty_like(x)
    _rms_norm[(x.numel() // H,)](x, weight, y, H, eps, BLOCK=triton.next_power_of_2(H), num_warps=4)
    return y


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int):
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    B, T, N = qkv.shape
    D = N // (n_heads + 2 * n_kv_heads)
    if D % 2 or (D // 2) & (D // 2 - 1):  # tl.arange needs a power of two: PyTorch's operations
        q, k, v = qkv.split([n_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)
        return (apply_rotary(q.view(B, T, n_heads, D), cos, sin).transpose(1, 2).contiguous(),
                apply_rotary(k.view(B, T, n_kv_heads, D), cos, sin).transpose(1, 2).contiguous(),
                v.view(B, T, n_kv_heads, D).transpose(1, 2).contiguous())
    q = torch.empty(B, n_heads, T, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(B, n_kv_heads, T, D, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    _rope_split[(B * T, n_heads + 2 * n_kv_heads)](qkv, cos, sin, q, k, v, T, n_heads, n_kv_heads, HALF=D // 2,
                                                   num_warps=1)
    return q, k, v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    F2 = gate_up.shape[-1]
    y = torch.empty(*gate_up.shape[:-1], F2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul[(gate_up.numel() // F2, triton.cdiv(F2 // 2, block))](gate_up, y, F2 // 2, BLOCK=block, num_warps=4)
    return y
