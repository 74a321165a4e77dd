"""KV cache dtype (--kv-dtype for the target's cache, --draft-kv-dtype for the drafting caches).
int8 is the quantized layout of caches/quantized.py (tests/test_quantized_kv.py tests the cache itself).

A target whose cache stores K/V in bf16 or fp16 is another model than with fp32, but one model: `ar` and
every stack read the same cache dtype, so greedy output of every stack equals `ar`'s within a setting,
on the compiled kernels (where they build) and on PyTorch's path. The drafting levels (retrieval,
streaming, a small draft model) use their own, cheaper dtype; the full level the target's. Bad values are
clear errors naming the valid ones."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce import execution, kernels
from triforce.bench.hardware import floor_seconds, weight_bytes
from triforce.bench.methods import level_floor_ms
from triforce.caches import RetrievalCache, SlidingWindowCache
from triforce.caches.base import SlotKV, kv_dtype
from triforce.cli import build_parser
from triforce.caches.quantized import QuantizedCache
from triforce.config import DEFAULT_DRAFT_KV_DTYPE, FLOAT_KV_DTYPES, KV_DTYPES, ModelConfig, kv_dtype_name
from triforce.errors import TriforceError
from triforce.generate import generate, generate_ar
from triforce.loading import build_model, load_model
from triforce.sampling import SamplingParams, make_generator
from triforce.speculation.settings import SpecConfig
from triforce.speculation.builder import BuiltStack
from triforce.speculation.stack import StackSpec
from triforce.caches import new_cache

TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
SPEC = SpecConfig(gamma=4, gamma_draft=2, budget=48, chunk_size=8, recent=8, rebuild_every=16, sink=4, window=16,
                  ngram=3, prefill_chunk=64)
# every drafting kind below the full level: a small model, the target with a StreamingLLM cache, with a
# retrieval cache
ALL_KINDS = StackSpec.parse("draft,streaming:24,retrieval:48,full", "2,2,3")
# the target reading its cache at 4 bits (over an int8 target: its own upper planes) below a retrieval level
KV4_STACK = StackSpec.parse("ngram,kv4,retrieval:48,full", "2,2,3")


def target(kv: str | None):
    m = ours_from_hf(hf_tiny("llama", seed=11, max_position_embeddings=1024))
    m.kv_dtype = kv
    return m


@pytest.fixture(scope="module")
def small_draft():
    return ours_from_hf(hf_tiny("llama", seed=12, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                max_position_embeddings=1024))


def _prompt(n: int, seed: int) -> list[int]:
    base = torch.randint(0, 96, (n // 4,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (base * 4)[:n]  # repetition gives the n-gram drafter something to find


def test_names_and_errors():
    assert KV_DTYPES == ("fp32", "bf16", "fp16", "int8") and FLOAT_KV_DTYPES == KV_DTYPES[:3]
    for name, dt in TORCH_DTYPE.items():
        assert kv_dtype(name) is dt and kv_dtype(dt) is dt and kv_dtype_name(str(dt)) == name
    for bad in ("int3", "fp8", torch.uint8, None, 16):
        with pytest.raises(TriforceError, match="choose one of fp32, bf16, fp16, int8"):
            kv_dtype(bad)
    m = target(None)
    assert m.kv_dtype is torch.float32  # default: the weights' dtype
    with pytest.raises(TriforceError, match="'int3' is not supported: choose one of fp32, bf16, fp16, int8"):
        m.kv_dtype = "int3"
    assert isinstance(new_cache(m, 8, dtype="int8"), QuantizedCache)
    for bad in ("q4", "int8"):  # the drafting caches are float
        with pytest.raises(TriforceError, match=f"--draft-kv-dtype '{bad}' is not supported: choose one of fp32, bf16, fp16$"):
            SpecConfig(draft_kv_dtype=bad).validate()
    with pytest.raises(TriforceError, match="--draft-kv-dtype"):
        generate(m, _prompt(40, 0), 4, method="triforce", config=SpecConfig(draft_kv_dtype="fp8"))
    with pytest.raises(TriforceError, match="fp32, bf16, fp16"):  # refused before looking for the model
        load_model("/nonexistent/model.gguf", kv_dtype="int3")


@pytest.mark.parametrize("command,flag", [
    (command, flag) for command in (["generate", "--prompt", "hi"], ["bench"], ["tune"], ["perplexity"])
    for flag in ("--kv-dtype", "--draft-kv-dtype") if not (command[0] == "perplexity" and flag == "--draft-kv-dtype")])
def test_cli_lists_the_choices(command, flag, capsys):
    """Every command that builds a model takes --kv-dtype (perplexity runs the target alone: no drafts)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, flag, "int3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    choices = KV_DTYPES if flag == "--kv-dtype" else FLOAT_KV_DTYPES
    assert f"argument {flag}: invalid choice: " in err and "int3" in err and all(v in err for v in choices)
    args = build_parser().parse_args([*command, flag, "bf16"])
    assert getattr(args, flag[2:].replace("-", "_")) == "bf16"


