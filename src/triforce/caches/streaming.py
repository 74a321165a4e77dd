"""StreamingLLM cache: the first `sink` tokens plus a window of the most recent tokens.

Keys keep their absolute RoPE positions, so a forward through this cache equals full attention
under the mask "key j is visible to query i iff j < sink or i - window < j <= i". (StreamingLLM
re-numbers positions inside the cache to run past the trained context; our targets are run within
their context, where absolute positions are both valid and exactly testable.)

Layout per layer: [sink slots | region]. The region holds positions [start, length) contiguously.
When it would overflow, its newest `window + max_rollback` tokens are moved to its front (an
O(window) copy every `slack` tokens), so a rollback of up to `max_rollback` tokens keeps the exact
window semantics.

On the CPU kernels a forward's mask goes as a WindowGap (caches/base.py): the slots between the sinks and each
new token's window are hidden from it, which the attention kernel skips or masks, so chains take the one C++
call through every layer (execution.FusedDecode); PyTorch's attention gets the same mask dense. On a GPU a chain
replays a CUDA graph (execution/graphs.py) whose mask is the window in slots (SlotLayout.window).
"""
from __future__ import annotations

import torch

from ..errors import TriforceError
from .base import DenseKV, KVCache, SlotKV, SlotLayout, TokenBlock, WindowGap, kv_buffer


class StreamingCache(KVCache):
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, sink: int, window: int,
                 max_rollback: int = 64, slack: int | None = None, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if sink < 0 or window < 1:
            raise TriforceError(f"streaming cache needs sink >= 0 and window >= 1 (got sink={sink}, window={window})")
        self.sink, self.window, self.max_rollback = sink, window, max_rollback
        self.retained = window + max_rollback  # tokens kept past the sinks when the region is compacted
        self.slack = slack if slack is not None else max(window, 512)
        self.capacity = self.slots(sink, window, max_rollback, self.slack)
        shape = (n_layers, batch, n_kv_heads, self.capacity, head_dim)
        self.k = kv_buffer(shape, dtype, device, huge_pages=False)  # (a drafting cache: kv_buffer)
        self.v = kv_buffer(shape, dtype, device, huge_pages=False)
        self.pos = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
        self.n_layers, self.length, self.start = n_layers, 0, sink
        self.skipped_to = sink  # skip_to's position: the region's start until a compaction moves it
        # the prepared forward: its tree, and its window as a WindowGap (CPU), or else as a dense mask
        self._block: TokenBlock | None = None
        self._window: WindowGap | None = None
        self._dense: torch.Tensor | None = None
        self._write_slot = 0
        self._n_new = 0

    @staticmethod
    def slots(sink: int, window: int, max_rollback: int, slack: int) -> int:
        """The slots (K/V positions) a cache of these settings holds: the sinks, the window and the rollback
        it keeps, and the slack written past them before the region is compacted."""
        return sink + window + max_rollback + slack

    def _phys(self, position: int) -> int:
        return position if position < self.sink else self.sink + position - self.start

    def _compact(self) -> None:
        keep_from = max(self.start, self.length - self.retained)
        a, b = self._phys(keep_from), self._phys(self.length)
        n = b - a
        s = self.sink
        self.k[:, :, :, s:s + n] = self.k[:, :, :, a:b].clone()
        self.v[:, :, :, s:s + n] = self.v[:, :, :, a:b].clone()
        self.pos[s:s + n] = self.pos[a:b].clone()
        self.start = keep_from

    def prepare(self, n_new: int, block=None) -> None:
        if n_new > self.slack:
            raise ValueError(f"streaming cache takes at most {self.slack} tokens per forward, got {n_new}")
        if self._phys(self.length) + n_new > self.capacity:
            self._compact()
        slot = self._phys(self.length)
        end = slot + n_new
        offsets = torch.arange(n_new, device=self.pos.device) if block is None else block.offsets
        positions = self.length + offsets
        self.pos[slot:end] = positions
        keys = self.pos[:end][None, :]
        q = positions[:, None]
        visible = (keys >= 0) & (keys <= q) & ((keys < self.sink) | (keys > q - self.window))
        if block is not None:  # among the new tokens: only ancestors (positions alone do not say)
            visible[:, slot:end] &= block.visible
        self._block, self._window, self._dense = block, None, visible
        if self.pos.device.type == "cpu" and bool((keys >= 0).all()):
            # every slot below the new ones holds a position: the sinks, then the region from `start` on, so a
            # query at position p sees all but the region's positions up to p - window (its gap), in slots
            gap = torch.empty(n_new + 1, dtype=torch.long)
            gap[0] = self.sink
            gap[1:] = self.sink + (positions - self.window + 1 - self.start).clamp(min=0)
            self._window, self._dense = WindowGap(gap, visible), None
        self._write_slot, self._n_new = slot, n_new

    @property
    def slot_layout(self) -> SlotLayout | None:
        """On a GPU, fixed slots with the window (a CUDA graph's mask derives each token's window from its slot: the
        region is contiguous, so positions and slots differ by one offset); on the CPU, where a prepared forward with
        a WindowGap writes (its gap is known only once prepared); None otherwise."""
        if self.k.is_cuda:
            return SlotLayout(self.k, self.v, self._slot(self.length), chain=self._block is None, fixed=True,
                              window=self.window, sink=self.sink)
        if self._window is None:
            return None
        return SlotLayout(self.k, self.v, self._slot(self.length), gap=self._window.gap, chain=self._block is None)

    def update(self, layer, q, k, v):
        a, b = self._write_slot, self._write_slot + self._n_new
        self.k[layer, :, :, a:b] = k
        self.v[layer, :, :, a:b] = v
        if self._window is None:
            return DenseKV(self.k[layer, :, :, :b], self.v[layer, :, :, :b], self._dense)
        return SlotKV(self.k[layer, :, :, :b], self.v[layer, :, :, :b], self._block, self._window)

    def tail_needed(self) -> int:
        """Tokens at the end of a prompt that a prefill must feed (past the sinks, earlier ones may be
        skipped: skip_to): the window and the rollback depth."""
        return self.window + self.max_rollback

    def skip_to(self, position: int) -> None:
        """Continue at `position` without feeding the tokens in between (they fall outside the window
        anyway): a draft can read the sinks and the prompt's tail instead of the whole prompt. The
        keys it then stores differ from a full streaming prefill, which is harmless for a draft."""
        assert position >= self.length and position >= self.sink, (position, self.length)
        self.start = self.length = self.skipped_to = position

    def rollback(self, length: int) -> None:
        """Back to `length`: past the sinks, as far as the region's start, and, once a compaction dropped
        tokens, no farther than keeps every remaining token's window whole (max_rollback)."""
        assert 0 <= length <= self.length, (length, self.length)
        if self.start > self.sink and length < self.start or (
                self.start > self.skipped_to and length - self.window + 1 < self.start):
            raise ValueError(
                f"streaming cache cannot roll back {self.length - length} tokens (max_rollback={self.max_rollback})"
            )
        self.length = length

    def _slot(self, position: int) -> int:
        return self._phys(position)

    def _kept(self, start: int, slot: int, rows: torch.Tensor) -> None:
        self.pos[slot:slot + len(rows)] = torch.arange(start, start + len(rows), device=self.pos.device)
