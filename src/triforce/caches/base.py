"""The KV-cache interface shared by every cache.

A forward pass over T new tokens calls, in order:
  `prepare(T, block)` once -> the mask shared by all layers,
  `update(layer, q, k, v)` per layer -> the keys/values (and mask) that layer attends over,
  `commit(T)` once    -> the new tokens become part of the sequence.

The new tokens are a causal chain at positions length.. length + T - 1 (block None), or a
TokenBlock: a draft tree after the pending context tokens, each token at its own position (prefix +
depth) seeing only itself and its ancestors. After the tree is verified, `keep(start, rows)` keeps
the accepted root-to-leaf path as the sequence (compaction of the appended rows); for a chain that
is a prefix, i.e. `rollback`.

Keys are stored after RoPE at their absolute positions, so a cache may keep any subset of the
sequence, in any order. `length` is the logical sequence length (the absolute position of the next
token), whatever the cache physically keeps. All storage is preallocated; `rollback(n)` is O(1).

K/V are stored in the cache's dtype (fp32, bf16 or fp16: `kv_dtype`), cast when written; attention
reads the stored, rounded values, the new tokens' own included, so a forward's result does not depend
on how many tokens it feeds at once.
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import torch

from ..config import KV_DTYPES, kv_dtype_name
from ..errors import TriforceError

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def kv_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed K or V buffer. On Linux, a CPU buffer of a few MB or more asks for transparent huge
    pages (madvise(MADV_HUGEPAGE) before its pages are first touched: kernels' default THP mode is
    "madvise"): decode attention streams the whole cache, and with 4 KB pages 30 layers of fp16 K/V
    read 6-12% slower (8K: 12.0-12.9 -> 10.8 ms; 32K: 47-49 -> 44-45 ms, docs/performance.md)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cpu" and sys.platform == "linux" and nbytes >= 4 * _HUGE_PAGE:
        start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # the 2 MB-aligned interior
        end = (t.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        try:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc madvise: small pages, same results
            pass
    return t.zero_()

# torch.int8 stands for the int8 layout (caches/quantized.py): a model whose kv_dtype is int8 gets a QuantizedCache
_KV_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def kv_dtype(value, choices: tuple[str, ...] = KV_DTYPES) -> torch.dtype:
    """The torch dtype of a KV cache element type: 'fp32', 'bf16', 'fp16', 'int8' (config.KV_DTYPES; `choices`
    narrows them, e.g. to config.FLOAT_KV_DTYPES for a cache that stores K/V tensors), a torch dtype name or a
    torch dtype. Anything else: TriforceError naming the valid values."""
    return _KV_TORCH[kv_dtype_name(value, choices=choices)]


class KVCache:
    n_layers: int
    length: int
    # Per layer, the sliding window its attention is restricted to (None: the whole sequence), or None
    # for a cache that gives every layer full attention. Transformer.forward refuses a cache whose
    # windows are not its config's layer_windows: any other cache would silently attend to keys the
    # model never sees.
    windows: tuple[int | None, ...] | None = None
    # Whether new token i sees exactly the storage slots up to its own (`_slot` of its position) and its
    # buffers are self.k / self.v on the model's device: then a fixed-shape forward (a CUDA graph,
    # caches/static.py) may run through it.
    SLOT_CAUSAL = False
    # Whether the CPU's one call through every layer (execution.FusedDecode) may run a chain through it:
    # None, as SLOT_CAUSAL says; a cache whose forwards are slot-causal but which keeps CUDA graphs away for
    # another reason says True.
    FUSED_DECODE: bool | None = None
    # The mask of the forward prepare() set up, as update() returns it (caches that keep one).
    _mask: TokenBlock | WindowGap | str | torch.Tensor | None = None

    def prepare(self, n_new: int, block: TokenBlock | None = None) -> None:
        raise NotImplementedError

    def fused_decode_slot(self) -> tuple[int, torch.Tensor | None] | None:
        """How the CPU's one call through every layer (execution.FusedDecode, decode_layers in
        kernels/decode_layer.cpp) reads this cache for the forward prepare() set up: (the storage slot of the first
        new token, a StreamingLLM window's gap [T + 1] or None), or None where that call cannot (the layers then run
        one by one). It can where the new tokens see every older slot and each other causally, in a cache that says
        so (SLOT_CAUSAL, or FUSED_DECODE where set), or where a WindowGap (and no draft tree) says what each hides."""
        mask = self._mask
        if isinstance(mask, WindowGap):
            return (self._slot(self.length), mask.gap) if mask.block is None else None
        if not (self.SLOT_CAUSAL if self.FUSED_DECODE is None else self.FUSED_DECODE):
            return None
        if not (mask is None or isinstance(mask, str)):
            return None
        return self._slot(self.length), None

    def update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | TokenBlock | str | None]:
        """Store k, v [B, Hkv, T, D] for `layer`; return (K, V [B, Hkv, S, D], mask).

        mask: None (all keys visible), CAUSAL (see above), the TokenBlock itself (its tokens are the last
        T keys, every older key visible to all: the attention kernel takes its [T, T] visibility), or
        [T, S] bool, True where new token i may attend to key j.
        q [B, Hq, T, D] is passed for caches that select keys by query (it is not stored by default).
        """
        raise NotImplementedError

    def commit(self, n_new: int) -> None:
        self.length += n_new

    def rollback(self, length: int) -> None:
        """Forget every token at position >= `length`."""
        raise NotImplementedError

    def checkpoint(self):
        """A point `restore` returns to (a prefilled prompt reused by several generations); a cache
        whose rollback is bounded (a ring) saves what later writes overwrite."""
        return self.length

    def restore(self, point) -> None:
        self.rollback(point)

    def keep(self, start: int, rows: list[int]) -> None:
        """After a forward whose new tokens began at position `start`: keep new tokens `rows`
        (ascending indices into them, whose positions are start, start + 1, ...: a root-to-leaf path)
        as the sequence from `start` on, and forget the others. A prefix of the rows is a rollback
        (O(1)); other rows are moved down over the dropped ones, in caches with a `_slot` of their
        positions (self.k / self.v [layers, B, Hkv, slots, D])."""
        if rows == list(range(len(rows))):
            return self.rollback(start + len(rows))
        a = self._slot(start)
        idx = torch.tensor(rows, device=self.k.device)
        self.k[:, :, :, a:a + len(rows)] = self.k[:, :, :, a + idx]
        self.v[:, :, :, a:a + len(rows)] = self.v[:, :, :, a + idx]
        self._kept(start, a, idx)
        self.length = start + len(rows)

    def _slot(self, position: int) -> int:
        """The storage slot of a position written by the last forward (caches that support trees)."""
        raise TriforceError(f"{type(self).__name__} does not support draft trees (token blocks)")

    def _kept(self, start: int, slot: int, rows: torch.Tensor) -> None:
        """Bookkeeping of a cache after keep() moved `rows` of the last forward to `slot` onwards."""


@dataclass(frozen=True)
class TokenBlock:
    """New tokens that are not one causal chain: offsets [T] (long), each token's position minus the
    cache's length; visible [T, T] (bool), True where new token i attends to new token j (itself and
    its ancestors). Every token already in the cache stays visible to all of them."""

    offsets: torch.Tensor
    visible: torch.Tensor

    def mask(self, n_past: int) -> torch.Tensor:
        """[T, n_past + T] bool: all past keys, then the block's own visibility."""
        T = self.visible.shape[0]
        past = torch.ones(T, n_past, dtype=torch.bool, device=self.visible.device)
        return torch.cat([past, self.visible], dim=1)