def test_cli_bad_kv_dtype_exit_2_without_traceback():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "triforce", "generate", "--prompt", "hi", "--kv-dtype", "int3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "invalid choice" in r.stderr and all(v in r.stderr for v in KV_DTYPES)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_greedy_equals_ar_for_each_kv_dtype(kv, use_kernels, small_draft):
    """triforce, retrieval and stacks with every drafting kind give ar's tokens with the same target kv dtype."""
    m = target(kv)
    with kernels.override(kernels.cpu() if use_kernels else None):
        for n, seed in ((200, 0), (333, 1)):
            prompt = _prompt(n, seed)
            ref = generate_ar(m, prompt, 48, config=SPEC).tokens  # the same prefill chunks
            for kw in (dict(method="triforce"), dict(method="retrieval"), dict(stack=ALL_KINDS), dict(stack=KV4_STACK)):
                res = generate(m, prompt, 48, config=SPEC, draft_model=small_draft, **kw)
                assert res.tokens == ref, (kv, kw)
                assert not res.stats.get("notes")  # the retrieval level really ran


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_greedy_equals_ar_on_the_attention_kernel(kv):
    """Over 1,174 keys (several of the kernel's blocks) with head_dim 64, decode steps and verifications run the compiled attention
    kernel on the cache's dtype (bf16 / fp16 where it reads them): still ar's tokens."""
    kern = kernels.cpu()
    if kern is None or (kv in ("bf16", "fp16") and not getattr(kern, "HALF_KV", False)) or (
            kv == "int8" and not hasattr(kern, "quant_attention")):
        pytest.skip("the compiled attention kernel does not read this KV dtype here")
    m = ours_from_hf(hf_tiny("llama", seed=13, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=2048))
    m.kv_dtype = kv
    assert m.cfg.head_dim == 64
    prompt = _prompt(1174, 4)
    calls = _CountingKernel(kern)
    with kernels.override(calls):
        ref = generate_ar(m, prompt, 24).tokens
        assert calls.attention > 0
        config = SpecConfig(**{**SPEC.__dict__, "prefill_chunk": 512})
        for method in ("ngram", "retrieval"):
            assert generate(m, prompt, 24, method=method, config=config).tokens == ref, method
        # drafting levels whose chains take the one call through every layer too: H2O's cache, and the StreamingLLM
        # cache's window as a gap (kernels/attention.cpp)
        for levels, gammas in (("ngram,h2o:300,full", "2,4"), ("streaming:64,full", "3"),
                               ("ngram,streaming:64,retrieval:300,full", "2,2,3")):
            got = generate(m, prompt, 24, stack=StackSpec.parse(levels, gammas), config=config).tokens
            assert got == ref, levels


class _CountingKernel:
    """The compiled module, counting calls of its attention kernels (decode_layers runs decode_attention
    inside, decode_layers_quant quant_attention: kernels/decode_layer.cpp)."""

    def __init__(self, kern):
        self.kern, self.attention = kern, 0

    def __getattr__(self, name):
        fn = getattr(self.kern, name)
        if name not in ("decode_attention", "quant_attention", "decode_layers", "decode_layers_quant"):
            return fn

        def counted(*a, **kw):
            self.attention += 1
            return fn(*a, **kw)
        return counted


def test_kv_dtype_changes_the_model_but_not_much():
    """fp16 / bf16 caches give logits close to the fp32 cache's, not equal (the keys are rounded; on
    this tiny random model the largest error is about 0.2 of logits up to 7.5 for bf16, 0.02 for fp16)."""
    m = target("fp32")
    ids = torch.tensor([_prompt(120, 3)])
    with torch.inference_mode():
        ref = m(ids, new_cache(m, 128))
        for kv in ("bf16", "fp16"):
            cache = new_cache(m, 128, dtype=kv)
            assert cache.k.dtype is TORCH_DTYPE[kv] and cache.v.dtype is TORCH_DTYPE[kv]
            got = m(ids, cache)
            err = (got - ref).abs()
            assert 0 < err.max() < 0.05 * ref.abs().max() and err.mean() < 0.01 * ref.std()  # bf16: 8-bit mantissa


