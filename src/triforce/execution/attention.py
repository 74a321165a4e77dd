"""Attention over what a KV cache hands a layer (caches/base.py, `update`): the compiled decode-attention kernel
where it runs (a decode step, a verification, a draft tree, a StreamingLLM window), a bf16 cache's own arithmetic,
PyTorch's flash and SDPA kernels otherwise, a quantized cache's planes, and a fixed-shape forward's slot attention
(a CUDA graph). Which path a call takes decides its arithmetic order, and greedy identity with plain decoding rests
on that order (docs/performance.md, "What greedy identity rests on"): keep each path's conditions as they are."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..caches.base import DenseKV, PlanesKV, SlotKV, causal_mask
from ..caches.static import SlotMask, StaticKV
from ..kernels.capabilities import HEAD_DIMS as KERNEL_HEAD_DIMS, capabilities


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _causal_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention over a chain of T new tokens (the last T keys, causal; every older key visible), split in two
    and merged by log-sum-exp: the g*T folded query rows against the past keys with no mask, and each query head
    against the T new keys with is_causal. Building and applying a [g*T, S] mask made long prefill chunks about 1.7x slower.
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
# number of keys: even where attention alone is no faster than PyTorch's (under about 1K keys), taking it keeps
# a forward on the one call through every layer (a 1-token forward over 256 keys: 3.0 ms against 8.4 on Zen 5).
KERNEL_MAX_ROWS = 64


def attention(q: torch.Tensor, kv: SlotKV | DenseKV | PlanesKV | StaticKV, scale: float | None = None,
              ops=None) -> torch.Tensor:
    """q [B, Hq, T, D] over what the cache handed the layer (caches/base.py: its type alone picks the path)
    -> [B, Hq, T, D]. `ops`: the compiled kernels (the model's backend) or None for PyTorch's attention.

    K and V are the cache's (its dtype: fp32, bf16 or fp16; q keeps the model's). The kernel reads fp32
    K/V, and bf16 / fp16 K/V where it says it can (Capabilities.half_kv); PyTorch's path casts them to q's dtype.
    Over a bf16 cache (fp32 q, CPU) attention takes bf16 x bf16 products on every path (`bf16_attention`), so
    that the kernel may run a verification on AMX tiles and still compute what `ar` computes.

    Scores are q . k * scale (None: D ** -0.5). Query head h uses KV head h // g (the transformers convention).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if isinstance(kv, StaticKV):  # a forward with fixed shapes (a CUDA graph)
        return slot_attention(q, kv.keys, kv.values, kv.mask, scale)
    if isinstance(kv, PlanesKV):  # a quantized cache: its planes and buffer, read by its own attention
        return kv.attend(q, scale, ops if q.device.type == "cpu" else None)
    if isinstance(kv, SlotKV):
        if _kernel_reads(q, kv.keys, ops):
            return _kernel_attention(q, kv, scale, ops)
        chain = kv.window is None and kv.block is None and q.shape[2] > 1
        if chain and _kernel_chains(q, kv.keys, ops):
            return _kernel_chain(q, kv, scale, ops)
        return _torch_attention(q, kv.keys, kv.values, kv.dense_mask(), chain, scale, ops)
    return _torch_attention(q, kv.keys, kv.values, kv.mask, False, scale, ops)


def _kernel_reads(q: torch.Tensor, k: torch.Tensor, ops) -> bool:
    """Whether the compiled decode-attention kernel takes this SlotKV's query."""
    B, _, T, D = q.shape
    return (B == 1 and T <= KERNEL_MAX_ROWS and D in KERNEL_HEAD_DIMS and q.device.type == "cpu" and ops is not None
            and (k.dtype == torch.float32 or capabilities(ops).half_kv))


def _kernel_attention(q: torch.Tensor, kv: SlotKV, scale: float, ops) -> torch.Tensor:
    """The kernel over slots: a chain on its causal path, a draft tree with the block's own visibility, a
    StreamingLLM window less its gap, KERNEL_MAX_ROWS query rows per KV head a call."""
    B, Hq, T, D = q.shape
    k, v = kv.keys, kv.values
    Hkv = k.shape[1]
    g = Hq // Hkv
    extra = {"visible": kv.block.visible.contiguous()} if kv.block is not None else {}
    if kv.window is not None:
        extra["gap"] = kv.window.gap
    causal = T > 1
    if g * T <= KERNEL_MAX_ROWS:
        out = ops.decode_attention(q.reshape(Hkv, g * T, D), k[0], v[0], T, causal, scale, **extra)
    else:  # a large tree or chain: as many query heads of each group per call as fit (the K/V read again)
        n = KERNEL_MAX_ROWS // T
        qg = q.view(Hkv, g, T, D)
        out = torch.cat([ops.decode_attention(qg[:, j:j + n].reshape(Hkv, -1, D), k[0], v[0], T, causal, scale,
                                              **extra).view(Hkv, -1, T, D) for j in range(0, g, n)], dim=1)
    return out.view(B, Hq, T, D)


