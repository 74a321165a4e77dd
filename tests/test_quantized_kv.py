"""The quantized KV cache (caches/quantized.py): KIVI grouping, 8-bit codes as two 4-bit planes, a
full-precision buffer for the newest tokens. Error bounds of both readings; the rule "a query at p reads
positions < fp_from(p) from the planes" makes the stored codes and the attention independent of how the
tokens were fed (one by one, in chunks, with rejected drafts rolled back, as trees); memory stays bounded."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce.caches.quant_codes import (GROUP_K, codes_of, fp_from, pack_keys, pack_values, quantize, unpack_keys,
                                         unpack_values)
from triforce.caches.quantized import TILE, QuantizedCache
from triforce.sampling import SamplingParams
from triforce.speculation.state import ModelState, prefill
from triforce.speculation.tree import DraftTree
from triforce.caches import new_cache

L, H, D = 2, 2, 64


def _cache(capacity=2048, **kw) -> QuantizedCache:
    return QuantizedCache(L, H, D, capacity, **{"max_rollback": 32, **kw})


def _kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with outlier channels (KIVI's reason for per-channel keys) and values, [L, 1, H, n, D]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, 1, H, n, D, generator=g) * (1 + 9 * (torch.arange(D) % 13 == 0))
    return k, torch.randn(L, 1, H, n, D, generator=g)


def _feed(cache: QuantizedCache, k, v, start: int, end: int, block=None):
    """One 'forward' of positions start..end-1 without a model: prepare, update every layer, commit."""
    assert cache.length == start
    cache.prepare(end - start, block)
    for layer in range(L):
        cache.update(layer, None, k[layer, :, :, start:end], v[layer, :, :, start:end])
    cache.commit(end - start)


def _stored(cache: QuantizedCache, g: int) -> dict[str, torch.Tensor]:
    n = g * GROUP_K
    out = {name: getattr(cache, name)[:, :, :, :n] for name in ("k_hi", "k_lo", "v_hi", "v_lo", "v_scale", "v_zero")}
    out.update(k_scale=cache.k_scale[:, :, :, :g], k_zero=cache.k_zero[:, :, :, :g])
    return out


def test_pack_round_trip_and_error_bounds():
    for d in (64, 128, 16):
        codes = torch.randint(0, 256, (2, 3, GROUP_K, d), dtype=torch.uint8)  # [.., groups, tokens, channels]
        hi, lo = pack_keys(codes >> 4), pack_keys(codes & 15)
        assert hi.shape == (2, 3 * GROUP_K, d // 2)
        assert torch.equal(codes_of(unpack_keys(hi), unpack_keys(lo)), codes.float())
        assert torch.equal(codes_of(unpack_keys(hi), None), (codes // 16 * 16 + 8).float())
        v = codes.reshape(2, 3 * GROUP_K, d)
        hi, lo = pack_values(v >> 4), pack_values(v & 15)
        assert hi.shape == (2, 3 * GROUP_K, d // 2) and torch.equal(unpack_values(hi) * 16 + unpack_values(lo), v)
    # the kernel's byte order: keys in lanes of 8 channels of one token, values two tokens per channel
    codes = torch.zeros(1, GROUP_K, 64, dtype=torch.uint8)
    codes[0, 5, 8 * 3 + 2], codes[0, 5, 8 * 3 + 4 + 1] = 7, 9  # token 5, lane 3: channel 26 (low), 29 (high)
    flat = pack_keys(codes).flatten()
    assert flat[3 * 4 * GROUP_K + 5 * 4 + 2] == 7 and flat[3 * 4 * GROUP_K + 5 * 4 + 1] == 9 << 4
    assert int(flat.count_nonzero()) == 2
    v = torch.zeros(GROUP_K, 64, dtype=torch.uint8)
    v[11, 32 + 3], v[11, 32 + 16 + 5] = 6, 13  # token 11 (second of pair 5), block 1: channels 3 and 21
    flat = pack_values(v).flatten()
    assert flat[5 * 64 + 32 + 2 * 3 + 1] == 6 and flat[5 * 64 + 32 + 2 * 5 + 1] == 13 << 4
    assert int(flat.count_nonzero()) == 2
    x = torch.randn(200, 64) * torch.linspace(0.01, 30, 64) + torch.linspace(-50, 50, 64)  # wide ranges and offsets
    c, scale, zero = quantize(x.T)  # groups over the 200 values of each channel
    s, z = scale.float()[:, None], zero.float()[:, None]
    tol = 1e-3 * x.abs().amax(0)[:, None]  # the fp16 rounding of zero and scale
    eight = c.float() * s + z
    four = codes_of(c >> 4, None) * s + z
    assert ((eight - x.T).abs() <= s / 2 + tol).all()
    assert ((four - x.T).abs() <= 8.5 * s + tol).all()
    assert (eight - x.T).abs().mean() < 0.3 * s.mean()  # uniform rounding error: mean scale / 4
    const = quantize(torch.full((3, 64), 2.5))  # a constant group: scale 0, exact
    assert torch.equal(const[1], torch.zeros(3, dtype=torch.float16)) and torch.equal(const[0], torch.zeros(3, 64, dtype=torch.uint8))


def test_the_cache_reads_the_planes_within_the_bounds():
    k, v = _kv(600)
    cache = _cache()
    _feed(cache, k, v, 0, 600)
    n = cache.quantized_groups * GROUP_K
    assert n == fp_from(599) == 512
    for layer in range(L):
        for four in (False, True):
            kd, vd = cache.dequantized(layer, 0, n, four)
            ks = cache.k_scale[layer].float().repeat_interleave(GROUP_K, dim=2)[:, :, :n]
            vs = cache.v_scale[layer, :, :, :n].float()  # stored per group as [D / 32, 64]
            vs = vs.view(1, H, n // GROUP_K, D // 32, GROUP_K).transpose(-1, -2).reshape(1, H, n, D // 32)
            vs = vs.repeat_interleave(32, dim=-1)
            f = 8.5 if four else 0.5
            assert ((kd - k[layer, :, :, :n]).abs() <= f * ks + 1e-2).all()
            assert ((vd - v[layer, :, :, :n]).abs() <= f * vs + 1e-2).all()
        kb = cache.buffer_k[layer, :, :, n - cache.buffer_start:600 - cache.buffer_start]  # the newest tokens: full precision (fp16)
        torch.testing.assert_close(kb.float(), k[layer, :, :, n:600], atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("seed", range(3))
def test_codes_do_not_depend_on_chunking_or_rollbacks(seed):
    """One by one, in random chunks, and with rejected drafts (random K/V) rolled back: identical codes
    and an identical buffer for the positions every cache still holds."""
    rng = random.Random(seed)
    n = 700
    k, v = _kv(n, seed)
    one = _cache()
    for i in range(n):
        _feed(one, k, v, i, i + 1)
    chunks, drafts = _cache(), _cache()
    i = 0
    while i < n:
        j = min(n, i + rng.randint(1, 150))
        _feed(chunks, k, v, i, j)
        i = j
    i = 0
    while i < n:
        j = min(n, i + rng.randint(1, 20))
        bad_k, bad_v = _kv(n + 40, seed + 100)
        _feed(drafts, bad_k, bad_v, i, min(i + rng.randint(1, 30), n + 20))  # a draft of up to 30, rejected
        drafts.rollback(i)
        _feed(drafts, k, v, i, j)
        i = j
    ref = _stored(one, one.quantized_groups)
    assert one.quantized_groups == fp_from(n - 1) // GROUP_K
    for cache in (chunks, drafts):
        # a draft past the end may have quantized one more group (of committed tokens only)
        assert cache.length == n and one.quantized_groups <= cache.quantized_groups <= one.quantized_groups + 1
        for name, t in _stored(cache, one.quantized_groups).items():
            assert torch.equal(t, ref[name]), name
        a = max(one.buffer_start, cache.buffer_start)
        assert torch.equal(cache.buffer_k[:, :, :, a - cache.buffer_start:n - cache.buffer_start], one.buffer_k[:, :, :, a - one.buffer_start:n - one.buffer_start])


def _attention_reference(cache: QuantizedCache, layer, q, k_fp, v_fp, positions, visible_new, scale,
                         integer: bool = True):
    """Brute force, one token, head and group at a time: each new token at position p reads keys j < fp_from(p)
    from the planes, the others at full precision (k_fp / v_fp [B, H, S, D]: the buffer's rounding, slot =
    position), every old key and the new ones `visible_new` says. integer: the cache's arithmetic (per group,
    the folded query rounded to 15 bits in two int8 parts against its largest element, p times the value scales rounded to int16
    per 32 channels: caches/quantized.py); else the plain float reading of the codes (dequantized)."""
    B, Hq, T, _ = q.shape
    g, S = Hq // H, k_fp.shape[2]
    nq = cache.quantized_groups * GROUP_K
    kc, ks, kz, vc, vs, vz = cache.group_codes(layer, 0, nq)
    kd, vd = cache.dequantized(layer, 0, nq)
    out = torch.empty(B, Hq, T, D)
    for t in range(T):
        qb = fp_from(int(positions[t]))
        vis = torch.ones(S, dtype=torch.bool)
        vis[S - T:] = visible_new[t]
        for h in range(Hq):
            hk = h // g
            qs = q[0, h, t].float() * scale
            s = torch.cat([kd[0, hk, :qb] @ qs, k_fp[0, hk, qb:] @ qs])
            if integer:
                for gi in range(qb // GROUP_K):
                    qg = qs * ks[0, hk, gi]
                    amax = float(qg.abs().max())
                    x = qg * (127.0 / amax) if amax > 0 else torch.zeros_like(qg)
                    iq = 254 * torch.round(x).double() + torch.round((x - torch.round(x)) * 254).double()
                    dots = ((kc[0, hk, gi].double() - 128) @ iq).float()  # exact integers
                    bias = (qs * (kz[0, hk, gi] + 128 * ks[0, hk, gi])).sum()
                    s[gi * GROUP_K:(gi + 1) * GROUP_K] = (amax / 127.0 / 254.0) * dots + bias
            s[~vis] = float("-inf")
            p = torch.softmax(s, -1)
            o = p[qb:] @ v_fp[0, hk, qb:]
            if not integer:
                out[0, h, t] = o + p[:qb] @ vd[0, hk, :qb]
                continue
            for gi in range(qb // GROUP_K):
                pg = p[gi * GROUP_K:(gi + 1) * GROUP_K]
                for c in range(D // 32):
                    pq = pg * vs[0, hk, gi, c]
                    mx = float(pq.max())
                    p16 = torch.round(pq * (32767.0 / mx)) if mx > 0 else torch.zeros_like(pq)
                    codes = vc[0, hk, gi, :, 32 * c:32 * c + 32].double()
                    o[32 * c:32 * c + 32] += ((mx / 32767.0) * (p16.double() @ codes) + float(pg @ vz[0, hk, gi, c])).float()
            out[0, h, t] = o
    return out


@pytest.mark.parametrize("tree", [False, True])
def test_attention_equals_brute_force(tree):
    _check_attention(tree, T=12)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("T,tree", [(1, False), (3, False), (5, False), (12, True)])
def test_kernel_equals_brute_force(kern, T, tree, bits):
    """The compiled quant_attention (each instruction set this CPU runs): decode steps (2 rows), 6 and 10 rows
    (one and two register tiles of scores), a 24-row tree block, the 8-bit and the 4-bit reading."""
    _check_attention(tree, T, ops=kern, bits=bits)


def _check_attention(tree: bool, T: int, ops=None, bits: int = 8):
    from triforce.caches.base import TokenBlock

    k, v = _kv(400, 3)
    cache = _cache(bits=bits)
    _feed(cache, k, v, 0, 380)
    positions = 380 + torch.arange(T)
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    block = None
    if tree:  # 3 chain tokens, then two branches of 4 and 5 nodes
        offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 7])
        visible = torch.zeros(T, T, dtype=torch.bool)
        visible[:, :3] = torch.ones(T, 3, dtype=torch.bool).tril()
        for a, b in ((3, 7), (7, 12)):
            visible[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        positions = 380 + offsets
        block = TokenBlock(offsets, visible)
    q = torch.randn(1, 2 * H, T, D)
    cache.prepare(T, block)
    outs = []
    for layer in range(L):
        kv = cache.update(layer, q, k[layer, :, :, 380:380 + T], v[layer, :, :, 380:380 + T])
        outs.append(kv.attend(q, 0.125, ops))
    fb = cache.buffer_start
    k_fp = [torch.cat([torch.zeros(1, H, fb, D), cache.buffer_k[layer, :, :, :380 + T - fb].float()], 2) for layer in range(L)]
    v_fp = [torch.cat([torch.zeros(1, H, fb, D), cache.buffer_v[layer, :, :, :380 + T - fb].float()], 2) for layer in range(L)]
    cache.commit(T)
    for layer in range(L):
        ref = _attention_reference(cache, layer, q, k_fp[layer], v_fp[layer], positions, visible, 0.125)
        torch.testing.assert_close(outs[layer], ref, atol=1e-4, rtol=1e-4)
        # the integer arithmetic stays close to the float reading of the same codes (and is not it)
        plain = _attention_reference(cache, layer, q, k_fp[layer], v_fp[layer], positions, visible, 0.125, False)
        err = (outs[layer] - plain).abs().max()
        assert 1e-7 < err < 2e-3, err


def test_kernel_without_vnni_computes_the_same_integers():
    """The quantized attention's integer dot products are exact, so an AVX-512 build without VNNI (vpmaddubsw on
    nibbles, vpmaddwd: Skylake-X) gives the VNNI build's results bit for bit: decode, verification and 64-row
    calls, both readings, every head dim (where this CPU has VNNI; elsewhere the default build is that one)."""
    from triforce import kernels

    if "avx512" not in kernels.runnable_isas() or not any("vnni" in f for f in kernels._optional_cflags("avx512")):
        pytest.skip("no AVX-512 VNNI here: the default AVX-512 build is the one without it")
    vnni, plain = kernels.variant("avx512"), kernels.variant("avx512", optional=False)
    if vnni is None or plain is None:
        pytest.skip("kernels unavailable")
    gen = torch.Generator().manual_seed(0)
    Hk, S, g = 2, 1024, 3
    for d in (64, 128, 256):
        def planes():
            return torch.randint(0, 256, (Hk, S, d // 2), dtype=torch.uint8, generator=gen)

        k_hi, k_lo, v_hi, v_lo = planes(), planes(), planes(), planes()
        ks, kz = (torch.rand(Hk, S // 64, d, generator=gen) * 0.05).half(), torch.randn(Hk, S // 64, d, generator=gen).half()
        vs, vz = (torch.rand(Hk, S, d // 32, generator=gen) * 0.05).half(), torch.randn(Hk, S, d // 32, generator=gen).half()
        fk, fv = torch.randn(Hk, 100, d, generator=gen).half(), torch.randn(Hk, 100, d, generator=gen).half()
        none = torch.empty(0, dtype=torch.uint8)
        for T in (1, 5, 21):
            q = torch.randn(Hk, g * T, d, generator=gen) * 3
            lim = torch.randint(S - 300, S + 1, (g * T,), generator=gen)
            fmask = torch.rand(T, 100, generator=gen) > 0.3
            for lo in ((k_lo, v_lo), (none, none)):
                a, b = (m.quant_attention(q, k_hi, lo[0], ks, kz, v_hi, lo[1], vs, vz, lim, fk, fv, fmask, T, d ** -0.5)
                        for m in (vnni, plain))
                assert torch.equal(a, b), (d, T, lo[0].numel())


def test_memory_is_bounded():
    """No full-precision copy of the cache: the buffer stays at the newest groups plus a forward, attention
    reads at most TILE tokens' codes at a time, and int8 / int4 take 55% / 30% of an fp16 cache's bytes (plus the buffer)."""
    n = 3000
    k, v = _kv(n, 1)
    cache = _cache(capacity=4096)
    seen = []
    group_codes = cache.group_codes
    cache.group_codes = lambda layer, a, b, four=False: seen.append(b - a) or group_codes(layer, a, b, four)
    for i in range(0, n, 50):
        _feed(cache, k, v, i, i + 50)
        q = torch.randn(1, 2 * H, 1, D)
        cache.prepare(1)
        cache.update(0, q, k[0, :, :, i + 49:i + 50], v[0, :, :, i + 49:i + 50]).attend(q, 0.125)
        cache.rollback(cache.length)  # the probe token is not committed
    assert max(seen) <= TILE and sum(seen) >= n - 3 * GROUP_K
    assert cache.buffer_k.shape[3] <= 3 * GROUP_K + cache.max_rollback + 50
    fp16 = 2 * L * H * 4096 * D * 2  # K and V of 4096 tokens in fp16
    buffer = 2 * cache.buffer_k.numel() * 2
    assert cache.nbytes() - buffer < 0.55 * fp16  # 8-bit codes, plus scales and zeros: 1.09 bytes per value
    four = _cache(capacity=4096, bits=4)
    assert four.nbytes() - 2 * four.buffer_k.numel() * 2 < 0.30 * fp16  # 4-bit codes: 0.59 bytes per value


def test_rollback_limit():
    """Rollback within max_rollback is O(1) (an integer and a group count); beyond what the buffer still
    holds, a clear error."""
    k, v = _kv(300)
    cache = _cache()
    for i in range(0, 300, 10):  # the buffer fills and drops its oldest groups
        _feed(cache, k, v, i, i + 10)
    assert cache.buffer_start > 0
    with pytest.raises(ValueError, match="max_rollback=32"):
        cache.rollback(300 - 129)
    cache.rollback(300 - 32)  # within max_rollback: O(1)
    assert cache.length == 268 and cache.quantized_groups == fp_from(299) // GROUP_K


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(hf_tiny("llama", seed=5, max_position_embeddings=1024))


@torch.no_grad()
def test_model_logits_do_not_depend_on_feeding(model):
    """Rejected drafts rolled back leave no trace (bit for bit: the same tokens fed the same way without
    them), and chunking does not change the quantization (against one 300-token forward: close, not
    bit-equal, since a many-row forward multiplies in another order and a key 1 ulp off can round to the
    neighbouring code: seen on an AMD Zen 5, 3.4e-4)."""
    c = model.cfg
    ids = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(0))
    whole = model(ids, QuantizedCache(c.n_layers, c.n_kv_heads, c.head_dim, 400))

    def fed(drafts: bool) -> torch.Tensor:
        cache = QuantizedCache(c.n_layers, c.n_kv_heads, c.head_dim, 400)
        parts = [model(ids[:, :70], cache), model(ids[:, 70:141], cache)]
        for i in range(141, 300):
            if drafts:
                model(torch.randint(0, 96, (1, 5)), cache)  # a rejected draft
                cache.rollback(i)
            parts.append(model(ids[:, i:i + 1], cache))
        return torch.cat(parts, 1)

    with_drafts = fed(True)
    assert torch.equal(with_drafts, fed(False))
    torch.testing.assert_close(with_drafts, whole, atol=2e-3, rtol=1e-3)
    full = model(ids, new_cache(model, 400))
    assert (whole - full).abs().max() < 0.1 * full.abs().max()  # close to fp32, not equal


@pytest.mark.parametrize("seed", range(3))
def test_tree_forward_and_keep_equal_plain_decoding(model, seed):
    """A draft tree scored in one forward equals decoding down each path; keep_path leaves the cache as
    plain decoding of the accepted path would (the prompt crosses group boundaries)."""
    from test_tree_forward import random_tree

    params = SamplingParams(temperature=1.0)
    rng = random.Random(seed)
    c = model.cfg
    prompt = [rng.randrange(96) for _ in range(185)]
    ctx = prompt + [rng.randrange(96) for _ in range(rng.randint(1, 3))]
    cache = QuantizedCache(c.n_layers, c.n_kv_heads, c.head_dim, 512, max_rollback=48)
    prefill(model, cache, torch.tensor([prompt]), 64)
    state = ModelState("int8", model, cache, params)
    state.fed, state.stable = list(prompt), len(prompt)
    before = copy.deepcopy(state)
    tree = random_tree(rng, max_depth=8, max_width=4)
    rows = state.score(ctx, len(prompt), tree).probs
    for vertex in range(len(tree) + 1):
        path = [tree.tokens[i] for i in tree.path_to(vertex - 1)]
        ref = copy.deepcopy(before).score(ctx + path, len(prompt), []).probs[-1]
        torch.testing.assert_close(rows[vertex], ref, atol=2e-5, rtol=1e-4)
    leaves = [i for i in range(len(tree)) if not tree.children[i + 1]]
    path = tree.path_to(rng.choice(leaves))[: rng.randint(0, 8)]
    state.keep_path(path)
    nxt = ctx + [tree.tokens[i] for i in path] + [rng.randrange(96)]
    torch.testing.assert_close(state.score(nxt, len(prompt), []).probs[-1],
                               copy.deepcopy(before).score(nxt, len(prompt), []).probs[-1],
                               atol=2e-5, rtol=1e-4)


def test_a_prefilled_prompt_comes_back_after_generations(model):
    """PrefilledPrompt over an int8 cache: the buffer grows inside a forward (inference mode) and later
    generations drop its old groups; restore() still brings back the prompt exactly (and in place, outside
    inference mode), so every run from it gives the same tokens as a run from scratch."""
    from triforce.generate import generate
    from triforce.speculation.settings import SpecConfig
    from triforce.speculation.state import PrefilledPrompt

    m = copy.copy(model)
    m.kv_dtype = "int8"
    prompt = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = SpecConfig(gamma=3, budget=48, chunk_size=8, recent=8, rebuild_every=16, prefill_chunk=128)
    pre = PrefilledPrompt(m, prompt, 300 + 200 + 8, chunk_size=128)
    ref = generate(m, prompt, 150, method="ar", config=cfg).tokens
    for method in ("ar", "quantspec", "ar"):
        assert generate(m, prompt, 150, method=method, config=cfg, prefilled=pre).tokens == ref