@pytest.mark.parametrize("kv,draft_kv", [("fp32", "fp16"), ("fp16", "bf16"), ("bf16", "fp32")])
def test_drafting_caches_use_the_draft_dtype(kv, draft_kv, small_draft):
    m = target(kv)
    config = SpecConfig(**{**SPEC.__dict__, "draft_kv_dtype": draft_kv})
    dec = BuiltStack(ALL_KINDS, m, SamplingParams(), config, make_generator(0, m.device), 200, 16, small_draft)
    dtypes = {lvl.kind: state.cache.k.dtype for lvl, state in zip(dec.stack.levels, dec.states)}
    assert dtypes == {"draft": TORCH_DTYPE[draft_kv], "streaming": TORCH_DTYPE[draft_kv],
                      "retrieval": TORCH_DTYPE[draft_kv], "full": TORCH_DTYPE[kv]}
    assert all(s.cache.v.dtype is s.cache.k.dtype for s in dec.states)
    assert SpecConfig().draft_kv_dtype == DEFAULT_DRAFT_KV_DTYPE


def test_retrieval_selection_with_half_keys():
    """Chunk means are taken in fp32: fp16 / bf16 keys select what their fp32 values select."""
    torch.manual_seed(4)
    keys = torch.randn(1, 2, 700, 64) * 3
    query = torch.randn(1, 4, 64)
    for dt in (torch.float16, torch.bfloat16):
        half = keys.to(dt)
        cache = RetrievalCache(2, 2, 64, budget=256, chunk_size=8, recent=32, dtype=dt)
        assert torch.equal(cache.select(half, query[:, :, None]), cache.select(half.float(), query[:, :, None]))


