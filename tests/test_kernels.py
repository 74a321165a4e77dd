"""The compiled CPU kernels against PyTorch's operations, for every variant this CPU can execute
(AVX-512 machines run both the AVX-512 and the AVX2 build; skipped where none can be built)."""
from __future__ import annotations

import pytest
import torch

from triforce import execution, kernels
from triforce.caches.base import DenseKV, SlotKV
from triforce.caches import new_cache
from triforce.loading.weights import draft_weights

from conftest import hf_tiny, ours_from_hf

# S = 1500 is not a multiple of the kernel's 256-key blocks; with S = 1282 and T = 4 the last block
# holds only new tokens 2 and 3, so it is fully masked for tokens 0 and 1. With Hq / Hkv = 3, T >= 3
# (9+ rows) runs the rows-in-lanes path; T = 7 and 11 need two and three 16-row vectors.
@pytest.mark.parametrize("T, mask_kind, S", [(1, None, 1500), (2, "causal", 1500), (4, "causal", 1500),
                                             (4, "causal", 1282), (7, "causal", 1282), (11, "causal", 1500),
                                             (2, "bool", 1500), (1, "bool", 1500), (4, "tree", 1282),
                                             (7, "tree", 1282), (11, "tree", 1500), (21, "tree", 1300),
                                             (30, "causal", 1500), (30, "tree", 1300)])
def test_kernel_matches_sdpa(kern, T, mask_kind, S):
    torch.manual_seed(0)
    Hq, Hkv, D, cap = 6, 2, 64, 1600
    q = torch.randn(1, Hq, T, D)
    k_store, v_store = torch.randn(1, Hkv, cap, D), torch.randn(1, Hkv, cap, D)
    k, v = k_store[:, :, :S], v_store[:, :, :S]  # strided like a cache slice
    if mask_kind == "tree":  # a random draft tree: each token sees itself and its ancestors
        kv = SlotKV(k, v, _random_tree_block(T))
    elif mask_kind == "bool":
        mask = torch.rand(T, S) < 0.7
        mask[:, 0] = True
        kv = DenseKV(k, v, mask)
    else:  # a chain (one token: every key)
        kv = SlotKV(k, v)
    assert T <= execution.KERNEL_MAX_ROWS
    counting = _Counting(kern)
    got = execution.attention(q, kv, ops=counting)
    # the kernel really ran (bool masks stay on PyTorch's path: the StreamingLLM cache hands the kernel a WindowGap
    # instead, test_kv.py; a tree's token block takes the kernel's causal path with its own visibility)
    # (more than KERNEL_MAX_ROWS rows per KV head, 3 * 30 here: two query heads of each group in one call, one in a second)
    assert counting.calls == (0 if mask_kind == "bool" else 1 if Hq // Hkv * T <= execution.KERNEL_MAX_ROWS else 2)
    want = execution.attention(q, kv, ops=None)  # PyTorch's path
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _random_tree_block(T: int, seed: int = 0):
    """A TokenBlock of T tokens in a random tree (token 0 the root, each later one a child of an
    earlier one): visible[t][u] iff u is t or an ancestor of t."""
    from triforce.caches.base import TokenBlock

    gen = torch.Generator().manual_seed(seed + T)
    parent = [-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, T)]
    visible = torch.eye(T, dtype=torch.bool)
    depth = [0] * T
    for t in range(1, T):
        visible[t] |= visible[parent[t]]
        depth[t] = depth[parent[t]] + 1
    assert not torch.equal(visible, torch.ones(T, T, dtype=torch.bool).tril())  # a tree, not a chain
    return TokenBlock(torch.tensor(depth), visible)


class _Counting:
    """The kernel module, counting calls to its functions."""

    def __init__(self, kern):
        self.kern, self.calls = kern, 0

    def __getattr__(self, name):
        fn = getattr(self.kern, name)
        if not callable(fn):  # the module's constants (HALF_KV, PACKED_MANY_ROWS) as they are
            return fn

        def counted(*a, **kw):
            self.calls += 1
            return fn(*a, **kw)
        return counted