def _kernel_chains(q: torch.Tensor, k: torch.Tensor, ops) -> bool:
    """Whether a causal chain longer than the kernel takes in one call (a prefill chunk) runs through it anyway
    (_kernel_chain): over a bf16 cache on AMX's tiles or AVX512-BF16's dot products, where it is the fastest path (an
    8K prefill of the embedded model on AMX: 13.4 s, against 36.7 s through bf16_attention and 15.8 s for an fp16
    cache's flash kernel). Elsewhere PyTorch's flash kernel is faster: on AMD Zen 3's AVX2 build, fp16 cache, a 4K
    prefill on one thread took 17% more CPU time through the kernel (docs/performance.md, "Prefill")."""
    return (k.dtype == torch.bfloat16 and q.dtype == torch.float32 and _kernel_reads(q[:, :, :1], k, ops)
            and capabilities(ops).bf16_dot_attention)


def _kernel_chain(q: torch.Tensor, kv: SlotKV, scale: float, ops) -> torch.Tensor:
    """A causal chain longer than the kernel takes in one call: attention_chain_rows // g tokens per call (64 // g,
    or 256 // g where the kernel runs a bf16 cache on dot products at every row count), each against the keys up to
    its own last token. Each row then gets the decode step's bits (the kernel's path 0 sums a row in the same order
    whatever rows come with it), so a prompt's cache does not depend on how its prefill was chunked. Each call reads
    the keys again: at 64 rows a call that was as much reading as arithmetic for a 32K prompt on Zen 5."""
    B, Hq, T, D = q.shape
    rows = capabilities(ops).attention_chain_rows
    # all the calls in one parallel region (at 2K, a call's 3 heads x 1-8 blocks split unevenly over the threads),
    # each writing its rows where the output projection reads them: [T, Hq, D], returned as [B, Hq, T, D]
    out = ops.chain_attention(q[0], kv.keys[0], kv.values[0], scale, rows)
    return out.view(B, T, Hq, D).transpose(1, 2)


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, chain: bool,
                     scale: float, ops) -> torch.Tensor:
    """PyTorch's attention (and a bf16 cache's arithmetic): k, v [B, Hkv, S, D] under mask [T, S] bool or None
    (every key visible), or, `chain`, the T new tokens (the last T keys) causal and every older key visible,
    which needs no [T, S] mask."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    if k.dtype == torch.bfloat16 and q.dtype == torch.float32 and q.device.type == "cpu":
        # a bf16 cache's arithmetic, the kernel's on every path (a chain on dot products went to _kernel_chain)
        return bf16_attention(q, k, v, causal_mask(T, S - T, q.device) if chain else mask, scale)
    if k.dtype != q.dtype:  # a KV cache in another dtype: the visible keys only, in the activations' dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    if chain and q.device.type == "cpu" and _flash_cpu is not None and S > T:
        return _causal_block_attention(q, k, v, scale).view(B, Hq, T, D)
    if chain:
        mask = causal_mask(T, S - T, q.device)
    q = q.reshape(B, Hkv, g * T, D)
    if mask is not None and g > 1:
        mask = mask.repeat(g, 1)  # rows are (group head, token)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, T, D)  # CUDA's memory-efficient kernel returns a transposed layout


LOG2E = 1.4426950408889634


def bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """A bf16 cache's attention (kernels/attention.cpp, run(), computes the same up to the order of its sums):
    q [B, Hq, T, D] fp32, k / v [B, Hkv, S, D] bf16, mask [T, S] bool or None (every key) -> [B, Hq, T, D] fp32.

    Every product is bf16 x bf16, exact in fp32, as on AMX tiles: the scaled queries are rounded to bf16, and
    the probabilities too, taken in base 2 against an integer reference, p = 2^(s log2 e - M) with
    M = ceil(max s log2 e), so that their rounding does not depend on how the keys are cut into blocks (a
    block's p differ from these by an exact power of two). The normaliser l sums the unrounded p."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
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
        from ..kernels import cuda_decode  # optional: triton (the CUDA kernels), only on a GPU

        out = cuda_decode.decode_attention(q.reshape(Hkv, g * T, D), k[0], v[0], mask.last, scale,
                                           mask.block_m, mask.split, window=mask.window, sink=mask.sink)
        return out.view(B, Hq, T, D)
    qg = (q * scale).reshape(B * Hkv, g * T, D)  # rows (head in group, token): K is never repeated
    s = _scores(qg, k.reshape(B * Hkv, C, D)).view(B * Hkv, g, T, C) + mask.bias
    p = torch.softmax(s, dim=-1).to(v.dtype).view(B * Hkv, g * T, C)
    return torch.bmm(p, v.reshape(B * Hkv, C, D)).view(B, Hq, T, D)
