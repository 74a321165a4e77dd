"""TriForce retrieval cache: a budget of the most relevant KV chunks, chosen per layer and KV head.

Built from a full cache and the query of one token:
  * the keys of positions [0, n_sel) are cut into chunks of `chunk_size`; a chunk's representative
    is its mean post-RoPE key (in fp32, whatever the cache's dtype); its score is q . mean summed
    over the query heads that share the KV head (GQA), i.e. (sum of the group's queries) . mean;
  * kept: chunk 0 (attention sinks), the top-scoring other chunks, and the recent tokens
    [n_sel, length), with n_sel = floor((length - recent) / chunk_size) * chunk_size;
  * at most `budget` tokens in all, the same count for every layer and head.
Tokens generated after the build are appended; `rollback` may not go below the build point
(rebuild instead). A context that fits in the budget is kept whole (the cache degrades to full).
"""
from __future__ import annotations

from itertools import product

import torch

from .. import kernels
from ..errors import TriforceError
from ..kernels.capabilities import HEAD_DIMS, capabilities
from .base import BufferPool, KVCache, SlotKV, SlotLayout, TokenBlock, check_capacity, kv_buffer
from .full import FullCache


def chunk_scores(keys: torch.Tensor, q: torch.Tensor, c: int) -> torch.Tensor:
    """keys [B, Hkv, N, D] (N a multiple of c), q [B, Hkv, D] fp32 -> [B, Hkv, N / c]: q . the mean of each chunk of
    c keys, in fp32 whatever the keys' dtype. On the CPU the compiled kernels read each key once (kernels/retrieval.cpp:
    the embedded model's 30 layers at 32K in 20-26 ms against 63-70 for the PyTorch below, which writes a widened copy
    of every key and reads it back; benchmarks/chunk_scores_ab.py)."""
    B, Hkv, N, D = keys.shape
    if keys.device.type == "cpu" and B == 1 and D in HEAD_DIMS and keys[0].stride(-2) == D and keys.stride(-1) == 1:
        ops = kernels.cpu()
        if capabilities(ops).chunk_scores:
            return ops.chunk_scores(keys[0], q[0].contiguous(), c).unsqueeze(0)
    # converted first, then summed (sum(dtype=float32) of bf16 keys took twice as long at 32K)
    means = keys.float().reshape(B, Hkv, N // c, c, D).sum(dim=3) / c
    return torch.einsum("bhd,bhnd->bhn", q, means)


# build gathers the kept chunks of this many bytes of keys (or values) at a time: a larger temporary comes from
# fresh pages every time (glibc serves blocks over 32 MB with mmap), whose first touch took longer than the gather
GATHER_BYTES = 8 << 20


class RetrievalCache(KVCache):

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, budget: int, chunk_size: int = 8,
                 recent: int = 64, max_new: int = 512, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 pool: BufferPool | None = None):
        if chunk_size < 1:
            raise TriforceError(f"chunk size must be >= 1, got {chunk_size}")
        if budget < 2 * chunk_size + recent:
            raise TriforceError(
                f"retrieval budget {budget} is too small: it must hold the sink chunk, one more chunk and the "
                f"{recent} recent tokens (>= {2 * chunk_size + recent})"
            )
        self.budget, self.chunk_size, self.recent, self.max_new = budget, chunk_size, recent, max_new
        self.capacity = budget + max_new
        self.shape = (n_layers, batch, n_kv_heads, self.capacity, head_dim)
        self.dtype, self.device, self.pool = dtype, device, pool
        self._k: torch.Tensor | None = None  # (allocated by the first use: see k)
        self._v: torch.Tensor | None = None
        self._released = False
        self.n_layers, self.length = n_layers, 0
        self.built_at = 0  # sequence length at the last build
        self.base = 0  # tokens selected at the last build
        self.indices: list[torch.Tensor] = []  # per layer [B, Hkv, base]: positions kept at the last build
        self._block: TokenBlock | None = None  # the prepared forward's tree (None: a chain, or one token)
        self._n_new = 0

    @property
    def k(self) -> torch.Tensor:
        """The keys [n_layers, B, Hkv, capacity, D], allocated when first used (the first build), not when the cache
        is made: an adaptive stack makes its retrieval level with the generation and may never run it, and in a
        server the allocation (2 x 49 MB for a 4,096-token budget, 19 ms of first-touched pages on AMD Zen 5)
        would hold up the batch at every request's start. From `pool` (the server's BufferPool) where it keeps a
        buffer of this shape; `release` gives them back."""
        if self._k is None:
            if self._released:
                raise RuntimeError("this retrieval cache was released: its buffers belong to the pool now")
            # (a drafting cache: small pages, see kv_buffer)
            self._k = kv_buffer(self.shape, self.dtype, self.device, huge_pages=False, pool=self.pool)
            self._v = kv_buffer(self.shape, self.dtype, self.device, huge_pages=False, pool=self.pool)
        return self._k

    @property
    def v(self) -> torch.Tensor:
        """The values (as `k`)."""
        self.k  # noqa: B018 - allocates both
        return self._v

    def release(self) -> None:
        """Give the buffers back to the pool they came from, if any (the cache is unusable after this)."""
        k, v, self._k, self._v = self._k, self._v, None, None
        self._released = True
        if self.pool is not None and k is not None:
            self.pool.give(k)
            self.pool.give(v)

    def select(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """keys [B, Hkv, N, D], queries [B, Hq, Tq, D] (the recorded queries of positions N - Tq .. N - 1; the
        last one is used) -> kept positions [B, Hkv, M] (ascending)."""
        query = queries[:, :, -1]
        B, Hkv, N, D = keys.shape
        if N <= self.budget:
            return torch.arange(N, device=keys.device).expand(B, Hkv, N)
        n_sel = (N - self.recent) // self.chunk_size * self.chunk_size
        q = query.reshape(B, Hkv, -1, D).float().sum(dim=2)
        return self._positions(chunk_scores(keys[:, :, :n_sel], q, self.chunk_size), N)

    def _positions(self, scores: torch.Tensor, n: int) -> torch.Tensor:
        """The positions kept of n tokens (more than the budget) from chunk scores [..., n_sel / c] -> [..., M]:
        chunk 0, the top-scoring others (ascending), the recent tokens [n_sel, n)."""
        c, lead = self.chunk_size, scores.shape[:-1]
        n_sel = scores.shape[-1] * c
        k_top = min((self.budget - c - (n - n_sel)) // c, scores.shape[-1] - 1)
        top = scores[..., 1:].topk(k_top, dim=-1, sorted=False).indices.add_(1).sort(dim=-1).values
        offsets = torch.arange(c, device=scores.device)
        chunk_tokens = (top[..., None] * c + offsets).flatten(-2)
        head = offsets.expand(*lead, c)
        tail = torch.arange(n_sel, n, device=scores.device).expand(*lead, n - n_sel)
        return torch.cat([head, chunk_tokens, tail], dim=-1)

    def build(self, full: FullCache) -> None:
        """(Re)build from the first `full.length` tokens of `full` (a FullCache with as many layers, or an
        int8 QuantizedCache read one dequantized layer at a time: `layer_kv` gives both; for a model with
        sliding-window layers, SlidingWindowCache.build calls this on the global layers), scoring chunks with
        the query of its last token (position full.length - 1; `select` gets the queries its last forward
        recorded, up to that token), which its last forward must have recorded
        (`record_queries=True`; rolling `full` back after that forward is fine)."""
        if not hasattr(full, "layer_kv") or full.n_layers != self.n_layers:
            raise ValueError(f"a retrieval cache of {self.n_layers} layers is built from a full cache of as many "
                             f"(got {type(full).__name__} of {full.n_layers})")
        n = full.length
        if self.n_layers == 0:  # a model whose every layer slides (Mistral v0.1): the ring holds all it attends to
            self.indices = []
            self.base, self.built_at, self.length = 0, n, n
            return
        recorded = full.recorder
        query_index = None if recorded is None else n - 1 - recorded.start
        if (recorded is None or recorded.layers[0] is None
                or not 0 <= query_index < recorded.layers[0].shape[2]):
            raise ValueError("the full cache holds no recorded query for its last token: create it with "
                             "record_queries=True and build right after a forward that fed that token")
        if (type(self).select is RetrievalCache.select and isinstance(full, FullCache) and full.k.shape[1] == 1
                and self.k.shape[1] == 1
                and full.k.is_contiguous() and full.v.is_contiguous() and full.capacity % self.chunk_size == 0
                and n > self.budget):
            self._build_every_layer(full, n, [q[:, :, query_index] for q in recorded.layers])
            return
        self.indices = []
        for layer in range(self.n_layers):
            q = recorded.layers[layer][:, :, :query_index + 1]
            keys, values = full.layer_kv(layer, n)
            idx = self.select(keys, q)
            m = idx.shape[-1]
            for b, h in product(range(idx.shape[0]), range(idx.shape[1])):  # rows per head: torch.gather over
                # the [B, Hkv, M, D] view took 25x as long
                self.k[layer, b, h, :m] = keys[b, h].index_select(0, idx[b, h])
                self.v[layer, b, h, :m] = values[b, h].index_select(0, idx[b, h])
            self.indices.append(idx)
        self.base, self.built_at, self.length = m, n, n

    def _build_every_layer(self, full: FullCache, n: int, queries: list[torch.Tensor]) -> None:
        """build's selection and copy for every layer at once, from a one-sequence FullCache of more than `budget`
        tokens: the positions `select` keeps, layer by layer, in a few operations over all layers' heads. Why: in a
        server other threads run Python while a build runs, and each operation that releases the GIL may wait up
        to the switch interval to take it back: the layer-by-layer build's ~1,300 operations took
        0.37-0.42 s each with 8 requests starting at once, 0.02-0.04 s alone (Intel Xeon, 8K; docs/serving.md)."""
        L, _, H, cap, D = full.k.shape
        c = self.chunk_size
        n_sel = (n - self.recent) // c * c
        q = torch.stack(queries).reshape(L, H, -1, D).float().sum(dim=2)  # [L, Hkv, D]: each GQA group's sum
        scores = chunk_scores(full.k[:, :, :, :n_sel].reshape(1, L * H, n_sel, D), q.reshape(1, L * H, D), c)
        kept = self._positions(scores[0], n)  # [L * Hkv, M]: chunks, then the recent tokens [n_sel, n)
        m, n_chunked = kept.shape[-1], kept.shape[-1] - (n - n_sel)
        chunks = kept[:, :n_chunked:c] // c + torch.arange(L * H, device=kept.device).unsqueeze(1) * (cap // c)
        per_layer = H * n_chunked * D * full.k.element_size()
        step = max(1, GATHER_BYTES // per_layer)  # layers gathered at once
        for src, dst in ((full.k, self.k), (full.v, self.v)):  # whole chunks of c keys as rows (c * D each)
            src_rows, dst = src.view(L * H * cap // c, c * D), dst.view(L * H, self.capacity, D)
            for a in range(0, L * H, step * H):
                b = min(L * H, a + step * H)
                rows = src_rows.index_select(0, chunks[a:b].flatten()).view(b - a, -1, c * D)
                dst[a:b, :n_chunked].view(b - a, n_chunked // c, c * D).copy_(rows)
            dst[:, n_chunked:m].copy_(src.view(L * H, cap, D)[:, n_sel:n])
        self.indices = list(kept.view(L, 1, H, m).unbind(0))
        self.base, self.built_at, self.length = m, n, n

    def room(self, committed: int) -> int:
        """Slots left for tokens after `committed` (the decoder rebuilds before they run out)."""
        return self.capacity - self._slot(committed)

    def _slot(self, position: int) -> int:
        """Slot of a position appended since the build (position >= built_at)."""
        return self.base + position - self.built_at

    def prepare(self, n_new: int, block: TokenBlock | None = None) -> None:
        check_capacity(self._slot(self.length) + n_new, self.capacity, "the retrieval cache (rebuild it more often)")
        self._n_new = n_new
        self._block = block if n_new > 1 else None

    # a CUDA graph may run through it (caches/static.py)
    FIXED_SLOTS = True

    @property
    def slot_layout(self) -> SlotLayout:
        return SlotLayout(self.k, self.v, self._slot(self.length), chain=self._block is None, fixed=self.FIXED_SLOTS)

    def update(self, layer, q, k, v):
        a = self._slot(self.length)
        b = a + self._n_new
        self.k[layer, :, :, a:b] = k
        self.v[layer, :, :, a:b] = v
        return SlotKV(self.k[layer, :, :, :b], self.v[layer, :, :, :b], self._block)

    def rollback(self, length: int) -> None:
        if length < self.built_at:
            raise ValueError(f"retrieval cache built at {self.built_at} cannot roll back to {length}: rebuild it")
        self.length = length


