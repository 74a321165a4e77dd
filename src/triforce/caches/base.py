"""The KV-cache interface shared by every cache.

A forward pass over T new tokens calls, in order:
  `prepare(T, block)` once -> what every layer's new tokens see,
  `update(layer, q, k, v)` per layer -> what that layer attends over: one attention input (below),
  `commit(T)` once    -> the new tokens become part of the sequence.

The new tokens are a causal chain at positions length.. length + T - 1 (block None), or a
TokenBlock: a draft tree after the pending context tokens, each token at its own position (prefix +
depth) seeing only itself and its ancestors. After the tree is verified, `keep(start, rows)` keeps
the accepted root-to-leaf path as the sequence (compaction of the appended rows); for a chain that
is a prefix, i.e. `rollback`.

Attention inputs, the only thing a cache hands a layer (execution.attention dispatches on their type):
  SlotKV   keys and values in storage slots, the new tokens' last; every older slot visible to every new
           token but a StreamingLLM window's gap; the new tokens causal among themselves, or a tree's block
  DenseKV  keys and values with a [T, S] bool mask (a sliding-window ring; a window off the CPU)
  PlanesKV a quantized cache's planes, read by the cache's own attention (caches/quantized.py)
  StaticKV a fixed-shape forward's whole buffers and slot mask (a CUDA graph; caches/static.py)

A cache whose chains sit in slots says where (`slot_layout`): the CPU's one call through every layer
(execution/fused.py) and a CUDA graph (execution/graphs.py) write and read its buffers themselves.

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
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import KV_DTYPES, kv_dtype_name
from ..errors import TriforceError

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


class BufferPool:
    """Zeroed K/V buffers that finished caches gave back (`FullCache.release`), for the next cache of the same
    shape, dtype and device to take instead of new memory. Why: a server allocates a full cache per request, and
    first touching a new buffer's pages costs more than the request's whole start where the kernel compacts memory
    for huge pages (Intel Xeon VM, THP defrag "madvise": 194 MB of fp16 K/V for an 8K prompt took 357 ms with huge
    pages, 44 ms with 4 KB pages, about 20 ms to zero again once touched), and the server's batch waits for it.
    Buffers are zeroed when given back, so a taken buffer is what a new one would be. At most `limit` bytes are
    kept: a buffer given back beyond it is freed. Thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.bytes = 0  # held for reuse now
        self.hits = self.misses = 0

    @staticmethod
    def _key(shape, dtype: torch.dtype, device) -> tuple:
        return tuple(shape), dtype, torch.device(device)

    def take(self, shape, dtype: torch.dtype, device) -> torch.Tensor | None:
        """A kept buffer of exactly this shape, dtype and device (zeroed), or None."""
        with self._lock:
            free = self._free.get(self._key(shape, dtype, device))
            if not free:
                self.misses += 1
                return None
            t = free.pop()
            self.bytes -= _nbytes(t)
            self.hits += 1
            return t

    def give(self, t: torch.Tensor) -> None:
        """Keep `t` (no longer used by anything) for a later take, zeroed; or let it go, past the limit."""
        n = _nbytes(t)
        with self._lock:
            if self.bytes + n > self.limit:
                return
            self.bytes += n  # (reserved before zeroing outside the lock)
        with torch.inference_mode():  # (caches are made in inference mode: their buffers are inference tensors)
            t.zero_()
        with self._lock:
            self._free.setdefault(self._key(t.shape, t.dtype, t.device), []).append(t)

    def evict(self, nbytes: int) -> int:
        """Free kept buffers (the shape kept first, first) until at least `nbytes` are freed or none is left;
        -> bytes freed."""
        freed = 0
        with self._lock:
            while freed < nbytes and self.bytes > 0:
                key = next((k for k, v in self._free.items() if v), None)
                if key is None:
                    break
                t = self._free[key].pop(0)
                freed += _nbytes(t)
                self.bytes -= _nbytes(t)
        return freed


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kv_buffer(shape, dtype: torch.dtype, device, huge_pages: bool = True, pool: BufferPool | None = None
              ) -> torch.Tensor:
    """A zeroed K or V buffer: `pool`'s, where it keeps one of this shape, else a new one. On Linux, a new CPU
    buffer of a few MB or more asks for transparent huge pages (madvise(MADV_HUGEPAGE) before its pages are
    first touched: kernels' default THP mode is
    "madvise"): decode attention streams the whole cache, and with 4 KB pages 30 layers of fp16 K/V
    read 6-12% slower (8K: 12.0-12.9 -> 10.8 ms; 32K: 47-49 -> 44-45 ms, docs/performance.md).
    `huge_pages=False` for the drafting caches, built afresh for every generation and bounded by their
    budget: first touching huge pages can cost more than they return there (AMD Zen 5, a 4,096-token
    retrieval cache's 49 MB K: 43-51 ms with huge pages, 8.5 ms without; its attention 2.29 against 2.30 ms)."""
    kept = pool.take(shape, dtype, device) if pool is not None else None
    if kept is not None:
        return kept
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = _nbytes(t)
    if huge_pages and t.device.type == "cpu" and sys.platform == "linux" and nbytes >= 4 * _HUGE_PAGE:
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
    # The queries of the last forward, for the builds that select keys by them (None: not recorded)
    recorder: QueryRecorder | None = None
    # Whether attention reads quantized planes (int8, kv4): a forward of every layer in one call then takes them
    # from fused_inputs() (kernels' decode_layers_quant), not from a slot layout
    quantized_planes: bool = False

    def prepare(self, n_new: int, block: TokenBlock | None = None) -> None:
        raise NotImplementedError

    @property
    def slot_layout(self) -> SlotLayout | None:
        """Where this cache keeps a chain of new tokens (SlotLayout), or None where its forwards run only through
        update() (a ring, host buffers, quantized planes)."""
        return None

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> SlotKV | DenseKV | PlanesKV:
        """Store k, v [B, Hkv, T, D] for `layer`; return what the layer's T new tokens attend over.
        q [B, Hq, T, D] is passed for caches that select keys by query (it is not stored by default)."""
        raise NotImplementedError

    def commit(self, n_new: int) -> None:
        self.length += n_new

    def rollback(self, length: int) -> None:
        """Forget every token at position >= `length`."""
        raise NotImplementedError

    def release(self) -> None:
        """Done with the cache: give its buffers back to the BufferPool they came from (FullCache); for a cache
        that takes none from a pool, nothing (its buffers are freed with it)."""

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


