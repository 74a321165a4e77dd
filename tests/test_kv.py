"""KV caches: full, rollback, StreamingLLM (sink + window) and retrieval selection."""
from __future__ import annotations

import pytest
import torch

from triforce.caches import FullCache, RetrievalCache, StreamingCache, new_cache
from triforce.caches.base import DenseKV

V = 96


def _ids(n, seed=0):
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(seed))


def _streaming(model, sink, window, **kw):
    c = model.cfg
    return StreamingCache(c.n_layers, c.n_kv_heads, c.head_dim, sink=sink, window=window, **kw)


class MaskedFullCache(FullCache):
    """Full cache whose attention is restricted by the StreamingLLM mask (the reference)."""

    def __init__(self, model, sink, window, capacity, dtype=torch.float32):
        c = model.cfg
        super().__init__(c.n_layers, c.n_kv_heads, c.head_dim, capacity, dtype=dtype)
        self.sink, self.window = sink, window

    def prepare(self, n_new, block=None):
        assert block is None  # chains only
        super().prepare(n_new)
        q = torch.arange(self.length, self.length + n_new)[:, None]
        k = torch.arange(self.length + n_new)[None, :]
        self._mask = (k <= q) & ((k < self.sink) | (k > q - self.window))

    @property
    def slot_layout(self):
        return None  # its visibility is not the slots' causal one: the layers run one by one

    def update(self, layer, q, k, v):
        kv = super().update(layer, q, k, v)
        return DenseKV(kv.keys, kv.values, self._mask)


@torch.no_grad()
def test_full_cache_reproduces_no_cache_logits(tiny_llama):
    ids = _ids(80)
    whole = tiny_llama(ids, new_cache(tiny_llama, 80))
    cache = new_cache(tiny_llama, 80)
    parts = [tiny_llama(ids[:, :30], cache), tiny_llama(ids[:, 30:37], cache)]
    parts += [tiny_llama(ids[:, i:i + 1], cache) for i in range(37, 80)]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_rollback_then_redecode_reproduces_logits(tiny_llama):
    ids = _ids(60)
    cache = new_cache(tiny_llama, 80)
    tiny_llama(ids[:, :40], cache)
    first = tiny_llama(ids[:, 40:50], cache)
    tiny_llama(_ids(8, seed=5), cache)  # a rejected draft
    cache.rollback(40)
    again = tiny_llama(ids[:, 40:50], cache)
    torch.testing.assert_close(again, first, atol=1e-6, rtol=1e-6)
    assert cache.length == 50


@pytest.mark.parametrize("sink,window", [(4, 16), (0, 8), (2, 1)])
@torch.no_grad()
def test_streaming_cache_equals_sink_window_mask(tiny_llama, sink, window):
    ids = _ids(150, seed=3)
    ref = tiny_llama(ids, MaskedFullCache(tiny_llama, sink, window, 160))
    # small slack: the cache compacts many times along the way
    cache = _streaming(tiny_llama, sink, window, max_rollback=4, slack=8)
    parts, pos = [], 0
    for n in [8, 5, 1, 1, 7, 3] + [1] * 60 + [8] * 8 + [1] * 1000:
        if pos >= 150:
            break
        n = min(n, 150 - pos)
        parts.append(tiny_llama(ids[:, pos:pos + n], cache))
        pos += n
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, atol=1e-4, rtol=1e-4)
    assert cache.capacity == sink + window + 4 + 8  # nothing grew


