"""The full KV cache: every token of the sequence, in order."""
from __future__ import annotations

import torch

from .base import (
    BufferPool,
    KVCache,
    QueryRecorder,
    SlotKV,
    SlotLayout,
    TokenBlock,
    check_capacity,
    kv_buffer,
)


class FullCache(KVCache):
    """Preallocated [n_layers, B, Hkv, capacity, D] keys and values.

    With `record_queries=True`, the post-RoPE queries of the last forward are kept (`recorder`) so that a
    retrieval cache can be (re)built from them.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *,
                 batch: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 record_queries: bool = False, pool: BufferPool | None = None):
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        self.pool = pool  # where the buffers come from, if kept ones of this shape are there, and go back to
        self.k = kv_buffer(shape, dtype, device, pool=pool)
        self.v = kv_buffer(shape, dtype, device, pool=pool)
        self.n_layers, self.capacity, self.length = n_layers, capacity, 0
        self.recorder = QueryRecorder(n_layers) if record_queries else None
        self._block: TokenBlock | None = None  # the prepared forward's tree (None: a chain, or one token)
        self._n_new = 0

    def release(self) -> None:
        """Give the buffers back to the pool they came from (the cache is unusable after this); without a pool,
        nothing (they are freed with the cache)."""
        if self.pool is not None and self.k is not None:
            k, v, self.k, self.v = self.k, self.v, None, None
            self.pool.give(k)
            self.pool.give(v)

    def prepare(self, n_new: int, block: TokenBlock | None = None) -> None:
        check_capacity(self.length + n_new, self.capacity, "the KV cache")
        self._n_new = n_new
        if self.recorder is not None:
            self.recorder.begin(self.length)
        self._block = block if n_new > 1 else None

    @property
    def slot_layout(self) -> SlotLayout:
        return SlotLayout(self.k, self.v, self.length, chain=self._block is None, fixed=True)

    def update(self, layer, q, k, v):
        start, end = self.length, self.length + self._n_new
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        if self.recorder is not None:
            self.recorder.record(layer, q)
        return SlotKV(self.k[layer, :, :, :end], self.v[layer, :, :, :end], self._block)

    def layer_kv(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, n, D] of positions 0 .. n - 1 of `layer` (views, as stored)."""
        return self.k[layer, :, :, :n], self.v[layer, :, :, :n]

    def read_positions(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of positions [lo, hi) of sequence 0, every layer: [layers, Hkv, hi - lo, D]
        each (what a serving prefix cache stores of a block)."""
        return self.k[:, 0, :, lo:hi].clone(), self.v[:, 0, :, lo:hi].clone()

    def write_positions(self, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [layers, Hkv, n, D] (read_positions') into positions lo .. lo + n - 1 of sequence 0;
        commit() then makes them part of the sequence."""
        n = k.shape[2]
        self.k[:, 0, :, lo:lo + n] = k
        self.v[:, 0, :, lo:lo + n] = v

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def _slot(self, position: int) -> int:
        return position

    def _kept(self, start: int, slot: int, rows: torch.Tensor) -> None:
        if self.recorder is not None:  # the retrieval build reads them
            self.recorder.keep(start, rows)