@dataclass(frozen=True)
class WindowGap:
    """A StreamingLLM window's mask in the form the compiled attention takes (execution.attention): the storage slots
    gap[0] .. gap[1 + t] - 1 (gap [T + 1] int64 on the CPU: the first slot past the sinks, then each new token's
    first slot in its window) are hidden from new token t, every other older slot is visible, and the new tokens
    see each other causally (or as `block` says). `dense` is the same mask as a [T, S] bool tensor, for PyTorch's
    attention."""

    gap: torch.Tensor
    block: TokenBlock | None
    dense: torch.Tensor


# A mask marker: every key but the newest T is visible to all T new tokens, and the newest T keys
# (the new tokens themselves) are causal. Attention can then skip building and applying a [T, S] mask.
CAUSAL = "causal"


def causal_mask(n_new: int, n_past: int, device: torch.device) -> torch.Tensor:
    """[T, n_past + T] bool: new token i sees all past keys and new keys 0..i."""
    rows = torch.arange(n_new, device=device)[:, None]
    cols = torch.arange(n_past + n_new, device=device)[None, :]
    return cols <= rows + n_past


def check_capacity(needed: int, capacity: int, what: str) -> None:
    if needed > capacity:
        raise TriforceError(
            f"{what} holds {capacity} tokens but {needed} are needed: raise --max-context "
            f"(or shorten the prompt / --max-new-tokens)"
        )