@torch.no_grad()
def test_streaming_cache_rollback_keeps_window(tiny_llama):
    sink, window = 4, 16
    ids = _ids(120, seed=4)
    ref = tiny_llama(ids, MaskedFullCache(tiny_llama, sink, window, 128))
    cache = _streaming(tiny_llama, sink, window, max_rollback=6, slack=8)
    got, pos = [], 0
    while pos < 120:
        n = min(6, 120 - pos)
        tiny_llama(_ids(n, seed=100 + pos), cache)  # a draft, all rejected
        cache.rollback(pos)
        got.append(tiny_llama(ids[:, pos:pos + n], cache))
        pos += n
    torch.testing.assert_close(torch.cat(got, dim=1), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        cache.rollback(pos - 40)  # deeper than max_rollback: refused, not silently wrong


def _static_forward(model, cache, tokens: list[int], rows: int = 16) -> torch.Tensor | None:
    """What a CUDA graph replays through a StreamingLLM cache (graphs.py), on the CPU: `rows` token rows at fixed
    slots (the real ones first, padding after), the window given in slots (SlotMask.window; the bias form here);
    None where graphs.usable would refuse (the padding would run past the capacity)."""
    from triforce.caches.static import StaticView

    n, first = len(tokens), cache.length
    if cache._slot(first) + rows > cache.capacity:
        return None
    cache.prepare(n)
    slot = cache._slot(first)  # after a compaction
    view = StaticView(cache.k, cache.v, torch.arange(slot, slot + rows), model.cfg.n_heads, record_queries=False,
                      window=cache.window, sink=cache.sink)
    tok = torch.tensor([tokens + [0] * (rows - n)])
    logits = model.forward_static(tok, torch.arange(first, first + rows), view)[:, :n]
    cache.commit(n)
    return logits


@pytest.mark.parametrize("sink,window", [(4, 16), (0, 8), (2, 1)])
@torch.no_grad()
def test_streaming_cache_in_fixed_slots_equals_the_mask(tiny_llama, sink, window):
    """The forward a CUDA graph replays through a streaming cache (fixed slots, the window derived from each row's
    slot), with rollbacks of rejected drafts and compactions along the way, gives the StreamingLLM mask's logits."""
    ids = _ids(150, seed=3)
    ref = tiny_llama(ids, MaskedFullCache(tiny_llama, sink, window, 160))
    cache = _streaming(tiny_llama, sink, window, max_rollback=6, slack=40)
    got, pos, static = [], 0, 0
    tiny_llama(ids[:, :20], cache)
    got.append(ref[:, :20])
    pos = 20
    for step, n in enumerate([1, 5, 3, 1, 6] * 40):
        if pos >= 150:
            break
        n = min(n, 150 - pos)
        if step % 3 == 0:  # a draft, all rejected
            _static_forward(tiny_llama, cache, _ids(n, seed=200 + pos)[0].tolist())
            cache.rollback(pos)
        out = _static_forward(tiny_llama, cache, ids[0, pos:pos + n].tolist())
        if out is None:
            out = tiny_llama(ids[:, pos:pos + n], cache)
        else:
            static += 1
        got.append(out)
        pos += n
    torch.testing.assert_close(torch.cat(got, dim=1), ref, atol=1e-4, rtol=1e-4)
    assert static >= 20 and cache.start > cache.sink  # mostly fixed-slot forwards, and compactions happened


class _GapSpy:
    """The compiled module, counting the attention calls that get a StreamingLLM window's gap."""

    def __init__(self, kern):
        self.kern, self.gap_calls, self.calls = kern, 0, 0

    def __getattr__(self, name):
        fn = getattr(self.kern, name)
        if name not in ("decode_attention", "decode_layers"):
            return fn

        def counted(*a, **kw):
            self.calls += 1
            self.gap_calls += kw.get("gap") is not None
            return fn(*a, **kw)
        return counted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink,window", [(4, 16), (0, 8), (2, 1), (16, 40)])
@torch.no_grad()
def test_streaming_cache_on_the_kernels_equals_the_mask(sink, window, dtype):
    """With head_dim 64 the StreamingLLM cache's forwards run on the compiled attention, every layer in one call
    for chains (the window as a gap of hidden slots per new token, kernels/attention.cpp), and still equal full
    attention under the sink + window mask, through compactions and mixed chunk sizes; a kernel that ignored the
    gap (the whole region visible) is caught."""
    from conftest import hf_tiny, ours_from_hf

    from triforce import kernels

    kern = kernels.cpu()
    if kern is None:
        pytest.skip("no compiled CPU kernels here")
    m = ours_from_hf(hf_tiny("llama", seed=13, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=2048))
    assert m.cfg.head_dim == 64
    m.kv_dtype = "bf16" if dtype == torch.bfloat16 else "fp32"
    ids = _ids(300, seed=3)
    ref = m(ids, MaskedFullCache(m, sink, window, 320, dtype))  # PyTorch's attention under the dense mask

    def run(spy):
        cache = StreamingCache(m.cfg.n_layers, m.cfg.n_kv_heads, 64, sink=sink, window=window, max_rollback=4,
                               slack=32, dtype=dtype)
        parts, pos = [], 0
        with kernels.override(spy):
            for n in [8, 5, 1, 1, 7, 3, 2] + [1] * 60 + [8] * 8 + [30] + [1] * 1000:
                if pos >= 300:
                    break
                n = min(n, 300 - pos)
                parts.append(m(ids[:, pos:pos + n], cache))
                pos += n
        return torch.cat(parts, dim=1)

    spy = _GapSpy(kern)
    got = run(spy)
    assert spy.gap_calls > 0 and spy.gap_calls == spy.calls  # every forward on the kernels, with the gap
    # (the kernel sums in other orders than PyTorch's attention: fp32 within 2e-4 of the reference here; over a
    # bf16 cache that can move a stored key by a bf16 step, which this random tiny model turns into logits up to
    # 0.3 apart at a few positions: their mean is compared)
    tol = 1e-3 if dtype == torch.float32 else 5e-3  # fp32: each logit; bf16: their mean (measured 6e-4 - 1.7e-3)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    else:
        assert (got - ref).abs().mean() < tol

    class NoGap(_GapSpy):  # the wrong variant: the gap dropped
        def __getattr__(self, name):
            fn = getattr(self.kern, name)
            if name not in ("decode_attention", "decode_layers"):
                return fn
            return lambda *a, **kw: fn(*a, **{k: v for k, v in kw.items() if k != "gap"})

    wrong = run(NoGap(kern))
    assert (wrong - ref).abs().mean() > 100 * tol  # (measured 2-4)


def _brute_force_selection(keys, query, budget, chunk, recent):
    """Kept positions per (head) by explicit loops, following the documented rule."""
    _, hkv, n, d = keys.shape
    g = query.shape[1] // hkv
    n_sel = (n - recent) // chunk * chunk
    k_top = (budget - chunk - (n - n_sel)) // chunk
    out = []
    for h in range(hkv):
        scores = []
        for c in range(1, n_sel // chunk):
            mean = keys[0, h, c * chunk:(c + 1) * chunk].mean(0)
            s = sum(float(query[0, h * g + j] @ mean) for j in range(g))
            scores.append((s, c))
        best = sorted(scores, reverse=True)[:k_top]
        kept = set(range(chunk)) | set(range(n_sel, n))
        for _, c in best:
            kept |= set(range(c * chunk, (c + 1) * chunk))
        out.append(kept)
    return out


@pytest.mark.parametrize("n_prompt,budget,chunk,recent", [(300, 64, 8, 16), (257, 100, 4, 10), (200, 48, 16, 0)])
@torch.no_grad()
def test_retrieval_cache_keeps_brute_force_chunks(tiny_llama, n_prompt, budget, chunk, recent):
    c = tiny_llama.cfg
    full = new_cache(tiny_llama, n_prompt + 8, record_queries=True)
    tiny_llama(_ids(n_prompt, seed=7), full)
    r = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, budget=budget, chunk_size=chunk, recent=recent)
    r.build(full)
    assert r.base <= budget and r.length == n_prompt
    for layer in range(c.n_layers):
        q = full.recorder.layers[layer][:, :, -1]
        expected = _brute_force_selection(full.k[layer, :, :, :n_prompt], q, budget, chunk, recent)
        for h in range(c.n_kv_heads):
            kept = r.indices[layer][0, h].tolist()
            assert len(kept) == len(set(kept)) == r.base
            assert set(kept) == expected[h], (layer, h)
            # the gathered keys are the full cache's keys at those positions
            torch.testing.assert_close(r.k[layer, 0, h, :r.base], full.k[layer, 0, h, kept])


@pytest.mark.parametrize("dtype,gather_bytes", [(torch.float32, 8 << 20), (torch.float16, 1)])
@torch.no_grad()
def test_a_retrieval_build_over_every_layer_at_once_equals_the_layer_by_layer_build(tiny_llama, dtype, gather_bytes,
                                                                                     monkeypatch):
    """build's all-layers path (a one-sequence FullCache; its gather in steps of GATHER_BYTES: every layer at once,
    or one at a time) keeps and copies exactly what the layer-by-layer path does (a subclass with its own select
    takes that path, as H2O does)."""
    from triforce.caches import retrieval

    monkeypatch.setattr(retrieval, "GATHER_BYTES", gather_bytes)

    class LayerByLayer(RetrievalCache):
        def select(self, keys, queries):
            return super().select(keys, queries)

    c = tiny_llama.cfg
    full = new_cache(tiny_llama, 320, record_queries=True, dtype=dtype)
    tiny_llama(_ids(300, seed=11), full)
    built = []
    for cls in (RetrievalCache, LayerByLayer):
        r = cls(c.n_layers, c.n_kv_heads, c.head_dim, budget=96, chunk_size=8, recent=16, dtype=dtype)
        r.build(full)
        built.append(r)
    a, b = built
    assert (a.base, a.built_at, a.length) == (b.base, b.built_at, b.length) and a.base <= 96 and a.length == 300
    assert all(torch.equal(x, y) for x, y in zip(a.indices, b.indices))
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@torch.no_grad()
def test_retrieval_cache_within_budget_equals_full(tiny_llama):
    """A context that fits in the budget is kept whole: decoding equals the full cache."""
    c = tiny_llama.cfg
    ids = _ids(70, seed=8)
    full = new_cache(tiny_llama, 80, record_queries=True)
    tiny_llama(ids[:, :50], full)
    r = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, budget=64, chunk_size=8, recent=8)
    r.build(full)
    assert r.base == 50
    a = tiny_llama(ids[:, 50:60], full)
    b = tiny_llama(ids[:, 50:60], r)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    r.rollback(55)
    full.rollback(55)
    torch.testing.assert_close(tiny_llama(ids[:, 55:70], r), tiny_llama(ids[:, 55:70], full), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        r.rollback(40)  # below the build point: must rebuild instead


@torch.no_grad()
def test_a_retrieval_cache_takes_its_buffers_at_its_first_build_from_the_pool_and_gives_them_back(tiny_llama):
    """A retrieval cache holds no K/V until it is first built (an adaptive stack may never run its level, and a
    server's request would wait for the allocation at its start); they come from the pool where it keeps buffers of
    their shape, and `release` gives them back zeroed for the next request's, which builds exactly as a new one."""
    from triforce.caches import BufferPool

    c = tiny_llama.cfg
    full = new_cache(tiny_llama, 200, record_queries=True)
    tiny_llama(_ids(160, seed=9), full)
    pool = BufferPool(limit=1 << 30)
    shape = dict(budget=48, chunk_size=8, recent=8)
    first = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, pool=pool, **shape)
    assert first._k is None and first._v is None and (pool.hits, pool.misses) == (0, 0)
    first.build(full)
    ptrs = {first.k.data_ptr(), first.v.data_ptr()}
    assert (pool.hits, pool.misses) == (0, 2)
    nbytes = 2 * first.k.numel() * first.k.element_size()
    first.release()
    assert first._k is None and pool.bytes == nbytes
    with pytest.raises(RuntimeError, match="released"):
        first.k  # noqa: B018 - a released cache does not take buffers again
    second = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, pool=pool, **shape)
    second.build(full)
    fresh = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, **shape)
    fresh.build(full)
    assert {second.k.data_ptr(), second.v.data_ptr()} == ptrs
    assert torch.equal(second.k, fresh.k) and torch.equal(second.v, fresh.v)


