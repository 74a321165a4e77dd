"""Caches holding random keys and values as if a prompt had been prefilled: forwards timed at a context length
without the prefill (benchmarks/decode_step.py, benchmarks/gpu_costs.py). The values are unit normal; only the
layout matters."""
from __future__ import annotations

import torch

from .base import KVCache
from .offload import OffloadedCache
from .quant_codes import GROUP_K, fp_from
from .quantized import QuantizedCache
from .sliding import SlidingWindowCache


def fill_random(cache: KVCache, n_ctx: int) -> None:
    """Make a new cache made by caches.new_cache hold n_ctx random tokens, at that length: a FullCache's first n_ctx
    slots; a SlidingWindowCache's global layers and its ring, full of the last positions; an int8 cache's planes
    (random codes, scales and zeros) for the positions a query at n_ctx reads from them, and its buffer for the
    rest; an offloaded cache's host layers, made on the GPU a layer at a time."""
    if isinstance(cache, QuantizedCache):
        for plane in (cache.k_hi, cache.v_hi, cache.k_lo, cache.v_lo):
            plane.random_(0, 256)
        for scale, zero in ((cache.k_scale, cache.k_zero), (cache.v_scale, cache.v_zero)):
            scale.uniform_(0.001, 0.05)
            zero.normal_()
        a = fp_from(n_ctx)
        cache.quantized_groups, cache.buffer_start = a // GROUP_K, a
        cache.buffer_k.normal_()
        cache.buffer_v.normal_()
        cache.length = n_ctx
        return
    if isinstance(cache, SlidingWindowCache):
        ring = min(n_ctx, cache.ring_size)
        positions = torch.arange(n_ctx - ring, n_ctx, device=cache.pos.device)
        cache.pos[positions % cache.ring_size] = positions
        cache.k.normal_()
        cache.v.normal_()
        cache.high = n_ctx - 1
        fill_random(cache.global_cache, n_ctx)
        return
    if isinstance(cache, OffloadedCache):
        for layer in range(cache.n_layers):
            for buf in (cache.k, cache.v):
                part = buf[layer][:n_ctx]
                part.copy_(torch.randn(part.shape, device=cache.device, dtype=part.dtype))
    else:
        cache.k[:, :, :, :n_ctx].normal_()
        cache.v[:, :, :, :n_ctx].normal_()
    cache.length = n_ctx
