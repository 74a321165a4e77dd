"""The KV cache of a model with sliding-window layers (Gemma 3): every key of the global layers, a
bounded ring of keys for the sliding-window layers.

A sliding-window layer's query at position i sees the keys at positions (i - window, i] (transformers'
sliding_window_overlay), so before a forward such a layer needs only the last window - 1 keys. They
live in a ring of R = window - 1 + extra slots, position p in slot p % R; `pos[slot]` is the position a
slot holds (-1: none yet), the same for every sliding-window layer. A forward of T tokens at length L:

  * T <= extra (decode steps, verification of drafts): the new keys are written into the ring first,
    then the layer attends over the R slots under the mask "pos[s] in (i - window, i]". Since
    R >= window - 1 + T, the write overwrites no key that one of the T queries needs.
  * T > extra (prefill chunks): the layer attends over [the R slots; the T new keys] (slots holding a
    position >= L are left over from a rolled-back draft and masked), then the newest min(T, R) keys are
    written into the ring. The attention is over R + T keys, never the whole context.

Rollback only lowers `length` (O(1)): a left-over slot holds a position >= length, which the mask hides
until the sequence overwrites it. What cannot be undone is an overwrite: writing position x lost
position x - R. So a rollback may go down to a length whose window is still whole: any length >
high - extra, with `high` the highest position ever written (the largest value in `pos`), or any length
at all while no slot has been reused (high < R). `extra` thus bounds both the tokens of an in-place
forward and the depth of a rollback (a speculative draft and its verification).
"""
from __future__ import annotations

import torch

from ..errors import TriforceError
from .base import KVCache, kv_buffer
from .full import FullCache

# Slots beyond the window: forwards of up to this many tokens write in place, and rollbacks may go
# this deep below the highest position written (speculative decoding verifies and rolls back a few).
DEFAULT_EXTRA = 64


class SlidingWindowCache(KVCache):
    """`windows[layer]`: the layer's sliding window, or None for a global layer (all layers that slide
    share one window, as in Gemma 3). Global layers are kept in a FullCache of `capacity` tokens.

    With `record_queries=True`, the post-RoPE queries of the last forward are kept per layer, as
    FullCache does (`queries`, `query_start`)."""

    def __init__(self, windows: tuple[int | None, ...], n_kv_heads: int, head_dim: int, capacity: int, *,
                 extra: int = DEFAULT_EXTRA, batch: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", record_queries: bool = False):
        sizes = {w for w in windows if w is not None}
        if len(sizes) != 1 or min(sizes) < 1 or extra < 1:
            raise ValueError(f"a sliding-window cache needs one window >= 1 shared by its sliding layers and "
                             f"extra >= 1 (windows {windows}, extra {extra})")
        self.windows = tuple(windows)
        self.window, self.extra = sizes.pop(), extra
        self.ring_size = self.window - 1 + extra
        self.n_layers = len(windows)
        sliding = [i for i, w in enumerate(windows) if w is not None]
        full = [i for i, w in enumerate(windows) if w is None]
        self._ring_row = {layer: row for row, layer in enumerate(sliding)}
        self._full_row = {layer: row for row, layer in enumerate(full)}
        self.full = FullCache(len(full), n_kv_heads, head_dim, capacity, batch=batch, dtype=dtype, device=device)
        shape = (len(sliding), batch, n_kv_heads, self.ring_size, head_dim)
        self.k = kv_buffer(shape, dtype, device)
        self.v = kv_buffer(shape, dtype, device)
        self.pos = torch.full((self.ring_size,), -1, dtype=torch.long, device=device)
        self.high = -1  # the highest position ever written into the ring
        self.queries: list[torch.Tensor | None] | None = [None] * self.n_layers if record_queries else None
        self.query_start = 0
        self._mask: torch.Tensor | None = None  # the sliding layers' mask for this forward
        self._slots: torch.Tensor | None = None  # ring slots written by this forward
        self._write_from = 0  # the first of this forward's tokens written into the ring
        self._in_place = True

    @property
    def length(self) -> int:
        return self.full.length

    @property
    def capacity(self) -> int:
        return self.full.capacity

    def prepare(self, n_new: int, block=None) -> None:
        if block is not None:
            raise TriforceError("draft trees (token blocks) are not supported yet for models with sliding-window "
                                "layers: use chain drafts")
        L = self.length
        self.full.prepare(n_new)  # checks the capacity first: nothing below runs for a refused forward
        self.query_start = L
        R, window = self.ring_size, self.window
        new = torch.arange(L, L + n_new, device=self.pos.device)
        q = new[:, None]
        self._in_place = n_new <= self.extra
        if self._in_place:
            self._write_from = 0
            self.pos[new % R] = new
            keys = self.pos[None, :]
            self._mask = (keys >= 0) & (keys <= q) & (keys > q - window)
        else:
            old = self.pos[None, :]
            ring = (old >= 0) & (old < L) & (old > q - window)
            fresh = new[None, :]
            self._mask = torch.cat([ring, (fresh <= q) & (fresh > q - window)], dim=1)
            self._write_from = max(0, n_new - R)
            self.pos[new[self._write_from:] % R] = new[self._write_from:]
        self._slots = new[self._write_from:] % R
        self.high = max(self.high, L + n_new - 1)

    def update(self, layer, q, k, v):
        if self.queries is not None:
            self.queries[layer] = q
        row = self._ring_row.get(layer)
        if row is None:
            return self.full.update(self._full_row[layer], q, k, v)
        ring_k, ring_v = self.k[row], self.v[row]
        k, v = k.to(ring_k.dtype), v.to(ring_v.dtype)  # stored, and attended to, in the cache's dtype
        if self._in_place:
            ring_k[:, :, self._slots] = k
            ring_v[:, :, self._slots] = v
            return ring_k, ring_v, self._mask
        keys, values = torch.cat([ring_k, k], dim=2), torch.cat([ring_v, v], dim=2)
        ring_k[:, :, self._slots] = k[:, :, self._write_from:]
        ring_v[:, :, self._slots] = v[:, :, self._write_from:]
        return keys, values, self._mask

    def commit(self, n_new: int) -> None:
        self.full.commit(n_new)

    def min_rollback(self) -> int:
        """The lowest length `rollback` accepts now."""
        return 0 if self.high < self.ring_size else self.high - self.extra + 1

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        if length < self.min_rollback():
            raise ValueError(f"sliding-window cache cannot roll back to {length}: the ring (window {self.window} "
                             f"+ {self.extra} extra slots) keeps the window of lengths >= {self.min_rollback()} only")
        self.full.rollback(length)