@torch.no_grad()
def test_retrieval_cache_decode_attends_to_kept_positions(tiny_llama):
    """A decode step through the retrieval cache equals attention restricted to the kept positions."""
    from triforce.caches.base import SlotKV
    from triforce.execution import attention

    c = tiny_llama.cfg
    full = new_cache(tiny_llama, 200, record_queries=True)
    tiny_llama(_ids(160, seed=9), full)
    r = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, budget=48, chunk_size=8, recent=8)
    r.build(full)
    tiny_llama(_ids(1, seed=10), r)  # writes layer-0 K/V of the new token at position 160 into r
    q = torch.randn(1, c.n_heads, 1, c.head_dim)
    k_new = r.k[0, :, :, r.base:r.base + 1]
    v_new = r.v[0, :, :, r.base:r.base + 1]
    got = attention(q, SlotKV(r.k[0, :, :, :r.base + 1], r.v[0, :, :, :r.base + 1]))
    g = c.n_heads // c.n_kv_heads
    for h in range(c.n_heads):
        kv = h // g
        idx = r.indices[0][0, kv]
        keys = torch.cat([full.k[0, 0, kv, idx], k_new[0, kv]])
        vals = torch.cat([full.v[0, 0, kv, idx], v_new[0, kv]])
        w = torch.softmax(q[0, h, 0] @ keys.T / c.head_dim ** 0.5, -1)
        torch.testing.assert_close(got[0, h, 0], w @ vals, atol=1e-4, rtol=1e-4)


