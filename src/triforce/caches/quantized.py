"""A quantized KV cache (KIVI grouping, QuantSpec's hierarchical INT8 planes, full-precision recent tokens).

Codes: the groups, the 8-bit code and its two 4-bit planes (quant_codes.py).

Arithmetic (`QuantizedKV.attend`, the same in kernels/attention.cpp): integer dot products on the codes. Per
group of 64 keys and query row, the scaled query times the group's key scales is rounded to 15 bits in two int8
parts against its largest element (qg ~ a (iq1 + iq2 / 254)), so a score is
a / 254 ((254 iq1 + iq2) . (code - 128)) + q . (zero + 128 scale) with the dot products exact in integers; the probabilities times the values' per-token scales, per group of 64 keys and 32
channels, are rounded to int16 against their largest (p' ~ sigma * p16, p16 <= 32767), so p v is
sigma * (p16 . code) + p . zero, again exact in integers. (As llama.cpp quantizes activations to 8 bits
for its quantized caches; the perplexity cost is in docs/quantized_kv.md.)

Which tokens are read quantized. A query at position p reads the keys and values of positions
< fp_from(p) = 64 * max(0, p // 64 - 1) from the planes and positions fp_from(p) .. p in full precision:
the newest group being filled and the one before stay in a full-precision buffer (the double buffer).
The rule depends on positions only, so a forward's result does not depend on how many tokens are fed at
once, nor on rollbacks: a cache built token by token, in chunks or with rejected drafts holds the same
codes. A group is quantized when the first query that reads it quantized is fed (64 tokens after its
end), so with rollbacks shorter than a group no rejected token is ever quantized; a longer rollback
forgets the groups it reaches (O(1)) and they are quantized again from the buffer when next needed.

Storage per layer: the planes [B, Hkv, capacity, D / 2] (uint8; a group's 64 rows hold its bytes in the
kernel's order, below), key scales and zeros [B, Hkv, groups, D], value scales and zeros [B, Hkv, capacity,
D / 32] (fp16; within each group of 64 rows stored channel group by channel group, [D / 32, 64]; a head dim
below 32: one group per head), and a full-precision buffer [B, Hkv, slots, D]
holding positions buffer_start .. length - 1 (a multiple of 64; `dtype`: fp32, bf16 or fp16), whose old groups are
dropped when it fills (after quantizing them): it holds the newest 128 + max_rollback tokens plus one
forward's. Rollback within max_rollback is O(1): an integer and a group count. Attention (`QuantizedKV`)
reads the planes tile by tile, TILE tokens at a time (never the whole cache), or in the compiled kernel.
"""
from __future__ import annotations

import torch

from ..errors import TriforceError
from ..kernels.capabilities import HEAD_DIMS as KERNEL_HEAD_DIMS, capabilities
from .base import (
    KVCache,
    PlanesKV,
    QueryRecorder,
    TokenBlock,
    check_capacity,
    kv_buffer,
)
from .quant_codes import (
    GROUP_K,
    GROUP_V,
    by_group,
    codes_of,
    fp_from,
    fp_from_tensor,
    pack_keys,
    pack_values,
    quantize,
    unpack_keys,
    unpack_values,
)

TILE = 1024  # tokens dequantized at a time by the PyTorch attention (a multiple of GROUP_K)
KERNEL_MAX_ROWS = 64  # the rows kernels.quant_attention takes (g * T)
TINY = 2.0 ** -100  # a row's largest |q scale| or p v-scale below this: rounded to 0 (1 / it must stay finite)