class Buildable(Protocol):
    """A cache made from a full cache (kv4's 4-bit reading of a float cache; retrieval and H2O, Rebuildable)."""

    def build(self, full: KVCache) -> None:
        """Make this cache from `full` at its length (its recorder holding the queries of its last forward)."""


class Rebuildable(Buildable, Protocol):
    """A cache made from a full cache's keys and the queries it recorded (retrieval, H2O), made again as the
    sequence grows."""

    built_at: int  # the full cache's length at the last build

    def room(self, committed: int) -> int:
        """Slots left for tokens after `committed` (the owner rebuilds before they run out)."""


class Windowed(Protocol):
    """A cache that keeps only the newest tokens past its sinks (StreamingLLM): a prefill feeds the prompt's tail."""

    def tail_needed(self) -> int:
        """Tokens at the end of a prompt that a prefill must feed."""

    def skip_to(self, position: int) -> None:
        """Continue at `position` without feeding the tokens in between."""


class Checkpointable(Protocol):
    """A cache that a prefilled prompt returns to for each generation. Every KVCache is (its length, by default);
    a ring or an int8 buffer also saves what later writes overwrite."""

    def checkpoint(self): ...

    def restore(self, point) -> None: ...


class QueryRecorder:
    """The post-RoPE queries of a cache's last forward, per layer: `layers[i]` [B, Hq, T, D] for the positions
    `start` onwards (None for a layer not yet fed). A retrieval or H2O cache is built from them: they select the
    keys the next tokens will attend to most."""

    def __init__(self, n_layers: int):
        self.layers: list[torch.Tensor | None] = [None] * n_layers
        self.start = 0

    def begin(self, start: int) -> None:
        """A forward from position `start` on is about to record."""
        self.start = start

    def record(self, layer: int, q: torch.Tensor) -> None:
        self.layers[layer] = q

    def record_all(self, queries, start: int | None = None) -> None:
        """Every layer's at once (the one call through every layer, a CUDA graph), from `start` (default: begin's)."""
        self.layers[:] = queries
        if start is not None:
            self.start = start

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """After KVCache.keep: the kept rows of a forward from `start` (a verified tree's path), if it recorded."""
        if self.start == start:
            self.layers = [q[:, :, rows] if q is not None else None for q in self.layers]

    def last(self) -> list[torch.Tensor | None]:
        """Each layer's query of the last recorded position, [B, Hq, 1, D] (copies)."""
        return [q[:, :, -1:].clone() if q is not None else None for q in self.layers]


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
    """A StreamingLLM window in the form the compiled attention takes: the storage slots gap[0] .. gap[1 + t] - 1
    (gap [T + 1] int64 on the CPU: the first slot past the sinks, then each new token's first slot in its window)
    are hidden from new token t, every other older slot is visible. `dense` is the whole visibility as a [T, S]
    bool tensor (the new tokens' among themselves included), for PyTorch's attention."""

    gap: torch.Tensor
    dense: torch.Tensor