def test_slot_layout_says_where_the_one_call_writes_and_what_it_hides():
    """KVCache.slot_layout: a full cache's chain -> its slot, no gap, fixed slots (a CUDA graph may run through it); a
    draft tree (TokenBlock) -> not a chain (the layers run one by one); a StreamingLLM cache past its window -> its
    slot and each new token's gap, never fixed."""
    from triforce.caches.base import TokenBlock

    full = FullCache(2, 1, 8, 64)
    full.length = 10
    full.prepare(3)
    layout = full.slot_layout
    assert (layout.first, layout.gap, layout.chain, layout.fixed) == (10, None, True, True)
    tree = TokenBlock(torch.tensor([0, 1, 1]), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))
    full.prepare(3, tree)
    assert not full.slot_layout.chain

    stream = StreamingCache(2, 1, 8, sink=2, window=4)
    k = torch.randn(1, 1, 20, 8)
    stream.prepare(20)
    for layer in range(2):
        stream.update(layer, None, k, k)
    stream.commit(20)
    stream.prepare(2)
    layout = stream.slot_layout
    slot, gap = layout.first, layout.gap
    assert slot == stream._slot(20) and layout.chain and not layout.fixed
    # hidden from new token t: slots gap[0] .. gap[1 + t] - 1, past the 2 sinks up to its window of 4
    assert gap.tolist() == [2, 2 + 17 - stream.start, 2 + 18 - stream.start]


