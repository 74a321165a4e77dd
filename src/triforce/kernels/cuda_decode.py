"""Decode attention on CUDA (Triton): split-KV flash decoding whose rows do not depend on each other.

Why ours: speculative decoding is lossless only if the verifier scores a token exactly as `ar`
would. On a GPU a kernel's arithmetic order usually follows the problem's shape (cuBLAS and
PyTorch pick kernels by the number of rows), so a token verified among 5 would get other logits
than the same token decoded alone. Here a program always takes BLOCK_M query rows (the fixed row
count of every graph forward, padded) and keys in fixed split-sized ranges, so row r's result is
the same whatever the other rows hold or how many are real: masked keys contribute exactly 0 and
leave the running max alone.

    q [Hkv, R, D] (rows: query head in group, then token), k / v [Hkv, C, D] (a cache layer's whole
    capacity, one batch), last [R] int32 (the last slot row r sees; with a StreamingLLM window, the sink
    slots and those past last[r] - window) -> [Hkv, R, D] in q's dtype.

Only keys up to max(last) are read (not the capacity): the cost is the length's. Pass 1: one
program per (KV head, split) keeps an unnormalised output, its max and its sum per row; pass 2
combines the splits in order, one program per (KV head, COMBINE_ROWS rows). Scores and sums in fp32; P is rounded to V's dtype before P @ V, as
flash attention does.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: execution.slot_attention uses two matrix products instead
    triton = None

BLOCK_N = 64


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


# Launch settings (`python benchmarks/gpu_costs.py --kernel-sweep`, docs/gpu.md): programs per multiprocessor over
# all KV heads, warps per program, software-pipelining stages of the key loop, and WHOLE_WAVES: the splits per KV
# head rounded down, so that no multiprocessor gets one program more than the others (8 KV heads on 132
# multiprocessors: 16 splits, 128 programs, not 17 and 136). On an H200, 4 layers of 16 token rows at 128K: Llama-3-8B's
# 8 KV heads 0.539 ms against 0.674 with (1, 4, 3, rounded up) and a 0.507 ms floor; Llama-2-7B's 32 heads 1.907
# against 2.071, floor 2.027 (reads outrun the copy the floor is measured by); the best of 30 settings at 32K and
# 128K for both head counts.
PER_SM = 1
WARPS = 4
STAGES = 4
WHOLE_WAVES = True
COMBINE_ROWS = 16  # query rows per program of the combine pass


def split_size(capacity: int, n_kv_heads: int, n_sm: int = 132, per_sm: int | None = None,
               whole_waves: bool | None = None) -> int:
    """Keys per split for a cache of `capacity` slots: about `per_sm` programs per multiprocessor over all
    KV heads, in whole blocks (fixed per cache, so a row's arithmetic never changes with the length)."""
    programs = (per_sm or PER_SM) * n_sm
    down = WHOLE_WAVES if whole_waves is None else whole_waves
    splits = max(1, programs // n_kv_heads if down else -(-programs // n_kv_heads))
    size = -(-capacity // splits)
    return max(BLOCK_N, -(-size // BLOCK_N) * BLOCK_N)


if triton is not None:
    @triton.jit
    def _split_pass(Q, K, V, LAST, O, ML, R, scale,
                    sq_h, sq_r, sk_h, sk_c, sv_h, sv_c, so_h, so_s, sml_h, sml_s, split, window, sink,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                    IEEE: tl.constexpr):
        h = tl.program_id(0)
        s = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        live = rows < R
        q = tl.load(Q + h * sq_h + rows[:, None] * sq_r + dims[None, :], mask=live[:, None], other=0.0)
        last = tl.load(LAST + rows, mask=live, other=-1)
        n_keys = tl.max(last, axis=0) + 1
        start = s * split
        end = tl.minimum(start + split, n_keys)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            inside = cols < end
            k = tl.load(K + h * sk_h + cols[:, None] * sk_c + dims[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(V + h * sv_h + cols[:, None] * sv_c + dims[None, :], mask=inside[:, None], other=0.0)
            if IEEE:  # fp32 inputs: full fp32 products, not TF32
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            seen = (cols[None, :] <= last[:, None]) & ((cols[None, :] < sink) | (cols[None, :] > last[:, None] - window))
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        tl.store(O + h * so_h + s * so_s + rows[:, None] * D + dims[None, :], acc)
        tl.store(ML + h * sml_h + s * sml_s + rows, m_i)
        tl.store(ML + h * sml_h + s * sml_s + BLOCK_M + rows, l_i)

    @triton.jit
    def _combine_pass(O, ML, OUT, R, n_splits, so_h, so_s, sml_h, sml_s, sout_h, sout_r,
                      BLOCK_M: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr):
        h = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        dims = tl.arange(0, D)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for s in range(0, n_splits):
            m_s = tl.load(ML + h * sml_h + s * sml_s + rows)
            l_s = tl.load(ML + h * sml_h + s * sml_s + BLOCK_M + rows)
            a_s = tl.load(O + h * so_h + s * so_s + rows[:, None] * D + dims[None, :])
            m_new = tl.maximum(m, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            c_old = tl.exp(m - m_safe)
            c_s = tl.exp(m_s - m_safe)
            l = l * c_old + l_s * c_s
            acc = acc * c_old[:, None] + a_s * c_s[:, None]
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        live = rows < R
        tl.store(OUT + h * sout_h + rows[:, None] * sout_r + dims[None, :], out.to(OUT.dtype.element_ty),
                 mask=live[:, None])


def block_rows(rows: int) -> int:
    """The fixed row tile of a model's graph forwards (>= 16 for tl.dot)."""
    return max(16, triton.next_power_of_2(rows))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor, scale: float,
                     block_m: int, split: int, warps: int | None = None, stages: int | None = None,
                     window: int = 0, sink: int = 0) -> torch.Tensor:
    """See the module docstring. block_m >= R (block_rows), split a multiple of BLOCK_N (split_size). `window` > 0:
    a StreamingLLM window in slots: past the first `sink` slots, row r sees only the slots last[r] - window + 1 on."""
    Hkv, R, D = q.shape
    C = k.shape[1]
    if window <= 0:
        window, sink = C + 1, 0  # every slot up to last[r]
    assert R <= block_m and split % BLOCK_N == 0 and k.stride(2) == 1 and v.stride(2) == 1 and q.stride(2) == 1
    n_splits = -(-C // split)
    partial = torch.empty(Hkv, n_splits, block_m, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(Hkv, n_splits, 2 * block_m, dtype=torch.float32, device=q.device)
    out = torch.empty(Hkv, R, D, dtype=q.dtype, device=q.device)
    _split_pass[(Hkv, n_splits)](q, k, v, last, partial, ml, R, scale,
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 partial.stride(0), partial.stride(1), ml.stride(0), ml.stride(1), split, window,
                                 sink, BLOCK_M=block_m, BLOCK_N=BLOCK_N, D=D,
                                 IEEE=q.dtype == torch.float32, num_warps=warps or WARPS,
                                 num_stages=stages or STAGES)
    rows = min(COMBINE_ROWS, block_m)  # combine programs per KV head: block_m // rows (each row combines alone)
    _combine_pass[(Hkv, block_m // rows)](partial, ml, out, R, n_splits, partial.stride(0), partial.stride(1),
                                          ml.stride(0), ml.stride(1), out.stride(0), out.stride(1),
                                          BLOCK_M=block_m, ROWS=rows, D=D, num_warps=4)
    return out