@pytest.mark.parametrize("T", [1, 3, 5, 7, 21])
def test_kernel_paths_agree(kern, T):
    """The per-row and rows-in-lanes paths (forced) both match SDPA for any row count, including a
    last block of a few keys and tokens whose last block is fully masked."""
    import torch.nn.functional as F

    from triforce.caches.base import causal_mask

    torch.manual_seed(1)
    Hkv, g, D, S = 3, 3, 64, 2 * 256 + 3 + T
    q = torch.randn(Hkv, g * T, D)  # rows are (group head, token)
    k, v = torch.randn(Hkv, S, D) * 2, torch.randn(Hkv, S, D)
    mask = causal_mask(T, S - T, "cpu").repeat(g, 1) if T > 1 else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for path in (1, 2):
        got = kern.decode_attention(q, k, v, T, T > 1, D ** -0.5, path)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layer_ops_match_pytorch(kern):
    """The fused RMSNorm, RoPE + head split, and SiLU-gate against the PyTorch operations they
    replace (odd sizes exercise the scalar tails)."""
    import torch.nn.functional as F

    from triforce.rope import apply_rotary

    torch.manual_seed(2)
    x, w = torch.randn(2, 5, 100), torch.randn(100)
    torch.testing.assert_close(kern.rms_norm(x, w, 1e-5), F.rms_norm(x, (100,), w, 1e-5), rtol=1e-5, atol=1e-6)
    B, T, Hq, Hkv, D = 2, 3, 4, 2, 16
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D)
    cos, sin = torch.randn(T, D), torch.randn(T, D)
    q, k, v = kern.rope_split(qkv, cos, sin, Hq, Hkv)
    q0, k0, v0 = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    torch.testing.assert_close(q, apply_rotary(q0.view(B, T, Hq, D), cos, sin).transpose(1, 2))
    torch.testing.assert_close(k, apply_rotary(k0.view(B, T, Hkv, D), cos, sin).transpose(1, 2))
    torch.testing.assert_close(v, v0.view(B, T, Hkv, D).transpose(1, 2))
    gu = torch.randn(3, 2 * 37) * 30  # large |x|: exp under- and overflow
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(kern.silu_mul(gu), F.silu(g) * u, rtol=1e-5, atol=1e-5)


def test_model_forward_same_with_and_without_kernels(kern, tiny_llama):
    """A whole forward (a prefill chunk, then one decode step) agrees with the PyTorch-only forward.
    (test_model_parity compares the kernel path with transformers, for every architecture.)"""
    tokens = torch.randint(0, tiny_llama.cfg.vocab_size, (1, 9))
    out = {}
    for name, module in (("kernels", _Counting(kern)), ("torch", None)):
        cache = new_cache(tiny_llama, 16)
        with torch.inference_mode(), kernels.override(module):
            a = tiny_llama(tokens[:, :8], cache)
            b = tiny_llama(tokens[:, 8:], cache)
        out[name] = torch.cat([a, b], dim=1)
        if module is not None:
            assert module.calls > 0  # the fused ops really ran
    torch.testing.assert_close(out["kernels"], out["torch"], rtol=1e-4, atol=1e-4)