class QuantizedCache(KVCache):
    """Keys and values of every position, quantized as the module docstring says. `bits` 8 (both planes:
    the target's cache, --kv-dtype int8) or 4 (the upper plane only: a kv4 level's own cache over a target
    with a float cache). `dtype`: the full-precision buffer's. `max_rollback`: the furthest rollback below
    `length` the cache must allow (the buffer keeps what such a rollback needs). With `record_queries=True`
    the last forward's post-RoPE queries are kept (`recorder`), as FullCache keeps them (retrieval builds).

    `shared`: an int8 QuantizedCache (the target's) whose upper planes, scales and zeros this cache reads instead
    of planes of its own (a kv4 level over an int8 target: no second copy of the cache). It then never
    quantizes: a query at p reads positions < min(fp_from(p), what `shared` has quantized) from the shared
    planes and the rest from its own buffer, which keeps every position `shared` has not quantized yet (the
    draft's boundary depends on the target's progress; exactness does not, the target verifies)."""

    quantized_planes = True  # (fused_inputs)

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *, bits: int = 8,
                 max_rollback: int = 256, batch: int = 1, dtype: torch.dtype = torch.float16,
                 device: torch.device | str = "cpu", record_queries: bool = False,
                 shared: QuantizedCache | None = None):
        if shared is not None:
            if shared.shared is not None or shared.k_lo is None or (n_layers, n_kv_heads, head_dim, batch) != (
                    shared.n_layers, shared.n_kv_heads, shared.head_dim, shared.batch):
                raise TriforceError("a cache can only share the planes of an int8 QuantizedCache of its own shape")
            bits, capacity = 4, shared.capacity
        if bits not in (4, 8):
            raise TriforceError(f"a quantized KV cache has 4 or 8 bits, got {bits}")
        self.group_v = min(GROUP_V, head_dim)  # a head dim below GROUP_V (tiny test models): one group per head
        if head_dim % self.group_v or head_dim % 2:
            raise TriforceError(f"a quantized KV cache needs a head dim that is a multiple of {GROUP_V} (or an even "
                                f"divisor of it), got {head_dim}")
        self.n_layers, self.capacity, self.bits, self.max_rollback = n_layers, capacity, bits, max_rollback
        self.n_kv_heads, self.head_dim, self.batch, self.dtype = n_kv_heads, head_dim, batch, dtype
        self.shared = shared
        groups = -(-capacity // GROUP_K)
        tokens = groups * GROUP_K
        plane = (n_layers, batch, n_kv_heads, tokens, head_dim // 2)
        vs = (n_layers, batch, n_kv_heads, tokens, head_dim // self.group_v)
        if shared is not None:  # the same tensors: written by the target's forwards only
            self.k_hi, self.v_hi, self.k_lo, self.v_lo = shared.k_hi, shared.v_hi, None, None
            self.k_scale, self.k_zero, self.v_scale, self.v_zero = (shared.k_scale, shared.k_zero, shared.v_scale,
                                                                    shared.v_zero)
        else:
            self.k_hi, self.v_hi = kv_buffer(plane, torch.uint8, device), kv_buffer(plane, torch.uint8, device)
            self.k_lo = kv_buffer(plane, torch.uint8, device) if bits == 8 else None
            self.v_lo = kv_buffer(plane, torch.uint8, device) if bits == 8 else None
            self.k_scale = kv_buffer((n_layers, batch, n_kv_heads, groups, head_dim), torch.float16, device)
            self.k_zero = kv_buffer((n_layers, batch, n_kv_heads, groups, head_dim), torch.float16, device)
            self.v_scale, self.v_zero = kv_buffer(vs, torch.float16, device), kv_buffer(vs, torch.float16, device)
        self.length = 0
        self.quantized_groups = 0  # positions [0, quantized_groups * GROUP_K) are in the planes
        self.buffer_start = 0  # the buffer holds positions buffer_start .. length - 1 (a multiple of GROUP_K)
        self.buffer_k = self.buffer_v = None
        self._grow(2 * GROUP_K + max_rollback + GROUP_K)
        self.recorder = QueryRecorder(n_layers) if record_queries else None
        self._n_new = 0
        self._groups_target = 0
        self._qb: torch.Tensor | None = None  # per new token: fp_from(its position)
        self._fp_mask: torch.Tensor | None = None  # [T, length + T - buffer_start]: buffer keys each new token reads

    @property
    def device(self) -> torch.device:
        return self.k_hi.device

    # --- the full-precision buffer ---------------------------------------------------------------------

    def _grow(self, slots: int) -> None:
        """A buffer of `slots` positions holding the current ones. Made as normal tensors even inside a forward
        (inference mode): rollback, keep and restore update them in place outside one."""
        shape = (self.n_layers, self.batch, self.n_kv_heads, slots, self.head_dim)
        with torch.inference_mode(False):
            fk, fv = kv_buffer(shape, self.dtype, self.device), kv_buffer(shape, self.dtype, self.device)
        if self.buffer_k is not None:
            n = self.length - self.buffer_start
            fk[:, :, :, :n], fv[:, :, :, :n] = self.buffer_k[:, :, :, :n], self.buffer_v[:, :, :, :n]
        self.buffer_k, self.buffer_v = fk, fv

    def _advance(self, start: int) -> None:
        """Drop buffer positions below `start` (a multiple of GROUP_K), quantizing them first if needed (sharing
        planes: only positions the shared cache has quantized)."""
        if self.shared is not None:
            start = min(start, self.shared.quantized_groups * GROUP_K)
        if start <= self.buffer_start:
            return
        self._quantize(range(self.n_layers), start // GROUP_K)
        self.quantized_groups = max(self.quantized_groups, start // GROUP_K)
        n, d = self.length - start, start - self.buffer_start
        self.buffer_k[:, :, :, :n] = self.buffer_k[:, :, :, d:d + n].clone()
        self.buffer_v[:, :, :, :n] = self.buffer_v[:, :, :, d:d + n].clone()
        self.buffer_start = start

    def _quantize(self, layers, upto: int) -> None:
        """Quantize groups quantized_groups .. upto - 1 of `layers` from the buffer (their positions must be in it)."""
        g0 = self.quantized_groups
        if upto <= g0 or self.shared is not None:
            return
        assert g0 * GROUP_K >= self.buffer_start, (g0, self.buffer_start)
        a, b = g0 * GROUP_K, upto * GROUP_K
        for layer in layers:
            self.store(layer, a, self.buffer_k[layer, :, :, a - self.buffer_start:b - self.buffer_start], self.buffer_v[layer, :, :, a - self.buffer_start:b - self.buffer_start])

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole groups of keys and values k, v [B, Hkv, n, D] (n a multiple of GROUP_K) of positions
        start .. start + n - 1 (start a multiple of GROUP_K) into the planes of `layer`."""
        B, H, n, D = k.shape
        g0, ng = start // GROUP_K, n // GROUP_K
        codes, scale, zero = quantize(k.reshape(B, H, ng, GROUP_K, D).transpose(-1, -2))  # per group and channel
        self.k_scale[layer, :, :, g0:g0 + ng], self.k_zero[layer, :, :, g0:g0 + ng] = scale, zero
        vc, vs, vz = quantize(v.reshape(B, H, n, D // self.group_v, self.group_v))  # per token and group of channels
        self.v_scale[layer, :, :, start:start + n] = by_group(vs)
        self.v_zero[layer, :, :, start:start + n] = by_group(vz)
        kc, vc = codes.transpose(-1, -2), vc.reshape(B, H, n, D)  # [B, H, ng, 64, D], [B, H, n, D]
        for pack, c, hi, lo in ((pack_keys, kc, self.k_hi, self.k_lo), (pack_values, vc, self.v_hi, self.v_lo)):
            hi[layer, :, :, start:start + n] = pack(c >> 4).reshape(B, H, n, D // 2)
            if lo is not None:
                lo[layer, :, :, start:start + n] = pack(c & 15).reshape(B, H, n, D // 2)

    # --- the KVCache contract ---------------------------------------------------------------------------

    def prepare(self, n_new: int, block: TokenBlock | None = None) -> None:
        check_capacity(self.length + n_new, self.capacity, "the KV cache")
        L, dev = self.length, self.device
        if L + n_new - self.buffer_start > self.buffer_k.shape[3]:
            self._advance(max(self.buffer_start, fp_from(max(0, L - self.max_rollback))))
            if L + n_new - self.buffer_start > self.buffer_k.shape[3]:
                self._grow(L + n_new - self.buffer_start + GROUP_K)
        offsets = torch.arange(n_new, device=dev) if block is None else block.offsets
        positions = L + offsets
        last = L + n_new - 1 if block is None else L + int(offsets.max())
        self._groups_target = max(self.quantized_groups, fp_from(last) // GROUP_K)
        if block is not None:  # groups quantized now must be chain tokens (slot = position): trees shallower than a group
            k = self._groups_target * GROUP_K - L
            if k > 0 and not torch.equal(offsets[:k].cpu(), torch.arange(k)):
                raise TriforceError(f"a draft tree reaches {GROUP_K} tokens past a quantization group: "
                                    f"use trees shallower than {GROUP_K}")
        qb = fp_from_tensor(positions)
        if self.shared is not None:  # the shared planes as far as the target has quantized, then the buffer
            avail = self.shared.quantized_groups * GROUP_K
            if avail < self.buffer_start:
                raise TriforceError(f"the int8 cache shared by a kv4 level was rolled back below position {self.buffer_start}, "
                                    f"which the level no longer holds: keep rollbacks within {GROUP_K} tokens")
            qb = qb.clamp(max=avail)
            self._groups_target = min(self._groups_target, self.shared.quantized_groups)
        old = torch.arange(self.buffer_start, L, device=dev)
        key_pos = torch.cat([old, positions])
        visible = key_pos[None, :] >= qb[:, None]
        new = (torch.ones(n_new, n_new, dtype=torch.bool, device=dev).tril() if block is None else block.visible)
        visible[:, L - self.buffer_start:] &= new
        self._qb, self._fp_mask, self._n_new = qb, visible, n_new
        if self.recorder is not None:
            self.recorder.begin(L)

    def update(self, layer, q, k, v):
        """Store k, v [B, Hkv, T, D] in the buffer, quantize the groups this forward's queries read from the
        planes; -> QuantizedKV: execution.attention hands the attention to it."""
        a = self.length - self.buffer_start
        self.buffer_k[layer, :, :, a:a + self._n_new] = k
        self.buffer_v[layer, :, :, a:a + self._n_new] = v
        self._quantize((layer,), self._groups_target)
        if self.recorder is not None:
            self.recorder.record(layer, q)
        return QuantizedKV(self, layer)

    def fused_inputs(self, g: int) -> tuple:
        """For a forward of every layer in one call (execution.FusedDecode: kernels' decode_layers_quant), after
        prepare: the groups its queries read quantized, quantized now for every layer (they were all fed by
        earlier forwards: a forward of at most 64 tokens reads none of its own from the planes), and the
        arguments that call takes from the cache (g: query heads per KV head)."""
        self._quantize(range(self.n_layers), self._groups_target)
        none = torch.empty(0, dtype=torch.uint8)
        planes = [self.k_hi, self.k_lo if self.k_lo is not None else none, self.k_scale, self.k_zero,
                  self.v_hi, self.v_lo if self.v_lo is not None else none, self.v_scale, self.v_zero]
        return (planes, int(self._qb.max()), self._qb.repeat(g), self.buffer_k, self.buffer_v, self.length - self.buffer_start,
                self._fp_mask)

    def commit(self, n_new: int) -> None:
        self.length += n_new
        self.quantized_groups = self._groups_target

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        if length < self.length and fp_from(length) < self.buffer_start:
            raise ValueError(f"quantized KV cache cannot roll back {self.length - length} tokens "
                             f"(max_rollback={self.max_rollback})")
        self.quantized_groups = min(self.quantized_groups, length // GROUP_K)
        self.length = length

    def _slot(self, position: int) -> int:
        raise AssertionError("unused: QuantizedCache.keep moves its buffer rows itself")

    def keep(self, start: int, rows: list[int]) -> None:
        if rows == list(range(len(rows))):
            return self.rollback(start + len(rows))
        a = start - self.buffer_start
        idx = torch.tensor(rows, device=self.device)
        self.buffer_k[:, :, :, a:a + len(rows)] = self.buffer_k[:, :, :, a + idx]
        self.buffer_v[:, :, :, a:a + len(rows)] = self.buffer_v[:, :, :, a + idx]
        if self.recorder is not None:
            self.recorder.keep(start, idx)
        self.length = start + len(rows)

    def build(self, full) -> None:
        """Start over as the quantization of the first `full.length` tokens of `full` (a FullCache; its K/V
        are cast when read): positions < fp_from(full.length) into the planes, TILE tokens at a time, the rest
        into the buffer. A kv4 level starts from the target's prompt this way instead of a prefill of its own.
        Sharing planes, `full` is the shared cache: its buffer is copied, its planes are already ours."""
        n = full.length
        if self.shared is not None:
            assert full is self.shared
            if n - full.buffer_start > self.buffer_k.shape[3]:
                self._grow(n - full.buffer_start + GROUP_K)
            self.buffer_k[:, :, :, :n - full.buffer_start] = full.buffer_k[:, :, :, :n - full.buffer_start]
            self.buffer_v[:, :, :, :n - full.buffer_start] = full.buffer_v[:, :, :, :n - full.buffer_start]
            self.length, self.quantized_groups, self.buffer_start = n, full.quantized_groups, full.buffer_start
            return
        a = fp_from(n)
        check_capacity(n, self.capacity, "the quantized KV cache")
        self.length = self.quantized_groups = self.buffer_start = 0
        if n - a > self.buffer_k.shape[3]:
            self._grow(n - a + GROUP_K)
        for layer in range(self.n_layers):
            for t0 in range(0, a, TILE):
                t1 = min(a, t0 + TILE)
                self.store(layer, t0, full.k[layer, :, :, t0:t1], full.v[layer, :, :, t0:t1])
        self.buffer_k[:, :, :, :n - a] = full.k[:, :, :, a:n]
        self.buffer_v[:, :, :, :n - a] = full.v[:, :, :, a:n]
        self.length, self.quantized_groups, self.buffer_start = n, a // GROUP_K, a

    def checkpoint(self) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
        """The cache as it is now, to come back to with restore after any number of tokens (a prompt
        reused by several generations): the counters and a copy of the buffer (the planes of groups quantized
        by then are never rewritten by later tokens)."""
        n = self.length - self.buffer_start
        return (self.length, self.quantized_groups, self.buffer_start, self.buffer_k[:, :, :, :n].clone(),
                self.buffer_v[:, :, :, :n].clone())

    def restore(self, mark) -> None:
        length, groups, start, buffer_k, buffer_v = mark
        assert self.shared is None and self.quantized_groups >= groups, "a reset may not go where groups were forgotten"
        n = buffer_k.shape[3]
        self.buffer_k[:, :, :, :n], self.buffer_v[:, :, :, :n] = buffer_k, buffer_v
        self.length, self.quantized_groups, self.buffer_start = length, groups, start

    # --- reading ----------------------------------------------------------------------------------------

    def group_codes(self, layer: int, start: int, end: int, four_bit: bool = False):
        """The codes of quantized positions start .. end - 1 (multiples of GROUP_K, end <= quantized_groups * GROUP_K) of
        `layer`, G = (end - start) / 64 groups, as fp32 on the 8-bit scale (the 8-bit reading, or the upper
        planes' with four_bit): keys [B, H, G, 64, D] with their scales and zeros [B, H, G, D], values
        [B, H, G, 64, D] with theirs [B, H, G, D / 32, 64]."""
        B, H, D = self.batch, self.n_kv_heads, self.head_dim
        g0, g1, nb = start // GROUP_K, end // GROUP_K, D // self.group_v
        lo_k = None if four_bit or self.k_lo is None else unpack_keys(self.k_lo[layer, :, :, start:end])
        lo_v = None if four_bit or self.v_lo is None else unpack_values(self.v_lo[layer, :, :, start:end])
        kc = codes_of(unpack_keys(self.k_hi[layer, :, :, start:end]), lo_k)
        vc = codes_of(unpack_values(self.v_hi[layer, :, :, start:end]), lo_v).view(B, H, g1 - g0, GROUP_K, D)

        def by_group(x):  # value scales [B, H, n, nb] as stored -> [B, H, G, nb, 64]
            return x[layer, :, :, start:end].float().view(B, H, g1 - g0, nb, GROUP_K)

        return (kc, self.k_scale[layer, :, :, g0:g1].float(), self.k_zero[layer, :, :, g0:g1].float(),
                vc, by_group(self.v_scale), by_group(self.v_zero))

    def dequantized(self, layer: int, start: int, end: int, four_bit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, end - start, D] fp32 of quantized positions start .. end - 1 (multiples of
        GROUP_K, end <= quantized_groups * GROUP_K) of `layer`: the 8-bit reading, or the upper planes' with four_bit."""
        B, H, D = self.batch, self.n_kv_heads, self.head_dim
        n, gv = end - start, self.group_v
        kc, ks, kz, vc, vs, vz = self.group_codes(layer, start, end, four_bit)
        k = kc * ks[:, :, :, None] + kz[:, :, :, None]
        G = n // GROUP_K
        v = (vc.view(B, H, G, GROUP_K, D // gv, gv) * vs.transpose(-1, -2)[..., None]
             + vz.transpose(-1, -2)[..., None])
        return k.reshape(B, H, n, D), v.reshape(B, H, n, D)

    def layer_kv(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. n - 1 of `layer` [B, Hkv, n, D] fp32, as attention reads them from
        position n (planes below fp_from(n), the buffer above): one layer at a time, for retrieval builds."""
        q_end = min(fp_from(n), self.quantized_groups * GROUP_K)
        assert q_end >= self.buffer_start and n <= self.length
        k, v = self.dequantized(layer, 0, q_end)
        a, b = q_end - self.buffer_start, n - self.buffer_start
        return (torch.cat([k, self.buffer_k[layer, :, :, a:b].float()], dim=2),
                torch.cat([v, self.buffer_v[layer, :, :, a:b].float()], dim=2))

    def nbytes(self) -> int:
        """Bytes of this cache's own storage (planes, scales and zeros unless shared, the full-precision buffer)."""
        ts = [self.buffer_k, self.buffer_v] + ([] if self.shared is not None else [
            self.k_hi, self.v_hi, self.k_lo, self.v_lo, self.k_scale, self.k_zero, self.v_scale, self.v_zero])
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class QuantizedKV(PlanesKV):
    """What QuantizedCache.update gives attention for one layer's forward: the planes of `layer` and its
    buffer. `attend` computes softmax(q k^T * scale) v with each new token reading positions < fp_from(its
    position) from the planes and the buffer from there on (its own mask)."""

    def __init__(self, cache: QuantizedCache, layer: int):
        self.cache, self.layer = cache, layer

    def attend(self, q: torch.Tensor, scale: float, ops=None) -> torch.Tensor:
        """q [B, Hq, T, D] -> [B, Hq, T, D] (q's dtype), the module docstring's arithmetic; `ops` the compiled
        kernels (their quant_attention, kernels/attention.cpp: integer dot products on the planes a group at a
        time, KERNEL_MAX_ROWS rows g * T per call) or None (PyTorch, TILE tokens at a time)."""
        c = self.cache
        B, Hq, T, D = q.shape
        H = c.n_kv_heads
        g = Hq // H
        R = g * T
        qb = c._qb.repeat(g)  # rows are (group head, token): row r is token r % T
        q_end = int(c._qb.max())  # planes: positions < q_end (some rows read fewer)
        n_fp = c.length + T - c.buffer_start
        lo = c.k_lo is not None  # no lower planes: the 4-bit reading
        if ops is not None and B == 1 and D in KERNEL_HEAD_DIMS and capabilities(ops).quant_attention and g <= KERNEL_MAX_ROWS:
            # the kernel, at most KERNEL_MAX_ROWS rows (g * tokens) per call: a prefill chunk in blocks of tokens
            # (each row's result depends on its own query and keys only, so the blocks give what one call would)
            L, none = self.layer, torch.empty(0, dtype=torch.uint8)
            step = KERNEL_MAX_ROWS // g
            outs = []
            for t0 in range(0, T, step):
                t1 = min(T, t0 + step)
                end = int(c._qb[t0:t1].max())
                outs.append(ops.quant_attention(
                    q[0, :, t0:t1].reshape(H, g * (t1 - t0), D).float(), c.k_hi[L, 0, :, :end],
                    c.k_lo[L, 0, :, :end] if lo else none, c.k_scale[L, 0, :, :end // GROUP_K],
                    c.k_zero[L, 0, :, :end // GROUP_K], c.v_hi[L, 0, :, :end], c.v_lo[L, 0, :, :end] if lo else none,
                    c.v_scale[L, 0, :, :end], c.v_zero[L, 0, :, :end], c._qb[t0:t1].repeat(g),
                    c.buffer_k[L, 0, :, :n_fp], c.buffer_v[L, 0, :, :n_fp], c._fp_mask[t0:t1].contiguous(), t1 - t0, scale
                ).view(Hq, t1 - t0, D))
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            return out.to(q.dtype).view(B, Hq, T, D)
        qf = q.reshape(B, H, R, D).float() * scale
        m = torch.full((B, H, R), float("-inf"), device=q.device)
        l = torch.zeros(B, H, R, device=q.device)
        acc = torch.zeros(B, H, R, D, device=q.device)

        def softmax_step(s: torch.Tensor) -> torch.Tensor:
            """Scores s [B, H, R, n] of the next keys -> their p against the running maximum (acc rescaled)."""
            nonlocal m, l, acc
            m_new = torch.maximum(m, s.amax(-1))
            base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - base[..., None])
            w = torch.exp(m - base)
            l = l * w + p.sum(-1)
            acc = acc * w[..., None]
            m = m_new
            return p

        for t0 in range(0, q_end, TILE):
            t1 = min(q_end, t0 + TILE)
            kc, ks, kz, vc, vs, vz = c.group_codes(self.layer, t0, t1)
            G = (t1 - t0) // GROUP_K
            visible = torch.arange(t0, t1, device=q.device)[None, :] < qb[:, None]
            s = quantized_scores(qf, kc, ks, kz).reshape(B, H, R, G * GROUP_K).masked_fill_(~visible, float("-inf"))
            p = softmax_step(s)  # (rescales acc: before acc is read)
            acc = acc + quantized_pv(p.view(B, H, R, G, GROUP_K), vc, vs, vz)
        k, v = c.buffer_k[self.layer, :, :, :n_fp].float(), c.buffer_v[self.layer, :, :, :n_fp].float()
        s = (qf @ k.transpose(-1, -2)).masked_fill_(~c._fp_mask.repeat(g, 1), float("-inf"))
        p = softmax_step(s)
        acc = acc + p @ v
        return (acc / l[..., None]).to(q.dtype).view(B, Hq, T, D)


def quantized_scores(qf: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor, kz: torch.Tensor) -> torch.Tensor:
    """Scores of scaled queries qf [B, H, R, D] against groups of quantized keys (group_codes: codes kc
    [B, H, G, 64, D], scales and zeros ks, kz [B, H, G, D]) -> [B, H, R, G, 64]: per row and group, qg = qf * ks
    rounded to 15 bits in two int8 parts against its largest element: x = qg / a (a = max |qg| / 127),
    iq1 = round(x), iq2 = round((x - iq1) 254), so qg ~ a (iq1 + iq2 / 254); score
    a / 254 ((254 iq1 + iq2) . (code - 128)) + qf . (kz + 128 ks). The codes are centred so that the rounding of
    qg shifts each group's scores by no constant of its own. Each dot product of integers is exact in fp32 (below
    2^24) whatever the summation order, and their combination in float64, as the kernel's int32 sum."""
    qg = qf[:, :, :, None, :] * ks[:, :, None]
    amax = qg.abs().amax(-1, keepdim=True)
    x = qg * torch.where(amax > TINY, 127.0 / amax, torch.zeros_like(amax))
    iq1 = torch.round(x)
    iq2 = torch.round((x - iq1) * 254.0)
    centred = kc - 128.0
    dots = (254 * torch.einsum("bhrgd,bhgtd->bhrgt", iq1, centred).double()
            + torch.einsum("bhrgd,bhgtd->bhrgt", iq2, centred).double()).float()  # (int32 in the kernel)
    return ((amax / 127.0) / 254.0) * dots + (qf[:, :, :, None, :] * (kz + 128.0 * ks)[:, :, None]).sum(-1, keepdim=True)


def quantized_pv(p: torch.Tensor, vc: torch.Tensor, vs: torch.Tensor, vz: torch.Tensor) -> torch.Tensor:
    """p v over groups of quantized values: p [B, H, R, G, 64] (unnormalised probabilities), codes vc [B, H, G, 64,
    D], scales and zeros vs, vz [B, H, G, NB, 64] (NB groups of channels) -> sum over the groups [B, H, R, D]. Per
    row, group and channel group, p' = p * vs rounded to int16 against its largest (p' ~ sigma p16, sigma =
    max p' / 32767): sigma (p16 . code) + p . vz."""
    B, H, R, G, _ = p.shape
    D, NB = vc.shape[-1], vs.shape[3]
    pq = p[:, :, :, :, None, :] * vs[:, :, None]
    mx = pq.amax(-1, keepdim=True)
    p16 = torch.round(pq * torch.where(mx > TINY, 32767.0 / mx, torch.zeros_like(mx)))
    dots = torch.einsum("bhrgct,bhgtcj->bhrgcj", p16, vc.view(B, H, G, GROUP_K, NB, D // NB))
    zeros = torch.einsum("bhrgt,bhgct->bhrgc", p, vz)
    return ((mx / 32767.0) * dots + zeros[..., None]).sum(3).reshape(B, H, R, D)