def test_drafting_caches_do_not_ask_for_huge_pages(monkeypatch):
    """The full cache streams the whole context every step and asks for transparent huge pages; the drafting
    caches, built afresh for every generation and bounded by their budget, do not (first touching huge pages cost
    more than they returned there). Checked on the madvise calls themselves."""
    import sys

    import triforce.caches.base as base_mod

    if sys.platform != "linux":
        pytest.skip("huge pages are asked for on Linux only")
    calls = []

    class Libc:
        def madvise(self, start, length, advice):
            calls.append(advice)
            return 0

    monkeypatch.setattr(base_mod.ctypes, "CDLL", lambda name: Libc())
    shape = dict(n_layers=4, n_kv_heads=2, head_dim=64)  # 4 x 2 x 4096 x 64 fp32: 8 MB per buffer
    FullCache(capacity=4096, **shape)
    assert calls == [base_mod._MADV_HUGEPAGE] * 2
    calls.clear()
    RetrievalCache(budget=4096 - 64, max_new=64, **shape)
    StreamingCache(sink=16, window=4096, slack=0, **shape)
    assert calls == []


def test_a_released_full_cache_gives_its_buffers_zeroed_to_the_next_cache_of_its_shape():
    """A server's requests take their full caches' buffers from a BufferPool: a released cache's K and V come back
    zeroed (what a new buffer is) to the next cache of exactly their shape; another shape gets new ones; past the
    pool's limit a given buffer is let go; evict frees kept ones."""
    from triforce.caches import BufferPool

    pool = BufferPool(limit=1 << 30)
    first = FullCache(2, 2, 8, 32, pool=pool)
    first.write_positions(0, torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    k_ptr, v_ptr = first.k.data_ptr(), first.v.data_ptr()
    first.release()
    assert first.k is None and pool.bytes == 2 * 2 * 2 * 32 * 8 * 4
    other = FullCache(2, 2, 8, 48, pool=pool)  # another capacity: new buffers
    assert {other.k.data_ptr(), other.v.data_ptr()}.isdisjoint({k_ptr, v_ptr})
    second = FullCache(2, 2, 8, 32, pool=pool)
    assert {second.k.data_ptr(), second.v.data_ptr()} == {k_ptr, v_ptr} and pool.bytes == 0
    assert not second.k.any() and not second.v.any()  # zeroed, as a new cache's
    assert (pool.hits, pool.misses) == (2, 4)
    second.release()
    assert pool.evict(1) == 2 * 2 * 32 * 8 * 4 and pool.bytes == 2 * 2 * 32 * 8 * 4  # one buffer freed
    small = BufferPool(limit=100)
    cache = FullCache(2, 2, 8, 32, pool=small)
    cache.release()
    assert small.bytes == 0 and small.take((2, 1, 2, 32, 8), torch.float32, "cpu") is None
