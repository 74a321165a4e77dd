"""The KV cache of a model with sliding-window layers (Gemma 3): the global layers' keys in a cache of
any kind (every key: a FullCache; or a drafting cache: retrieval, StreamingLLM), a bounded ring of keys
for the sliding-window layers.

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

The drafting levels of such a model (retrieval, streaming) act on the global layers only, which hold
the long-range context: their sliding-window layers see exactly the target's window, so a drafting
level differs from the target only where the target attends beyond the window.
"""
from __future__ import annotations

import torch

from ..errors import TriforceError
from .base import DenseKV, KVCache, kv_buffer
from .full import FullCache

# Slots beyond the window: forwards of up to this many tokens write in place, and rollbacks may go
# this deep below the highest position written (speculative decoding verifies and rolls back a few).
DEFAULT_EXTRA = 64


class SlidingWindowCache(KVCache):
    """`windows[layer]`: the layer's sliding window, or None for a global layer (all layers that slide
    share one window, as in Gemma 3). The global layers are kept in `global_cache` (its layer i is the
    model's i-th global layer), by default a FullCache of `capacity` tokens.

    With `record_queries=True` (default global cache only), the post-RoPE queries of the last forward
    are kept for the global layers, as FullCache does (`recorder.layers[i]` for the i-th global layer): what a
    retrieval cache is built from."""

    def __init__(self, windows: tuple[int | None, ...], n_kv_heads: int, head_dim: int, capacity: int | None = None,
                 *, global_cache: KVCache | None = None, extra: int = DEFAULT_EXTRA, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", record_queries: bool = False):
        sizes = {w for w in windows if w is not None}
        if len(sizes) != 1 or min(sizes) < 1 or extra < 1:
            raise ValueError(f"a sliding-window cache needs one window >= 1 shared by its sliding layers and "
                             f"extra >= 1 (windows {windows}, extra {extra})")
        self.windows = tuple(windows)
        self.window, self.extra = sizes.pop(), extra
        self.ring_size = self.window - 1 + extra
        self.n_layers = len(windows)
        sliding = [i for i, w in enumerate(windows) if w is not None]
        global_layers = [i for i, w in enumerate(windows) if w is None]
        self._ring_row = {layer: row for row, layer in enumerate(sliding)}
        self._global_row = {layer: row for row, layer in enumerate(global_layers)}
        if global_cache is None:
            global_cache = FullCache(len(global_layers), n_kv_heads, head_dim, capacity, batch=batch, dtype=dtype,
                                     device=device, record_queries=record_queries)
        elif global_cache.n_layers != len(global_layers):
            raise ValueError(f"the global cache has {global_cache.n_layers} layers, the model {len(global_layers)}")
        self.global_cache = global_cache
        shape = (len(sliding), batch, n_kv_heads, self.ring_size, head_dim)
        self.k = kv_buffer(shape, dtype, device)
        self.v = kv_buffer(shape, dtype, device)
        self.pos = torch.full((self.ring_size,), -1, dtype=torch.long, device=device)
        self.high = -1  # the highest position ever written into the ring
        self._mask: torch.Tensor | None = None  # the sliding layers' mask for this forward
        self._slots: torch.Tensor | None = None  # ring slots written by this forward
        self._write_from = 0  # the first of this forward's tokens written into the ring
        self._in_place = True

    @property
    def length(self) -> int:
        return self.global_cache.length

    @property
    def capacity(self) -> int:
        return self.global_cache.capacity

    @property
    def recorder(self):
        """The global layers' recorded queries (the global cache's): what a retrieval build reads."""
        return self.global_cache.recorder

    def release(self) -> None:
        """The global layers' cache gives its buffers back (KVCache.release); the ring is freed with this cache."""
        self.global_cache.release()

    def prepare(self, n_new: int, block=None) -> None:
        if block is not None:
            raise TriforceError("draft trees (token blocks) are not supported yet for models with sliding-window "
                                "layers: use chain drafts")
        L = self.length
        self.global_cache.prepare(n_new)  # checks the capacity first: nothing below runs for a refused forward
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
        row = self._ring_row.get(layer)
        if row is None:
            return self.global_cache.update(self._global_row[layer], q, k, v)
        ring_k, ring_v = self.k[row], self.v[row]
        k, v = k.to(ring_k.dtype), v.to(ring_v.dtype)  # stored, and attended to, in the cache's dtype
        if self._in_place:
            ring_k[:, :, self._slots] = k
            ring_v[:, :, self._slots] = v
            return DenseKV(ring_k, ring_v, self._mask)
        keys, values = torch.cat([ring_k, k], dim=2), torch.cat([ring_v, v], dim=2)
        ring_k[:, :, self._slots] = k[:, :, self._write_from:]
        ring_v[:, :, self._slots] = v[:, :, self._write_from:]
        return DenseKV(keys, values, self._mask)

    def commit(self, n_new: int) -> None:
        self.global_cache.commit(n_new)

    def min_rollback(self) -> int:
        """The lowest length `rollback` accepts now."""
        return 0 if self.high < self.ring_size else self.high - self.extra + 1

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        if length < self.min_rollback():
            raise ValueError(f"sliding-window cache cannot roll back to {length}: the ring (window {self.window} "
                             f"+ {self.extra} extra slots) keeps the window of lengths >= {self.min_rollback()} only")
        self.global_cache.rollback(length)

    def checkpoint(self):
        """The whole state (ring included: a later rollback this deep would be refused)."""
        return (self.global_cache.checkpoint(), self.k.clone(), self.v.clone(), self.pos.clone(), self.high)

    def restore(self, point) -> None:
        inner, k, v, pos, high = point
        self.k.copy_(k)
        self.v.copy_(v)
        self.pos.copy_(pos)
        self.high = high
        self.global_cache.restore(inner)

    # --- drafting caches over the global layers -------------------------------------------------------

    def build(self, full: SlidingWindowCache) -> None:
        """A retrieval level's (re)build from the target's cache: the global layers' retrieval cache from
        `full`'s global layers (RetrievalCache.build), and the sliding-window layers' ring copied (cast to
        this cache's dtype), so they see exactly what the target's see."""
        if full.ring_size != self.ring_size or full.windows != self.windows:
            raise ValueError(f"ring of {full.ring_size} slots (windows {full.windows}) cannot be copied into one of "
                             f"{self.ring_size} (windows {self.windows})")
        self.global_cache.build(full.global_cache)
        self.k.copy_(full.k)
        self.v.copy_(full.v)
        self.pos.copy_(full.pos)
        self.high = full.high

    @property
    def built_at(self) -> int:
        return self.global_cache.built_at

    def room(self, committed: int) -> int:
        return self.global_cache.room(committed)

    def tail_needed(self) -> int:
        """Tokens at the end of a prompt that a streaming level's prefill must feed: its global layers'
        window and the sliding window, each with the rollback depth."""
        return max(self.global_cache.tail_needed(), self.window - 1 + self.extra)

    def skip_to(self, position: int) -> None:
        """Continue at `position` without feeding the tokens in between (a streaming level's prefill):
        the ring's slots of earlier positions fall outside every later window."""
        self.global_cache.skip_to(position)
