"""The KV cache of a model's own forwards: the one place that picks a concrete cache for a model's configuration,
KV dtype and device (drafting caches are picked by the speculation kinds, speculation/kinds.py)."""
from __future__ import annotations

import torch

from ..errors import TriforceError
from .base import BufferPool, kv_dtype
from .full import FullCache
from .offload import OffloadedCache
from .quantized import QuantizedCache
from .sliding import SlidingWindowCache
from .static import GRAPH_ROWS
from .streaming import StreamingCache

# The full-precision buffer of an int8 KV cache (its newest one or two groups of 64 tokens).
INT8_BUFFER_DTYPE = torch.float16


def new_cache(model, capacity: int | None = None, *, record_queries: bool = False, batch: int = 1, dtype=None,
              pool: BufferPool | None = None):
    """The full-attention cache of `model` (a Transformer) for `capacity` tokens: a FullCache, or with sliding-window
    layers a SlidingWindowCache (their keys in a ring of the window plus a few slots). Its dtype is `dtype` (a torch
    dtype or a name of config.KV_DTYPES; drafting caches) or the model's kv_dtype; int8: a QuantizedCache (8 bits,
    the newest tokens in an INT8_BUFFER_DTYPE buffer). `pool`: where a FullCache takes kept buffers of its shape
    from (and `release` gives them back to); the other caches allocate their own."""
    cfg = model.cfg
    dtype = model.kv_dtype if dtype is None else kv_dtype(dtype)
    if dtype == torch.int8:
        if model.windows is not None:
            raise TriforceError(f"--kv-dtype int8 is not supported for models with sliding-window layers "
                                f"({cfg.arch}): use fp32, bf16 or fp16")
        return QuantizedCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity or cfg.max_context, bits=8,
                              batch=batch, dtype=INT8_BUFFER_DTYPE, device=model.device,
                              record_queries=record_queries)
    if model.offload_kv:
        if model.windows is not None or model.device.type != "cuda":
            raise TriforceError("--offload-kv needs a CUDA device and a model without sliding-window layers")
        return OffloadedCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity or cfg.max_context,
                              batch=batch, dtype=dtype, device=model.device, record_queries=record_queries)
    if model.graphs is not None:  # room for the padding rows of a graph forward (execution/graphs.py)
        capacity = (capacity or cfg.max_context) + GRAPH_ROWS
    kw = dict(batch=batch, dtype=dtype, device=model.device, record_queries=record_queries)
    if model.windows is not None:
        return SlidingWindowCache(model.windows, cfg.n_kv_heads, cfg.head_dim, capacity or cfg.max_context, **kw)
    return FullCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity or cfg.max_context, pool=pool, **kw)


def new_window_cache(n_layers: int, n_kv_heads: int, head_dim: int, window: int, max_rollback: int, *,
                     dtype: torch.dtype, device) -> StreamingCache:
    """A cache of the newest `window` positions and no sinks, that rolls back up to `max_rollback` tokens (a draft
    head's own cache: drafthead/drafter.py)."""
    return StreamingCache(n_layers, n_kv_heads, head_dim, sink=0, window=window, max_rollback=max_rollback,
                          slack=window + max_rollback, dtype=dtype, device=device)


def new_plane_view(target: QuantizedCache, max_rollback: int) -> QuantizedCache:
    """A cache reading `target`'s (an int8 cache's) upper planes, shared, as 4 bits, with a full-precision buffer of
    its own: how kv4's level reads an int8 target (speculation/kinds.py builds that one through drafting_cache, in
    the drafting dtype); benchmarks/decode_step.py times a kv4 draft step through this one."""
    return QuantizedCache(target.n_layers, target.n_kv_heads, target.head_dim, target.capacity,
                          max_rollback=max_rollback, shared=target)
