"""KV cache dtype (--kv-dtype for the target's cache, --draft-kv-dtype for the drafting caches).

A target whose cache stores K/V in bf16 or fp16 is another model than with fp32, but one model: `ar` and
every stack read the same cache dtype, so greedy output of every stack equals `ar`'s within a setting,
on the compiled kernels (where they build) and on PyTorch's path. The drafting levels (retrieval,
streaming, a small draft model) use their own, cheaper dtype; the full level the target's. Bad values are
clear errors naming the valid ones."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce import kernels, model as model_mod
from triforce.bench.hardware import floor_seconds, weight_bytes
from triforce.bench.methods import level_floor_ms
from triforce.caches import RetrievalCache, SlidingWindowCache
from triforce.caches.base import kv_dtype
from triforce.cli import build_parser
from triforce.config import DEFAULT_DRAFT_KV_DTYPE, KV_DTYPES, ModelConfig, kv_dtype_name
from triforce.errors import TriforceError
from triforce.generate import generate, generate_ar
from triforce.loading import build_model, load_model
from triforce.sampling import SamplingParams, make_generator
from triforce.speculation.config import SpecConfig
from triforce.speculation.decoder import Decoder
from triforce.speculation.stack import StackSpec

TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SPEC = SpecConfig(gamma=4, gamma_draft=2, budget=48, chunk_size=8, recent=8, rebuild_every=16, sink=4, window=16,
                  ngram=3, prefill_chunk=64)
# every drafting kind below the full level: a small model, the target with a StreamingLLM cache, with a
# retrieval cache
ALL_KINDS = StackSpec.parse("draft,streaming:24,retrieval:48,full", "2,2,3")


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
    assert KV_DTYPES == ("fp32", "bf16", "fp16")
    for name, dt in TORCH_DTYPE.items():
        assert kv_dtype(name) is dt and kv_dtype(dt) is dt and kv_dtype_name(str(dt)) == name
    for bad in ("int3", "fp8", torch.int8, None, 16):
        with pytest.raises(TriforceError, match="choose one of fp32, bf16, fp16"):
            kv_dtype(bad)
    m = target(None)
    assert m.kv_dtype is torch.float32  # default: the weights' dtype
    with pytest.raises(TriforceError, match="'int3' is not supported: choose one of fp32, bf16, fp16"):
        m.kv_dtype = "int3"
    with pytest.raises(TriforceError, match="fp32, bf16, fp16"):
        m.new_cache(8, dtype="int8")
    with pytest.raises(TriforceError, match="--draft-kv-dtype 'q4' is not supported: choose one of fp32, bf16, fp16"):
        SpecConfig(draft_kv_dtype="q4").validate()
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
    assert f"argument {flag}: invalid choice: " in err and "int3" in err and all(v in err for v in KV_DTYPES)
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
    """triforce, retrieval and a stack with every drafting kind give ar's tokens with the same target kv dtype."""
    m = target(kv)
    with kernels.override(kernels.cpu() if use_kernels else None):
        for n, seed in ((200, 0), (333, 1)):
            prompt = _prompt(n, seed)
            ref = generate_ar(m, prompt, 48).tokens
            for kw in (dict(method="triforce"), dict(method="retrieval"), dict(stack=ALL_KINDS)):
                res = generate(m, prompt, 48, config=SPEC, draft_model=small_draft, **kw)
                assert res.tokens == ref, (kv, kw)
                assert not res.stats.get("notes")  # the retrieval level really ran


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_greedy_equals_ar_on_the_attention_kernel(kv):
    """Past KERNEL_MIN_KEYS keys with head_dim 64, decode steps and verifications run the compiled attention
    kernel on the cache's dtype (bf16 / fp16 where it reads them): still ar's tokens."""
    kern = kernels.cpu()
    if kern is None or (kv != "fp32" and not getattr(kern, "HALF_KV", False)):
        pytest.skip("the compiled attention kernel does not read this KV dtype here")
    m = ours_from_hf(hf_tiny("llama", seed=13, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=2048))
    m.kv_dtype = kv
    assert m.cfg.head_dim == 64
    prompt = _prompt(model_mod.KERNEL_MIN_KEYS + 150, 4)
    calls = _CountingKernel(kern)
    with kernels.override(calls):
        ref = generate_ar(m, prompt, 24).tokens
        assert calls.attention > 0
        config = SpecConfig(**{**SPEC.__dict__, "prefill_chunk": 512})
        for method in ("ngram", "retrieval"):
            assert generate(m, prompt, 24, method=method, config=config).tokens == ref, method