def test_linear_panels_match_linear(kern):
    """The panel kernel (fp32 and bf16 weights) against F.linear, for 1..17 rows and output sizes
    that are not multiples of 16; a row's result does not depend on the other rows."""
    import torch.nn.functional as F

    torch.manual_seed(3)
    lin = execution.Linear(40, 37, bias=True)
    lin.backend = kernels.Backend(True)  # as a built model's layers have it
    lin.pack()
    assert lin.panels is not None and lin.panels.dtype == torch.float32
    x = torch.randn(17, 40)
    for rows in (1, 3, 7, 8, 9, 16):
        with kernels.override(_Counting(kern)):
            got = lin(x[:rows])
        torch.testing.assert_close(got, F.linear(x[:rows], lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(got[:1], lin(x[:1]))  # batch-invariant: verification rows equal decode rows
    low = execution.Linear(40, 37, bias=False)
    low.backend = kernels.Backend(True)
    low.pack(torch.bfloat16)
    want = F.linear(x[:5], low.weight.to(torch.bfloat16).float())
    torch.testing.assert_close(low(x[:5]), want, rtol=1e-5, atol=1e-5)


def test_other_python_threads_run_while_a_kernel_computes(kern):
    """The kernels release the GIL: while one runs (here a panel GEMM of 8.6 GFLOP, tens of ms), another thread
    runs Python (a serving batch's forward must not stop the server's event loop and the other requests). A
    kernel holding the GIL would let it record nothing in the middle half of the call."""
    import threading
    import time

    x, panels = torch.randn(256, 4096), torch.randn(256, 4096, 16)
    stamps, stop = [], threading.Event()

    def stamp():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    other = threading.Thread(target=stamp)
    other.start()
    try:
        time.sleep(0.02)
        t0 = time.perf_counter()
        kern.linear_panels(x, panels, 4096)
        t1 = time.perf_counter()
    finally:
        stop.set()
        other.join()
    quarter = (t1 - t0) / 4
    assert any(t0 + quarter < t < t1 - quarter for t in stamps)


def test_draft_weights_model(kern, tiny_llama):
    """draft_weights(): bf16 panels in every linear layer of the copy, the original untouched,
    and logits close to (but not equal to) the fp32 model's."""
    draft = draft_weights(tiny_llama)
    assert draft is not tiny_llama and draft.embed is tiny_llama.embed
    lin = [m for m in draft.modules() if isinstance(m, execution.Linear)]
    assert lin and all(m.panels is not None and m.panels.dtype == torch.bfloat16 for m in lin)
    assert all(m.panels is None or m.panels.dtype == torch.float32
               for m in tiny_llama.modules() if isinstance(m, execution.Linear))
    tokens = torch.randint(0, tiny_llama.cfg.vocab_size, (1, 6))
    with torch.inference_mode():
        a = tiny_llama(tokens, new_cache(tiny_llama, 8))
        b = draft(tokens, new_cache(draft, 8))
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("T", [1, 5, 11])  # 11: 33 rows, three groups of 16 on AMX's tiles
def test_kernel_kv_dtypes_and_head_dims(kern, kv_dtype, D, T):
    """K/V stored in fp32, bf16 or fp16 are widened in registers: the result equals fp32 attention
    over the rounded values (the same numbers PyTorch would see after casting); head dims 64-256. Over bf16
    K/V the scaled queries are rounded to bf16 first (the bf16 arithmetic) on every path, AMX's tiles (path 3)
    where this machine has them."""
    import torch.nn.functional as F

    from triforce.caches.base import causal_mask

    torch.manual_seed(4)
    Hkv, g = 2, 3
    S = 3 * (16384 // D) + 5 + T  # three full blocks and a short one
    q = torch.randn(Hkv, g * T, D)
    k, v = (torch.randn(Hkv, S, D) * 2).to(kv_dtype), torch.randn(Hkv, S, D).to(kv_dtype)
    mask = causal_mask(T, S - T, "cpu").repeat(g, 1) if T > 1 else None
    if kv_dtype == torch.bfloat16:
        from triforce.execution import bf16_attention

        q4 = q.view(Hkv, g, T, D).reshape(1, Hkv * g, T, D)
        want = bf16_attention(q4, k[None], v[None], causal_mask(T, S - T, "cpu") if T > 1 else None,
                              D ** -0.5).view(Hkv, g * T, D)
        fp32 = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask)
        assert _agreement(fp32, want) < 0.5  # fp32 arithmetic is told apart by the check below
    else:
        want = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask)
    paths = (1, 2, 3) if kv_dtype == torch.bfloat16 and kern.amx_attention() else (1, 2)
    for path in paths:
        got = kern.decode_attention(q, k, v, T, T > 1, D ** -0.5, path)
        if kv_dtype == torch.bfloat16:  # sums in another order may move a rounded p by one bf16 step
            assert _agreement(got, want) >= 0.9 and (got - want).abs().max() < 1e-3
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def _agreement(got, want):
    """The fraction of output rows [..., D] whose every value agrees to the last bits of fp32 (a few ulp)."""
    return ((got - want).abs() <= 1e-6 + 4e-6 * want.abs()).all(-1).float().mean().item()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_rows_attention_does_not_depend_on_the_rows_beside_it(kern, kv_dtype):
    """path 0 (the model's) gives each query row the same bits whatever rows come with it, at every row count up to
    the kernel's 64: a verification's rows are then exactly the decode step's, and greedy output exactly ar's. Path 0
    is the per-row arithmetic (paths 1 and 4), or over bf16 K/V where attention_dot_every_row says so the dot-product
    one (path 2) at every row count; the other arithmetic sums in another order and is told apart here."""
    dot = kv_dtype == torch.bfloat16 and kern.bf16_dot_attention()
    dot_rows = kv_dtype == torch.bfloat16 and kern.attention_dot_every_row()
    m = kern.attention_lanes_min_rows(dot)
    most = kern.attention_chain_rows() if dot_rows else 64  # a prefill chain's calls: 256 rows on dot products
    torch.manual_seed(6)
    H, S, D = 2, 700, 64
    k, v = (torch.randn(H, S, D) * 2).to(kv_dtype), torch.randn(H, S, D).to(kv_dtype)
    q = torch.randn(H, most, D)
    alone = kern.decode_attention(q[:, :1], k, v, 1, False, D ** -0.5, 0)
    for rows in sorted({2, 3, m - 1, m, 9, 12, 15, 16, 24, 30, 64, 65, 100, most}):
        if rows > most:
            continue
        out = kern.decode_attention(q[:, :rows], k, v, 1, False, D ** -0.5, 0)
        assert torch.equal(out[:, :1], alone), rows
        for path in (2,) if dot_rows else (1, 4) if rows <= 64 else ():
            assert torch.equal(out, kern.decode_attention(q[:, :rows], k, v, 1, False, D ** -0.5, path)), (rows, path)
    with pytest.raises(RuntimeError, match=f"at most {most} rows"):
        kern.decode_attention(torch.randn(H, most + 1, D), k, v, 1, False, D ** -0.5, 0)
    if kv_dtype != torch.float32:
        other = 1 if dot_rows else 3 if kv_dtype == torch.bfloat16 and kern.amx_attention() else 2
        assert not torch.equal(kern.decode_attention(q[:, :m], k, v, 1, False, D ** -0.5, other),
                               kern.decode_attention(q[:, :m], k, v, 1, False, D ** -0.5, 0))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_row_of_a_verification_is_the_decode_step_over_its_own_keys(kern, kv_dtype):
    """A causal forward of T tokens gives token t's rows exactly what a one-token forward over the keys up to t
    gives, bit for bit, wherever the blocks of keys end (a block of the verification may run on past a row's last
    key, masked, where the decode step's block ends at it): greedy speculation is then exactly ar."""
    torch.manual_seed(7)
    H, D, g = 3, 64, 3
    for S in (1024, 1000, 517, 40):
        k, v = (torch.randn(H, S, D) * 2).to(kv_dtype), torch.randn(H, S, D).to(kv_dtype)
        # 15 and 30 rows: path 0 computes the scores rows-in-lanes (exact_rows); 120 and 255 rows: a prefill chain's
        # calls over a bf16 cache on dot products (attention_chain_rows), 64 rows at a time per block
        more = (40, 85) if kv_dtype == torch.bfloat16 and kern.attention_dot_every_row() and S > 85 else ()
        for T in (2, 4, 5, 7, 10, 17) + more:
            q = torch.randn(H, g, T, D)
            out = kern.decode_attention(q.reshape(H, g * T, D), k, v, T, True, D ** -0.5, 0).view(H, g, T, D)
            for t in range(T):
                n = S - T + t + 1
                one = kern.decode_attention(q[:, :, t].contiguous(), k[:, :n].contiguous(), v[:, :n].contiguous(), 1,
                                            False, D ** -0.5, 0)
                assert torch.equal(out[:, :, t], one), (S, T, t)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16"])
def test_a_prompt_s_cache_and_logits_do_not_depend_on_how_its_prefill_is_chunked(kern, kv_dtype):
    """Where long chains run through the kernel (execution/attention.py, _kernel_chains: a bf16 cache on dot products),
    a prompt prefilled in one chunk, in chunks of 64, 21 or 5 tokens, or one token at a time (decode steps) leaves the
    same cache, bit for bit, and the same last logits: a token's rows are the decode step's wherever it came. Elsewhere
    chunks of more than 21 tokens take PyTorch's flash kernel (faster there), and the check is shown to fail."""
    from triforce.execution.attention import _kernel_chains
    from triforce.speculation.state import prefill

    model = ours_from_hf(hf_tiny("llama", seed=3, hidden_size=192, num_attention_heads=3, num_key_value_heads=1))
    tokens = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(5))
    runs = []
    for chunk in (150, 64, 21, 5, 1):
        cache = new_cache(model, 160, dtype=kv_dtype)
        with torch.inference_mode(), kernels.override(kern):
            logits = prefill(model, cache, tokens, chunk)
        runs.append((chunk, logits, cache.k[..., :150, :], cache.v[..., :150, :]))
    steps = runs[-1]  # one token at a time: decode steps
    same = [torch.equal(k, steps[2]) and torch.equal(v, steps[3]) and torch.equal(logits, steps[1])
            for _, logits, k, v in runs[:-1]]
    if _kernel_chains(torch.zeros(1, 3, 1, 64), runs[0][2][0], kern):
        assert all(same), same
    else:  # the flash kernel's sums for the one 150-token chunk; chunks of 64 tokens or fewer are the kernel's
        assert same == [False, True, True, True], same


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_scores_in_lanes_in_the_per_row_order_are_the_per_row_paths_bits(kern, kv_dtype, D):
    """Path 4 (scores_exact: the per-row path's sums of each score, computed with the rows in a vector's lanes, then
    transposed) gives exactly path 1's bits for every row count, head dim, dtype and mask: causal chains, a draft
    tree's token block, a StreamingLLM gap, blocks cut short (S not a multiple of the block or of the vector). Path 0
    takes it where exact_rows says so; the lanes path (2), which sums in another order, is told apart."""
    torch.manual_seed(11)
    H = 2
    for S, T, rows in ((700, 1, (1, 12, 15, 16, 17, 31, 64)), (517, 5, (15, 30, 60)), (1000, 4, (12, 16, 48)),
                       (41, 3, (9, 15, 33)), (300, 13, (13, 39))):
        k, v = (torch.randn(H, S, D) * 2).to(kv_dtype), torch.randn(H, S, D).to(kv_dtype)
        for R in rows:
            q = torch.randn(H, R, D)
            masks = [dict(causal=T > 1)]
            if T > 1:
                masks.append(dict(causal=True, visible=_random_tree_block(T).visible))
                gap = torch.tensor([4] + [min(S - T + t, 4 + 30 + 7 * t) for t in range(T)], dtype=torch.long)
                masks.append(dict(causal=True, gap=gap))
            for mask in masks:
                causal = mask.pop("causal")
                per_row = kern.decode_attention(q, k, v, T, causal, D ** -0.5, 1, **mask)
                exact = kern.decode_attention(q, k, v, T, causal, D ** -0.5, 4, **mask)
                assert torch.equal(exact, per_row), (S, T, R, list(mask))
                if kern.attention_exact_rows(R):
                    assert torch.equal(kern.decode_attention(q, k, v, T, causal, D ** -0.5, 0, **mask), exact)
    if kv_dtype != torch.float32:  # the check can fail: another order of sums differs in the last bits
        q = torch.randn(H, 15, D)
        assert not torch.equal(kern.decode_attention(q, k, v, 1, False, D ** -0.5, 2),
                               kern.decode_attention(q, k, v, 1, False, D ** -0.5, 4))