@dataclass(frozen=True)
class SlotKV:
    """What a layer attends over in a cache that keeps tokens in storage slots: keys, values [B, Hkv, S, D], the
    T new tokens in the last T slots. Every older slot is visible to every new token, but the slots a
    StreamingLLM `window` hides; the new tokens see each other causally (`block` None: a chain, and one token
    sees them all), or as a draft tree's `block.visible` says. The compiled attention kernel reads this form as
    it is."""

    keys: torch.Tensor
    values: torch.Tensor
    block: TokenBlock | None = None
    window: WindowGap | None = None

    def dense_mask(self) -> torch.Tensor | None:
        """The visibility as [T, S] bool (True: new token t sees key s), or None for a chain (causal_mask)."""
        if self.window is not None:
            return self.window.dense
        if self.block is not None:
            return self.block.mask(self.keys.shape[2] - self.block.visible.shape[0])
        return None


@dataclass(frozen=True)
class DenseKV:
    """What a layer attends over where visibility is given key by key: keys, values [B, Hkv, S, D] and mask
    [T, S] bool, True where new token t sees key s (a sliding-window ring; a StreamingLLM window off the CPU)."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


class PlanesKV:
    """What a layer attends over in a cache that stores K/V in its own quantized layout: only the cache reads it,
    so attention hands itself over (`attend`)."""

    def attend(self, q: torch.Tensor, scale: float, ops=None) -> torch.Tensor:
        """q [B, Hq, T, D] -> [B, Hq, T, D]; `ops` the compiled CPU kernels or None."""
        raise NotImplementedError


@dataclass(frozen=True)
class SlotLayout:
    """Where a cache keeps a chain of new tokens, for the forwards that write and read its buffers themselves: the
    CPU's one call through every layer (execution/fused.py) and a CUDA graph (execution/graphs.py).

    k, v: the buffers [layers, B, Hkv, slots, D].
    first: the slot of position `length` (the next token, or the prepared forward's first): a chain's tokens take
        the slots from there on, each seeing every older slot (but `gap`'s) and the new ones up to its own.
    gap: the prepared forward's StreamingLLM window (WindowGap.gap), or None.
    chain: the prepared forward is a chain, not a draft tree (the one call through every layer takes chains).
    fixed: visibility is causal over slots, whatever was prepared, in buffers that stay put: a CUDA graph captured
        once may replay through them; with `window`, past the `sink` slots a token at slot s sees only the slots
        from s - window + 1 on (a StreamingLLM window over a region kept contiguous in slots)."""

    k: torch.Tensor
    v: torch.Tensor
    first: int
    gap: torch.Tensor | None = None
    chain: bool = True
    fixed: bool = False
    window: int = 0
    sink: int = 0


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