class _CountingKernel:
    """The compiled module, counting decode_attention calls."""

    def __init__(self, kern):
        self.kern, self.attention = kern, 0

    def __getattr__(self, name):
        if name == "decode_attention":
            self.attention += 1
        return getattr(self.kern, name)


def test_kv_dtype_changes_the_model_but_not_much():
    """fp16 / bf16 caches give logits close to the fp32 cache's, not equal (the keys are rounded; on
    this tiny random model the largest error is about 0.2 of logits up to 7.5 for bf16, 0.02 for fp16)."""
    m = target("fp32")
    ids = torch.tensor([_prompt(120, 3)])
    with torch.inference_mode():
        ref = m(ids, m.new_cache(128))
        for kv in ("bf16", "fp16"):
            cache = m.new_cache(128, dtype=kv)
            assert cache.k.dtype is TORCH_DTYPE[kv] and cache.v.dtype is TORCH_DTYPE[kv]
            got = m(ids, cache)
            err = (got - ref).abs()
            assert 0 < err.max() < 0.05 * ref.abs().max() and err.mean() < 0.01 * ref.std()  # bf16: 8-bit mantissa


@pytest.mark.parametrize("kv,draft_kv", [("fp32", "fp16"), ("fp16", "bf16"), ("bf16", "fp32")])
def test_drafting_caches_use_the_draft_dtype(kv, draft_kv, small_draft):
    m = target(kv)
    config = SpecConfig(**{**SPEC.__dict__, "draft_kv_dtype": draft_kv})
    dec = Decoder(ALL_KINDS, m, SamplingParams(), config, make_generator(0, m.device), 200, 16, small_draft)
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
        assert torch.equal(cache.select(half, query), cache.select(half.float(), query))


@pytest.mark.parametrize("half_kv", [False, True])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_dispatch(dt, half_kv):
    """The compiled kernel gets fp32 k/v always and bf16 / fp16 k/v only where it says it reads them
    (ops.HALF_KV); otherwise PyTorch's path, on k/v cast to q's dtype."""
    torch.manual_seed(5)
    S, T = model_mod.KERNEL_MIN_KEYS + 37, 1
    q = torch.randn(1, 6, T, 64)
    k, v = torch.randn(1, 2, S, 64).to(dt), torch.randn(1, 2, S, 64).to(dt)
    ops = _FakeKernel(half_kv)
    got = model_mod.attention(q, k, v, None, ops=ops)
    assert ops.calls == (1 if dt is torch.float32 or half_kv else 0)
    want = model_mod.attention(q, k.float(), v.float(), None, ops=None)
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
        out = model_mod.attention(q.reshape(1, rows // T * Hkv, T, D), k.float()[None], v.float()[None],
                                  "causal" if causal else None, scale, ops=None)
        return out.reshape(Hkv, rows, D)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 4])
def test_real_kernel_with_half_kv(dt, T):
    """Where the compiled kernel reads half k/v (ops.HALF_KV), it matches PyTorch's path on the same values."""
    kern = kernels.cpu()
    if kern is None or not getattr(kern, "HALF_KV", False):
        pytest.skip("the compiled attention kernel does not read bf16 / fp16 K/V here")
    torch.manual_seed(6)
    S = 1500
    q = torch.randn(1, 6, T, 64)
    k, v = (torch.randn(1, 2, 1600, 64).to(dt)[:, :, :S] for _ in range(2))  # strided like a cache slice
    mask = "causal" if T > 1 else None
    got = model_mod.attention(q, k, v, mask, ops=kern)
    want = model_mod.attention(q, k, v, mask, ops=None)
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
        whole_cache = m.new_cache(128)
        assert isinstance(whole_cache, SlidingWindowCache)
        assert whole_cache.k.dtype is TORCH_DTYPE[kv] and whole_cache.global_cache.k.dtype is TORCH_DTYPE[kv]
        whole = m(ids, whole_cache)
        cache, got, pos = m.new_cache(128), [], 0
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