def test_exact_rows_where_measured_faster(kern):
    """Path 0 computes scores rows-in-lanes only in the AVX-512 build, off AMD's CPUs (where broadcast FMAs ran at
    half rate and it was not measured), and only for row counts that nearly fill the vectors' lanes."""
    from triforce.kernels.build import cpu_vendor

    chosen = [r for r in range(1, 65) if kern.attention_exact_rows(r)]
    if kern.ISA == "avx2" or cpu_vendor() == "AuthenticAMD":
        assert chosen == []
    else:
        assert chosen == [r for r in range(12, 65) if r % 16 == 0 or r % 16 >= 12]


def test_vector_peak_is_this_builds_own(kern):
    """vector_peak_flops (decode_step's "of peak"): a rate for this build's FMAs, and for AVX512-BF16's dot products
    only where the build has them (0.0 on the others: never an illegal instruction)."""
    assert kern.vector_peak_flops(False) > 1e9
    dot = kern.vector_peak_flops(True)
    if kern.ISA == "avx2":
        assert dot == 0.0
    elif kern.bf16_dot_attention() and not kern.amx_attention():  # dot products without tiles: vdpbf16ps
        assert dot > 1e9
    else:
        assert dot == 0.0 or dot > 1e9
    # the linear layers' integer dot products (prefill_profile's linear peak): vpdpbusd only where the build has VNNI,
    # which is where prefill chunks take the packed kernel (PACKED_PREFILL)
    assert (kern.integer_peak_ops() > 1e9) == kern.PACKED_PREFILL
    assert kern.integer_peak_ops() >= 0.0


