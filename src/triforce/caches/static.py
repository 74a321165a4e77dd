"""A cache's preallocated keys and values seen with fixed shapes, for forwards captured in CUDA graphs.

A graph replays the same kernels on the same addresses, so nothing in it may depend on Python-side
state such as the cache's length: the new tokens' storage slots arrive as a device tensor, every
slot of the capacity is attended to, and a [T, capacity] bias hides the slots a token may not see.
That needs caches whose visibility is causal over slots (`SlotLayout.fixed`): new token i sees every
slot up to and including its own, nothing after it. FullCache (slot = position) and RetrievalCache
(slot = selected count + tokens appended since the build) are, and so is a StreamingLLM cache's contiguous region
with its window given in slots (SlotMask.window); a draft tree, a ring or an int8 cache are not, and run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Token rows of every forward captured in a CUDA graph (execution/graphs.py): the real ones first, padding after.
# A cache that graphs write to keeps this many slots of room past its capacity for the padding rows.
GRAPH_ROWS = 16


@dataclass(frozen=True)
class SlotMask:
    """The mask of a fixed-shape forward (execution.slot_attention reads it): `last` [g*T] int32, the last
    slot each query row (query head in group, then token) sees, for the CUDA kernel
    (kernels/cuda_decode.py, with its row tile `block_m` and keys per split `split`); or, without it,
    `bias` [T, capacity] fp32, 0 where new token i sees slot j and -inf elsewhere. `window`, `sink`: a StreamingLLM
    window in slots (SlotLayout.window), in both forms."""

    last: torch.Tensor | None
    block_m: int
    split: int
    bias: torch.Tensor | None
    window: int = 0  # > 0: past the first `sink` slots, a row sees only the slots from last - window + 1 on
    sink: int = 0


@dataclass(frozen=True)
class StaticKV:
    """What a layer of a fixed-shape forward attends over: a cache layer's whole buffers [B, Hkv, capacity, D]
    in q's dtype and the SlotMask saying which slots each query row sees."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: SlotMask


class StaticView:
    """The KV-cache interface (update) over a cache's k / v buffers [layers, B, Hkv, capacity, D] for
    forwards of exactly T tokens whose storage slots are `slots` [T] (long, ascending, on the buffers'
    device, refilled by the caller before each replay). It holds the buffers, not the cache object (a
    graph must not keep a dead cache alive). With `record_queries` each layer's queries are copied to
    `queries[layer]` [B, Hq, T, D] (fixed buffers: the graph's caller hands them to the cache's QueryRecorder)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, n_heads: int, record_queries: bool,
                 window: int = 0, sink: int = 0):
        from ..kernels import cuda_decode  # optional: triton (the CUDA kernels), only on a GPU

        self.k, self.v, self.slots = k, v, slots
        self.window, self.sink = window, sink
        n_layers, B, n_kv_heads, capacity, D = k.shape
        T = slots.shape[0]
        self.groups = n_heads // n_kv_heads
        self.kernel = B == 1 and k.is_cuda and cuda_decode.available() and D in (64, 128, 256)
        if self.kernel:
            self.last = torch.zeros(self.groups * T, dtype=torch.int32, device=k.device)
            n_sm = torch.cuda.get_device_properties(k.device).multi_processor_count
            self.mask = SlotMask(self.last, cuda_decode.block_rows(self.groups * T),
                                 cuda_decode.split_size(capacity, n_kv_heads, n_sm), None, window, sink)
        else:
            self.key_slots = torch.arange(capacity, device=k.device)
            self.bias = torch.zeros(T, capacity, dtype=torch.float32, device=k.device)
            self.mask = SlotMask(None, 0, 0, self.bias, window, sink)
        self.queries = ([torch.zeros(B, n_heads, T, D, dtype=k.dtype, device=k.device) for _ in range(n_layers)]
                        if record_queries else None)

    def prepare(self) -> None:
        """Recompute the mask from `slots` (device work only)."""
        if self.kernel:
            self.last.copy_(self.slots.repeat(self.groups))
        else:
            hidden = self.key_slots[None, :] > self.slots[:, None]
            if self.window:
                hidden |= (self.key_slots[None, :] >= self.sink) & (
                    self.key_slots[None, :] <= self.slots[:, None] - self.window)
            self.bias.zero_().masked_fill_(hidden, float("-inf"))

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, Hkv, T, D] at the slots; -> the layer's whole K, V buffers and the SlotMask (StaticKV)."""
        keys, values = self.k[layer], self.v[layer]
        keys.index_copy_(2, self.slots, k.to(keys.dtype))
        values.index_copy_(2, self.slots, v.to(values.dtype))
        if self.queries is not None:
            self.queries[layer].copy_(q)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        return StaticKV(keys, values, self.mask)