@pytest.mark.parametrize("half_kv", [False, True])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_dispatch(dt, half_kv):
    """The compiled kernel gets fp32 k/v always and bf16 / fp16 k/v only where it says it reads them
    (ops.HALF_KV); otherwise PyTorch's path, on k/v cast to q's dtype."""
    torch.manual_seed(5)
    S, T = 1061, 1
    q = torch.randn(1, 6, T, 64)
    k, v = torch.randn(1, 2, S, 64).to(dt), torch.randn(1, 2, S, 64).to(dt)
    ops = _FakeKernel(half_kv)
    got = execution.attention(q, SlotKV(k, v), ops=ops)
    assert ops.calls == (1 if dt is torch.float32 or half_kv else 0)
    if dt is torch.bfloat16:  # a bf16 cache's arithmetic (bf16 x bf16 products), on every path
        want = execution.bf16_attention(q, k, v, None, 64 ** -0.5)
    else:
        want = execution.attention(q, SlotKV(k.float(), v.float()), ops=None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _FakeKernel:
    """Stands in for the compiled module: decode_attention by PyTorch on fp32 copies, counting calls."""

    def __init__(self, half_kv: bool):
        self.calls = 0
        if half_kv:
            self.HALF_KV = True

    def decode_attention(self, q, k, v, T, causal, scale):
        self.calls += 1
        Hkv, rows, D = q.shape
        # a chain: causal over its T new tokens (the kernel's `causal` is T > 1)
        out = execution.attention(q.reshape(1, rows // T * Hkv, T, D), SlotKV(k[None], v[None]), scale, ops=None)
        return out.reshape(Hkv, rows, D)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 4, 100])
def test_real_kernel_with_half_kv(dt, T):
    """Where the compiled kernel reads half k/v (ops.HALF_KV), it matches PyTorch's path on the same values; a
    causal prefill of 100 tokens too (over bf16 with AMX or AVX512-BF16: the kernel 21 tokens at a time)."""
    kern = kernels.cpu()
    if kern is None or not getattr(kern, "HALF_KV", False):
        pytest.skip("the compiled attention kernel does not read bf16 / fp16 K/V here")
    torch.manual_seed(6)
    S = 1500
    q = torch.randn(1, 6, T, 64)
    k, v = (torch.randn(1, 2, 1600, 64).to(dt)[:, :, :S] for _ in range(2))  # strided like a cache slice
    got = execution.attention(q, SlotKV(k, v), ops=kern)
    want = execution.attention(q, SlotKV(k, v), ops=None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_sliding_window_cache_in_half(kv="fp16"):
    """Gemma 3's ring cache stores its dtype too, and a prefill chunk (attending over ring + new keys)
    reads the new keys as stored: fed in pieces or at once, the same logits."""
    from conftest import hf_tiny as tiny

    hf = tiny("gemma3", seed=3, num_key_value_heads=1, head_dim=32, sliding_window=16, tie_word_embeddings=True,
              num_hidden_layers=3, sliding_window_pattern=3)
    m = build_model(ModelConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), kv_dtype=kv)
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        whole_cache = new_cache(m, 128)
        assert isinstance(whole_cache, SlidingWindowCache)
        assert whole_cache.k.dtype is TORCH_DTYPE[kv] and whole_cache.global_cache.k.dtype is TORCH_DTYPE[kv]
        whole = m(ids, whole_cache)
        cache, got, pos = new_cache(m, 128), [], 0
        for n in (1, 70, 3, 1, 45):  # 70 > extra: over ring + new keys; the others in place
            got.append(m(ids[:, pos:pos + n], cache))
            pos += n
    torch.testing.assert_close(torch.cat(got, dim=1), whole, atol=1e-4, rtol=1e-4)
    assert generate(m, ids[0, :80].tolist(), 12, method="ngram").tokens == generate_ar(m, ids[0, :80].tolist(), 12).tokens


def test_floor_counts_the_cache_element_size():
    m = target("fp16")
    bw = 1e10
    kv_fp32 = m.cfg.kv_bytes_per_token  # per token, fp32
    assert floor_seconds(m, 1000, bw) == pytest.approx((weight_bytes(m) + 1000 * kv_fp32 // 2) / bw)
    assert floor_seconds(m, 1000, bw, 4) == pytest.approx((weight_bytes(m) + 1000 * kv_fp32) / bw)
    m.kv_dtype = "fp32"
    bw = 1e6  # level_floor_ms rounds to 0.1 ms: a tiny model needs a slow machine to show its bytes
    cfg32 = SpecConfig(**{**SPEC.__dict__, "draft_kv_dtype": "fp32"})
    cfg16 = SpecConfig(**{**SPEC.__dict__, "draft_kv_dtype": "bf16"})
    n = 5000
    full = level_floor_ms(m, n, cfg16, bw, "full")
    assert full == round((weight_bytes(m) + n * kv_fp32) / bw * 1e3, 1)  # the target's own (fp32) cache
    a, b = level_floor_ms(m, n, cfg32, bw, "retrieval:48"), level_floor_ms(m, n, cfg16, bw, "retrieval:48")
    assert a > b  # the drafting level reads its KV in the draft dtype


def test_int8_changes_the_model_a_little_more():
    """An int8 cache (8-bit codes for all but the newest one or two groups of 64 tokens) gives logits close
    to the fp32 cache's; closer than its 4-bit reading (a kv4 level's)."""
    m = target("fp32")
    ids = torch.tensor([_prompt(300, 3)])
    with torch.inference_mode():
        ref = m(ids, new_cache(m, 320))
        err8 = (m(ids, new_cache(m, 320, dtype="int8")) - ref).abs()
        c = m.cfg
        err4 = (m(ids, QuantizedCache(c.n_layers, c.n_kv_heads, c.head_dim, 320, bits=4)) - ref).abs()
    assert 0 < err8.max() < 0.1 * ref.abs().max() and err8.mean() < 0.02 * ref.std()
    assert err4.mean() > 3 * err8.mean()


@pytest.mark.parametrize("stack", ["ngram,kv4,full", "ngram,kv4,retrieval:48,full"])
def test_kv4_over_an_int8_target_reads_its_upper_planes(stack):
    """No second cache: the kv4 level's cache holds the target's plane tensors themselves (and a buffer of its
    own), and reads only the upper ones: zeroing the target's lower planes leaves the level's logits as they
    are, changing an upper plane does not."""
    m = target("int8")
    prompt = _prompt(300, 5)
    dec = BuiltStack(StackSpec.parse(stack, "2"), m, SamplingParams(), SPEC, make_generator(0, m.device), len(prompt), 16)
    dec.prefill(prompt)
    full, kv4 = dec.full.cache, dec.states[1].cache
    assert isinstance(full, QuantizedCache) and full.bits == 8 and kv4.shared is full and kv4.bits == 4
    for name in ("k_hi", "v_hi", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert getattr(kv4, name) is getattr(full, name)
    assert kv4.k_lo is None and kv4.nbytes() == 2 * kv4.buffer_k.numel() * kv4.buffer_k.element_size()
    assert kv4.length == full.length == len(prompt) - 1 and full.quantized_groups * 64 >= 192

    def logits():
        with torch.inference_mode():
            out = dec.states[1].model(torch.tensor([prompt[-1:]]), kv4)
        kv4.rollback(len(prompt) - 1)
        return out

    before = logits()
    full.k_lo.zero_()
    full.v_lo.zero_()
    assert torch.equal(logits(), before)
    full.k_hi[:, :, :, :128] ^= 0x11
    assert not torch.allclose(logits(), before)


def test_int8_over_sliding_windows_is_refused():
    from conftest import hf_tiny as tiny

    hf = tiny("gemma3", seed=3, num_key_value_heads=1, head_dim=32, sliding_window=16, tie_word_embeddings=True,
              num_hidden_layers=3, sliding_window_pattern=3)
    m = build_model(ModelConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), kv_dtype="int8")
    with pytest.raises(TriforceError, match="--kv-dtype int8 is not supported for models with sliding-window"):
        new_cache(m, 64)


def test_kv_bytes_are_what_the_quantized_caches_hold():
    """memory.kv_value_bytes (triforce info, the memory check, the benchmarks' floors) counts the planes,
    scales and zeros a QuantizedCache allocates (its full-precision buffer aside)."""
    from types import SimpleNamespace

    from triforce.memory import kv_bytes, kv_value_bytes

    cfg = SimpleNamespace(kv_bytes_per_token=2 * 3 * 2 * 64 * 4)  # K and V, 3 layers, 2 KV heads of 64, fp32
    for name, bits in (("int8", 8), ("int4", 4)):
        c = QuantizedCache(3, 2, 64, 4096, bits=bits)
        assert c.nbytes() - 2 * c.buffer_k.numel() * 2 == kv_bytes(cfg, 4096, kv_value_bytes(name))
    assert kv_value_bytes(torch.int8) == kv_value_bytes("int8") < 0.55 * kv_value_bytes("fp16")


def test_default_kv_dtype_follows_the_machine(monkeypatch):
    """fp32 weights: bf16 where the CPU kernels run a bf16 cache's attention on dot products faster than fp16's
    FMAs, AMX tiles (any vendor) or AVX512-BF16 on AMD (Intel's cores run vdpbf16ps at half an FMA's rate), for
    the target's cache and the CLI's drafting caches, else fp16; other weights keep their dtype; a CUDA target
    does not ask the CPU kernels."""
    from types import SimpleNamespace

    from triforce.kernels import build
    from triforce.loading import default_kv_dtype

    from triforce.commands.common import default_draft_kv as _default_draft_kv

    def built(module):  # the kernels as built in this process
        monkeypatch.setattr(kernels, "_state", {"cpu": module})
        monkeypatch.setattr(kernels, "cpu", lambda: module)

    cpu_args = SimpleNamespace(device="cpu")
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr(build, "cpu_vendor", lambda vendor=vendor: vendor)
        built(SimpleNamespace(amx_attention=lambda: True, bf16_dot_attention=lambda: True))  # AMX (its dot products)
        assert default_kv_dtype(torch.float32) == "bf16" and _default_draft_kv(cpu_args) == "bf16"
        assert default_kv_dtype(torch.float16) == "fp16"
    built(SimpleNamespace(amx_attention=lambda: False, bf16_dot_attention=lambda: True))  # AVX512-BF16, no AMX
    assert default_kv_dtype(torch.float32) == "bf16" and _default_draft_kv(cpu_args) == "bf16"  # AMD
    monkeypatch.setattr(build, "cpu_vendor", lambda: "GenuineIntel")  # vdpbf16ps at half an FMA's rate
    assert default_kv_dtype(torch.float32) == "fp16" and _default_draft_kv(cpu_args) == "fp16"
    built(SimpleNamespace(amx_attention=lambda: False, bf16_dot_attention=lambda: False))
    assert default_kv_dtype(torch.float32) == "fp16" and _default_draft_kv(cpu_args) == "fp16"
    built(SimpleNamespace())  # a module built before AMX was known
    assert default_kv_dtype(torch.float32) == "fp16"
    built(None)  # TRIFORCE_KERNELS=0, or no compiler
    assert default_kv_dtype(torch.float32) == "fp16"

    def no_cpu_kernels():
        raise AssertionError("a CUDA target asked for the CPU kernels")
    monkeypatch.setattr(kernels, "cpu", no_cpu_kernels)
    assert default_kv_dtype(torch.float32, "cuda") == "fp16"
    assert default_kv_dtype(torch.bfloat16, "cuda") == "bf16"


def test_amx_prediction_does_not_build_the_kernels(monkeypatch):
    """The CLI's KV defaults are read before a model is loaded (and maybe refused): from the CPU's flags,
    TRIFORCE_AMX and TRIFORCE_ISA, without compiling the kernels; once they are built, from them."""
    from types import SimpleNamespace

    from triforce.kernels import build

    def no_build():
        raise AssertionError("built the kernels")
    avx512 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "cpu", no_build)
    monkeypatch.delenv("TRIFORCE_ISA", raising=False)
    monkeypatch.delenv("TRIFORCE_KERNELS", raising=False)
    monkeypatch.delenv("TRIFORCE_AMX", raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(avx512 | {"amx_tile", "amx_bf16"}))
    assert kernels.amx_attention(build=False)
    monkeypatch.setenv("TRIFORCE_AMX", "0")
    assert not kernels.amx_attention(build=False)
    monkeypatch.delenv("TRIFORCE_AMX")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(avx512))  # AVX-512 alone
    assert not kernels.amx_attention(build=False) and not kernels.bf16_dot_attention(build=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(avx512 | {"avx512_bf16"}))  # AMD Zen 4: no AMX
    assert not kernels.amx_attention(build=False) and kernels.bf16_dot_attention(build=False)
    monkeypatch.setattr(build, "cpu_vendor", lambda: "AuthenticAMD")
    assert kernels.bf16_cache_faster(build=False)
    monkeypatch.setattr(build, "cpu_vendor", lambda: "GenuineIntel")  # an Intel Xeon whose VM hides AMX
    assert not kernels.bf16_cache_faster(build=False)
    monkeypatch.setenv("TRIFORCE_ISA", "avx2")  # the AVX2 build has neither
    assert not kernels.bf16_dot_attention(build=False)
    monkeypatch.delenv("TRIFORCE_ISA")
    monkeypatch.setattr(kernels, "_state", {"cpu": SimpleNamespace(amx_attention=lambda: False)})  # built: asked
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(avx512 | {"amx_tile", "amx_bf16"}))
    monkeypatch.setattr(kernels, "cpu", lambda: kernels._state["cpu"])
    assert not kernels.amx_attention(build=False)