def test_kernel_amx_path_refused_where_unusable(kern):
    """path 3 (AMX tiles) is taken only for bf16 K/V where the tiles are usable; otherwise a clear error."""
    q, k = torch.randn(1, 16, 64), torch.randn(1, 2048, 64)
    with pytest.raises(RuntimeError, match="path 3 needs bf16 K/V and AMX"):
        kern.decode_attention(q, k, k, 1, False, 0.125, 3)  # fp32 K/V
    if not kern.amx_attention():
        with pytest.raises(RuntimeError, match="path 3 needs bf16 K/V and AMX"):
            kern.decode_attention(q, k.bfloat16(), k.bfloat16(), 1, False, 0.125, 3)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [3, 9])
def test_kernel_tree_block_both_paths(kern, kv_dtype, T):
    """A draft tree's token block (its tokens the last T keys, straddling a 256-key block boundary) on
    the per-row and the rows-in-lanes paths (forced; AMX's tiles too for bf16 where usable) against SDPA with
    the block's dense [T, S] mask (bf16: execution.bf16_attention with it)."""
    import torch.nn.functional as F

    from triforce.execution import bf16_attention

    torch.manual_seed(5)
    Hkv, g, D = 3, 3, 64
    S = 512 + T // 2  # the new tokens cross the boundary at 512
    block = _random_tree_block(T, seed=1)
    q = torch.randn(Hkv, g * T, D)
    k, v = (torch.randn(Hkv, S, D) * 2).to(kv_dtype), torch.randn(Hkv, S, D).to(kv_dtype)
    if kv_dtype == torch.bfloat16:
        q4 = q.view(Hkv, g, T, D).reshape(1, Hkv * g, T, D)
        want = bf16_attention(q4, k[None], v[None], block.mask(S - T), D ** -0.5).view(Hkv, g * T, D)
    else:
        want = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=block.mask(S - T).repeat(g, 1))
    paths = (1, 2, 3) if kv_dtype == torch.bfloat16 and kern.amx_attention() else (1, 2)
    for path in paths:
        got = kern.decode_attention(q, k, v, T, True, D ** -0.5, path, visible=block.visible)
        if kv_dtype == torch.bfloat16:
            assert _agreement(got, want) >= 0.9 and (got - want).abs().max() < 1e-3
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    causal = kern.decode_attention(q, k, v, T, True, D ** -0.5, 1)
    assert not torch.allclose(causal, want, rtol=1e-3, atol=1e-3)  # the visibility was used


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_draft_tree_s_rows_are_the_decode_step_s_bits_over_their_own_keys(kern, kv_dtype):
    """Each token of a draft tree's block gets exactly the bits of the decode step that will read its keys once its
    branch is accepted: the prompt's keys, then its ancestors' and its own, moved up (no sibling between them). Trees
    of 4 and 9 tokens whose block starts anywhere within the vector and the 256-key block (a later branch's keys then
    fall in other lanes, pairs and blocks than where they lie), head dims 64 and 128, on what the model runs (path 0)
    and on the per-row path (1). Before the kernel computed a branch's rows again over its own keys, 15-37 of 40 such
    trees differed from the decode step, and a greedy tree at a near-tie could pick another token than `ar`."""
    H, g = 2, 3
    for D in (64, 128):
        for S in (256 + 5, 256 + 11, 512 + 2, 512 + 16, 512 + 17, 700):
            for T in (4, 9):
                block = _random_tree_block(T, seed=S % 7)
                gen = torch.Generator().manual_seed(S * T + D)
                k = (torch.randn(H, S, D, generator=gen) * 2).to(kv_dtype)
                v = torch.randn(H, S, D, generator=gen).to(kv_dtype)
                q = torch.randn(H, g * T, D, generator=gen)
                for path in (0, 1):
                    tree = kern.decode_attention(q, k, v, T, True, D ** -0.5, path, visible=block.visible)
                    for t in range(T):
                        keys = torch.cat([torch.arange(S - T), S - T + torch.nonzero(block.visible[t])[:, 0]])
                        step = kern.decode_attention(q.view(H, g, T, D)[:, :, t].contiguous(), k[:, keys].contiguous(),
                                                     v[:, keys].contiguous(), 1, False, D ** -0.5, path)
                        assert torch.equal(tree.view(H, g, T, D)[:, :, t], step), (D, S, T, path, t)


def test_kernel_rejects_what_it_cannot_do(kern):
    q, k = torch.randn(2, 3, 64), torch.randn(2, 300, 64)
    with pytest.raises(RuntimeError, match="k and v of one dtype"):
        kern.decode_attention(q, k, k.half(), 1, False, 0.125, 0)
    with pytest.raises(RuntimeError, match="head dim"):
        kern.decode_attention(torch.randn(2, 3, 96), torch.randn(2, 300, 96), torch.randn(2, 300, 96), 1, False, 0.1, 0)
    with pytest.raises(RuntimeError, match="visible must be"):
        kern.decode_attention(torch.randn(2, 6, 64), k, k, 2, True, 0.1, 0, visible=torch.ones(3, 3, dtype=torch.bool))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_chunk_scores_match_pytorch(kern, kv_dtype, D):
    """The retrieval cache's chunk scores (q . each chunk's mean key) against PyTorch's widened copy, sum and product,
    over keys that are a slice of a longer buffer (as a cache's are), with keys past the last whole chunk ignored;
    and the retrieval cache scores through it (caches.retrieval.chunk_scores)."""
    from types import SimpleNamespace

    from triforce.caches import retrieval

    torch.manual_seed(5)
    H, N, c = 3, 1003, 8
    buf = torch.randn(1, H, N + 40, D).to(kv_dtype)
    keys = buf[:, :, :N]  # head stride (N + 40) D
    q = torch.randn(1, H, D)
    n = N // c * c
    want = torch.einsum("bhd,bhnd->bhn", q, keys[:, :, :n].float().reshape(1, H, n // c, c, D).sum(dim=3) / c)
    got = kern.chunk_scores(keys[0], q[0], c)
    assert got.shape == (H, N // c)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-4)
    calls = []

    def spy(*args):
        calls.append(args)
        return kern.chunk_scores(*args)
    with kernels.override(SimpleNamespace(chunk_scores=spy)):
        torch.testing.assert_close(retrieval.chunk_scores(keys[:, :, :n], q, c), want, rtol=1e-5, atol=1e-4)
    assert len(calls) == 1
    with kernels.override(None):  # PyTorch's
        torch.testing.assert_close(retrieval.chunk_scores(keys[:, :, :n], q, c), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="head dim"):
        kern.chunk_scores(torch.randn(H, 64, 96), torch.randn(H, 96), c)


ZEN3 = frozenset("fpu sse2 avx avx2 fma f16c bmi1 bmi2 aes".split())  # AVX2 + FMA, no AVX-512
SPR = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"}


def test_isa_choice(monkeypatch):
    """auto picks the best the CPU runs; an explicit choice is honoured when the CPU runs it and
    refused with what the CPU has otherwise (never an illegal instruction); off and unknown values."""
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("TRIFORCE_KERNELS", raising=False)
    for value, flags, want in [("auto", SPR, "avx512"), ("auto", ZEN3, "avx2"), ("", ZEN3, "avx2"),
                               ("avx2", SPR, "avx2"), ("AVX512", SPR, "avx512"), ("off", SPR, None),
                               ("auto", frozenset({"sse2", "avx"}), None)]:
        monkeypatch.setenv("TRIFORCE_ISA", value)
        assert kernels.chosen_isa(flags) == want, (value, want)
    monkeypatch.setenv("TRIFORCE_ISA", "avx512")
    with pytest.raises(kernels.KernelChoiceError, match=r"lacks avx512f.*it has: avx, avx2.*TRIFORCE_ISA=avx2"):
        kernels.chosen_isa(ZEN3)
    monkeypatch.setenv("TRIFORCE_ISA", "neon")
    with pytest.raises(kernels.KernelChoiceError, match="not one of auto, avx512, avx2, off"):
        kernels.chosen_isa(SPR)
    monkeypatch.setenv("TRIFORCE_ISA", "auto")
    monkeypatch.setenv("TRIFORCE_KERNELS", "0")
    assert kernels.chosen_isa(SPR) is None


def test_isa_refusal_is_a_clear_cli_message(tmp_path):
    """The CLI turns a refused TRIFORCE_ISA into one line and exit code 2, no traceback."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRIFORCE_ISA="sse9")
    r = subprocess.run([sys.executable, "-m", "triforce", "generate", "--prompt", "hi", "--max-new-tokens", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "TRIFORCE_ISA='sse9' is not one of auto, avx512, avx2, off" in r.stderr


QUANT_CASES = {  # name: (head dim, bits, buffer dtype, new tokens, tree, shared planes)
    "decode": (64, 8, torch.float16, 1, False, False),
    "verify": (64, 8, torch.float16, 5, False, False),
    "rows-64": (64, 8, torch.float16, 21, False, False),
    "tree": (64, 8, torch.float16, 9, True, False),
    "4-bit": (64, 4, torch.float16, 3, False, False),
    "bf16-buffer": (128, 8, torch.bfloat16, 2, False, False),
    "fp32-buffer": (256, 8, torch.float32, 1, False, False),
    "kv4-over-int8": (64, 8, torch.float16, 4, False, True),
    "prefill-chunk": (64, 8, torch.float16, 50, False, False),  # 150 rows: three calls of at most 64
}


@pytest.mark.parametrize("case", QUANT_CASES)
def test_quant_attention_matches_pytorch(kern, case):
    """kernels' quant_attention (integer dot products on the planes, a group at a time) equals the quantized cache's
    PyTorch attention (tile by tile, the same arithmetic): 8-bit and 4-bit readings, chains, trees, every buffer
    dtype and head dim, a kv4 cache reading an int8 cache's upper planes, and a prefill chunk of more rows than
    one call takes."""
    from triforce.caches.base import TokenBlock
    from triforce.caches.quantized import QuantizedCache

    D, bits, dtype, T, tree, shared = QUANT_CASES[case]
    torch.manual_seed(1)
    H, g, S = 2, 3, 1290
    cache = QuantizedCache(1, H, D, 1500, bits=bits, dtype=dtype, max_rollback=32)
    k, v = torch.randn(1, H, S + T, D) * (1 + 4 * (torch.arange(D) % 11 == 0)), torch.randn(1, H, S + T, D)
    for a in range(0, S, 300):  # the buffer fills and drops its oldest groups on the way
        b = min(S, a + 300)
        cache.prepare(b - a)
        cache.update(0, None, k[:, :, a:b], v[:, :, a:b])
        cache.commit(b - a)
    if shared:
        view = QuantizedCache(1, H, D, 1500, max_rollback=32, shared=cache)
        view.build(cache)
        cache = view
    block = None
    if tree:  # 2 chain tokens, then branches of 3 and 4 nodes
        offsets = torch.tensor([0, 1, 2, 3, 4, 2, 3, 4, 5])
        visible = torch.zeros(T, T, dtype=torch.bool)
        visible[:, :2] = torch.ones(T, 2, dtype=torch.bool).tril()
        for a, b in ((2, 5), (5, 9)):
            visible[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        block = TokenBlock(offsets, visible)
    q = torch.randn(1, H * g, T, D)
    cache.prepare(T, block)
    kv = cache.update(0, q, k[:, :, S:S + T], v[:, :, S:S + T])
    assert int(cache._qb.max()) >= 1024 and cache.buffer_start > 0
    counting = _Counting(kern)
    got = kv.attend(q, D ** -0.5, counting)
    assert counting.calls == -(-T // (64 // g))
    want = kv.attend(q, D ** -0.5, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