def test_info_does_not_build_the_kernels(monkeypatch):
    """`triforce info` loads nothing: its default KV dtype comes from the CPU's flags, not from compiling."""
    from conftest import embedded_available
    from triforce.loading.inventory import inventory, report

    if not embedded_available():
        pytest.skip("embedded model not installed")

    def no_build():
        raise AssertionError("built the kernels")
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "cpu", no_build)
    monkeypatch.delenv("TRIFORCE_KERNELS", raising=False)
    text = report(inventory(None), "native", None, 4096)
    default = "bf16" if kernels.bf16_cache_faster(build=False) else "fp16"
    assert f"--kv-dtype {default}:" in text


def test_optional_instructions_the_compiler_lacks_are_left_out(monkeypatch):
    """An optional ISA flag (VNNI, AVX512-BF16, AMX) goes into the build only where the CPU has it and the
    compiler knows it: an older compiler builds the variant without it instead of failing the whole build (and
    the defaults that depend on it follow)."""
    from triforce.kernels import build

    avx512 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.delenv("TRIFORCE_ISA", raising=False)
    monkeypatch.delenv("TRIFORCE_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(avx512 | {"avx512_vnni", "avx512_bf16"}))
    monkeypatch.setattr(build, "_ACCEPTS", {"-mavx512vnni": True, "-mavx512bf16": True})
    assert kernels._optional_cflags("avx512") == ["-mavx512vnni", "-mavx512bf16"]
    assert kernels.bf16_dot_attention(build=False)
    monkeypatch.setattr(build, "_ACCEPTS", {"-mavx512vnni": True, "-mavx512bf16": False})
    assert kernels._optional_cflags("avx512") == ["-mavx512vnni"]
    assert not kernels.bf16_dot_attention(build=False)
    monkeypatch.setattr(build, "_ACCEPTS", {})
    assert not build.compiler_accepts("-mno-such-instruction-set")  # the real compiler asked (or none there)
