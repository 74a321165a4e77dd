"""Weights kept in GGML block formats (ggml_blocks.py, kernels/quant_linear.cpp, execution.QuantLinear): the
model computed from a GGUF file's stored blocks is the model of their dequantized fp32 values (logits
within 1e-4, the same greedy tokens, every speculation stack still exact), in the file's bytes of memory.

Test files come from gguf's own writer: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / F16 / BF16 quantized by
gguf.quants from real (tiny) weights, K-quants as random valid blocks (gguf has no K-quant quantizer),
in the Q4_K_M layout llama.cpp writes. Each kernel is checked against gguf.quants.dequantize + matmul."""
from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from conftest import embedded_available
from test_gguf_loading import convert, saved
from triforce import kernels
from triforce.bench.hardware import weight_bytes
from triforce.cli import main as cli_main
from triforce.config import ModelConfig
from triforce.errors import TriforceError
from triforce.generate import generate, generate_ar
from triforce.loading import build_model, default_kv_dtype, load_model
from triforce.loading.gguf_file import read_gguf
from triforce.execution import KERNEL_CHUNKS_MAX_ROWS, QuantLinear
from triforce.kernels.capabilities import capabilities
from triforce.ggml_blocks import FORMATS, QuantTensor, dequantize, pack_rows, random_blocks, unpack_rows
from triforce.speculation.settings import SpecConfig
from triforce.caches import new_cache
from triforce.loading.weights import pack_weights, weights_to_bf16

QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16)  # gguf.quants.quantize makes these
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The kernel gives gguf's dequantized values bit for bit, except one rounding of d * q + m (one fma)
EXACT = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q6_K, Q.F16, Q.BF16)
TINY_SPEC = SpecConfig(gamma=4, gamma_draft=2, budget=48, chunk_size=8, recent=8, rebuild_every=16,
                       sink=4, window=16, ngram=3, prefill_chunk=64)


def blocks(qtype, n: int, k: int, seed: int = 0) -> QuantTensor:
    """[n, k] weights of `qtype`: real quantization of N(0, 0.02) values, or random K-quant blocks."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return random_blocks(int(qtype), n, k, rng)
    raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32), qtype)
    return QuantTensor.from_numpy(raw, int(qtype), k)


def reference(t: QuantTensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(t.raw.numpy(), t.qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda q: q.name)
def test_kernel_equals_gguf_dequantize_and_matmul(kern, qtype):
    """dequantize_rows is gguf's dequantize; linear_quant is x @ that^T for 1-16 rows of x, parts
    of several types concatenated (a fused projection of a Q4_K_M file mixes Q4_K and Q6_K)."""
    k = 512
    w = blocks(qtype, 37, k)  # 37 rows: thread ranges and 4-row tiles do not divide it
    want = reference(w)
    got = kern.dequantize_rows(w.raw, w.qtype)
    if qtype in EXACT:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    other = blocks(Q.Q6_K if qtype != Q.Q6_K else Q.Q8_0, 21, k, seed=1)
    full = torch.cat([want, reference(other)]).double()
    for rows in (1, 2, 3, 5, 8, 9, 13, 16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        y = kern.linear_quant(x, [w.raw, other.raw], [w.qtype, other.qtype])
        ref = x.double() @ full.T
        assert y.shape == (rows, 58)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, rows


# the formats the integer kernel reads (quant_packed.cpp)
PACKED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# its error bound, per output: x is taken to 16 bits of each 32-element block's largest |x|
PACKED_TOL = 5e-5
# and a model's logits through it: max |logit - the fp32 model's| / std of the logits (measured: 1e-3 on the
# random Q4_K_M test model below, 5.3e-3 over a 200-token prefill of the tiny Qwen2's real weights in Q4_1)
LOGIT_TOL = 1e-2


def logits_tol(model, want: torch.Tensor, rows: int) -> float:
    """How far `model`'s logits of a forward of `rows` rows may be from the fp32 model's `want`: 1e-4, or LOGIT_TOL
    of their spread where the integer kernel computes them (its 16-bit activations): up to a verification's rows
    on any kernels build, a prefill's where capabilities' packed_prefill says so."""
    ops = kernels.cpu()
    on = ops is not None and any(any(m.packed) for m in model.modules() if isinstance(m, QuantLinear))
    if on and (rows <= KERNEL_CHUNKS_MAX_ROWS or capabilities(ops).packed_prefill):
        return LOGIT_TOL * want.std().item()
    return 1e-4


def packed_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - x w^T| / (|x| |w|^T): the error relative to the size of each sum's terms."""
    exact = x.double() @ w.double().T
    return ((y.double() - exact).abs() / (x.abs().double() @ w.abs().double().T)).max().item()


@pytest.mark.parametrize("qtype", PACKED, ids=lambda q: q.name)
def test_packed_rows_are_the_files_bytes(qtype):
    w = blocks(qtype, 37, 256)  # not a multiple of 16 rows: the last group is padded
    packed = pack_rows(w)
    assert packed.shape == (3, 16 * w.raw.shape[1])
    assert torch.equal(unpack_rows(packed, w.qtype, w.shape).raw, w.raw)
    assert torch.equal(unpack_rows(packed, w.qtype, w.shape, 5, 35).raw, w.raw[5:35])
    assert torch.equal(torch.sort(packed[:2].flatten()).values, torch.sort(w.raw[:32].flatten()).values)


@pytest.mark.parametrize("qtype", PACKED, ids=lambda q: q.name)
def test_kernel_unpacks_the_files_bytes(kern, qtype):
    """The compiled unpack_rows (prefill dequantizes packed weights through it) gives numpy's bytes."""
    w = blocks(qtype, 37, 256)
    packed = pack_rows(w)
    for start, stop in ((0, 37), (5, 35), (16, 17), (36, 37), (3, 3)):
        assert torch.equal(unpack_rows(packed, w.qtype, w.shape, start, stop, kern).raw, w.raw[start:stop])


@pytest.mark.parametrize("qtype", PACKED, ids=lambda q: q.name)
def test_packed_kernel_equals_dequantized_matmul(kern, qtype):
    """linear_packed is x @ dequantized^T within PACKED_TOL, for 1-300 rows of x (each row bit for bit
    what it gives alone: a verification's or a serving batch's row equals a decode step's, on the tile path and
    the many-row one, with its 64-row passes and 4-row tiles cut short, and across the call's slices of rows:
    about 256 KB of codes: 255-256 rows at this width), parts of two formats concatenated,
    an all-zero block of x. The bound has power: 8-bit activations alone (llama.cpp's) exceed it."""
    k = 512
    w, other = blocks(qtype, 37, k), blocks(Q.Q8_0 if qtype != Q.Q8_0 else Q.Q4_1, 21, k, seed=1)
    full = torch.cat([reference(w), reference(other)])
    parts = [pack_rows(w), pack_rows(other)]
    for rows in (1, 2, 3, 5, 8, 9, 13, 16, 17, 64, 67, 130, 300):  # from 4-16 rows (per format), the many-row path
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        x[0, 32:64] = 0
        y = kern.linear_packed(x, parts, [w.qtype, other.qtype], [37, 21])
        assert y.shape == (rows, 58)
        assert packed_error(y, x, full) < PACKED_TOL, rows
        alone = torch.cat([kern.linear_packed(x[i:i + 1], parts, [w.qtype, other.qtype], [37, 21]) for i in range(rows)])
        assert torch.equal(y, alone), rows
    blocked = x.view(rows, -1, 32)
    amax = blocked.abs().amax(-1, keepdim=True) / 127
    x8 = (torch.round(blocked / amax.clamp_min(1e-30)) * amax).view(rows, k)
    assert packed_error(x8 @ full.T, x, full) > PACKED_TOL


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "pytorch"])
@pytest.mark.parametrize("rows", [1, 7, 20, 40])
@pytest.mark.parametrize("formats", ["blocks", "packed", "mixed"])
def test_quant_linear_equals_dequantized_linear(use_kernels, rows, formats):
    """QuantLinear on a kernel (<= 16 rows: the block kernel for F16 + BF16, the integer kernel for packed
    Q5_1 + Q8_0, or both for Q4_K + F16; up to 64 rows, a verification's, 16 at a time, or in one call where
    the integer kernel's many-row path takes the types; a prefill's 80 rows on the integer kernel where
    packed_prefill says so), on dequantized panels (prefill elsewhere; no kernels, also from packed bytes):
    x W^T + b with W the dequantized values. The panels are a few rows at a time: set small here to span
    several. On a kernel each row is computed as it would be alone."""
    types = {"blocks": (Q.F16, Q.BF16), "packed": (Q.Q5_1, Q.Q8_0), "mixed": (Q.Q4_K, Q.F16)}[formats]
    parts = [blocks(types[0], 40, 256), blocks(types[1], 24, 256, seed=3)]
    bias = torch.randn(64)
    lin = QuantLinear(parts, bias)
    lin.PANEL_BYTES = 16 * 4 * 256  # 16-row panels
    weight = torch.cat([reference(p) for p in parts])
    want = F.linear(x := torch.randn(2, rows, 256), weight, bias)
    with kernels.override(kernels.cpu() if use_kernels else None):
        lin.backend = kernels.Backend.for_model(torch.device("cpu"), torch.float32)
        lin.pack()
        on = use_kernels and kernels.cpu() is not None
        assert lin.packed == ([True, True] if formats == "packed" and on else [True, False] if formats == "mixed" and on
                              else [False, False])
        got = lin(x)
        # a prefill's rows (more than a verification's) on the integer kernel too where capabilities say so
        on_kernel = on and (x.numel() // 256 <= KERNEL_CHUNKS_MAX_ROWS
                            or all(lin.packed) and capabilities(lin.backend.ops).packed_prefill)
        if on_kernel:  # a decode step's row gives the same numbers: verification rows are the step's
            assert torch.equal(lin(x[1:, rows - 1:]), got[1:, rows - 1:])
    if any(lin.packed) and on_kernel:
        assert packed_error((got - bias).view(-1, 64), x.view(-1, 256), weight) < PACKED_TOL
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert lin.nbytes == sum(p.raw.numel() for p in parts)
    assert all(torch.equal(a.raw, b.raw) for a, b in zip(lin.parts, parts))


def q4_k_m(name: str, w: np.ndarray):
    """Q4_K_M as llama.cpp lays it out, with random blocks of each tensor's shape: Q4_K, Q6_K for the
    LM head and for layer 0's V and down projections; one Q5_K and one Q8_0 tensor to mix in more."""
    if w.ndim != 2:
        return None
    qtype = (Q.Q6_K if name in ("output.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight") else
             Q.Q5_K if name == "blk.1.attn_output.weight" else Q.Q8_0 if name == "blk.1.attn_k.weight" else Q.Q4_K)
    t = random_blocks(int(qtype), w.shape[0], w.shape[1], np.random.default_rng(zlib.crc32(name.encode())),
                      std=0.05)  # (crc32, not hash(): the same blocks in every process, so a failure reproduces)
    return t.raw.numpy(), qtype


def models(path):
    """(native, fp32) models of one GGUF file."""
    hf, sd = read_gguf(path, progress=False, keep_quantized=True)
    native = build_model(ModelConfig.from_hf(hf), sd)
    hf, sd = read_gguf(path, progress=False)
    return native, build_model(ModelConfig.from_hf(hf), sd)


K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024)


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q4km")
    hf_dir, _ = saved(tmp, "llama", **K_SHAPE)
    return convert(hf_dir, tmp / "q4_k_m.gguf", quantize=q4_k_m)


@torch.no_grad()
def test_q4_k_m_file_is_the_model_of_its_dequantized_weights(q4_k_m_file):
    native, fp32 = models(q4_k_m_file)
    assert native.quantized and not fp32.quantized
    reader = gguf.GGUFReader(str(q4_k_m_file))
    held = {id(t): t for t in [*native.parameters(), *native.buffers()]}.values()
    assert sum(t.numel() * t.element_size() for t in held) == sum(int(t.n_bytes) for t in reader.tensors)  # no copy
    assert not any(p.numel() > 256 for p in native.parameters())  # only norms are fp32 parameters
    ids = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(0))
    want = fp32(ids, new_cache(fp32, 300))
    for module in (kernels.cpu(), None):
        with kernels.override(module):
            got = native(ids, new_cache(native, 300))  # prefill: dequantized panels, or the integer kernel
            step = new_cache(native, 300)
            native(ids[:, :290], step)
            rows = [native(ids[:, i:i + 1], step) for i in range(290, 300)]  # decode steps: the kernels
        tol = logits_tol(native, want, 300) if module is not None else 1e-4
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        # the integer kernel's 16-bit activations (Q4_K, Q8_0 parts here): logits within LOGIT_TOL of the spread
        spread = want.std().item()
        tol = LOGIT_TOL * spread if module is not None and any(any(m.packed) for m in native.modules()
                                                                 if isinstance(m, QuantLinear)) else 1e-4
        err = (torch.cat(rows, 1) - want[:, 290:]).abs().max().item()
        assert err <= tol, (err, tol, spread)
    prompt = ids[0, :200].tolist()
    assert generate_ar(native, prompt, 64).tokens == generate_ar(fp32, prompt, 64).tokens


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
@torch.no_grad()
def test_a_quantized_prompt_s_cache_does_not_depend_on_how_its_prefill_is_chunked(q4_k_m_file, kv_dtype):
    """Where a prefill's linear layers run on the integer kernel (packed_prefill) and its attention chains through the
    decode kernel (a bf16 cache on dot products), a GGUF model's prompt prefilled in one 150-token chunk, in chunks of
    64 or 21 tokens, or one token at a time leaves the same cache and last logits, bit for bit. Elsewhere the one
    150-token chunk takes another arithmetic (dequantized weights through a GEMM, or PyTorch's flash attention), and
    the check is shown to fail there."""
    from triforce.execution.attention import _kernel_chains
    from triforce.speculation.state import prefill

    native, _ = models(q4_k_m_file)
    ops = kernels.cpu()
    tokens = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(8))
    runs = []
    for chunk in (150, 64, 21, 1):
        cache = new_cache(native, 160, dtype=kv_dtype)
        logits = prefill(native, cache, tokens, chunk)
        runs.append((logits, cache.k[..., :150, :], cache.v[..., :150, :]))
    steps = runs[-1]
    same = [all(torch.equal(a, b) for a, b in zip(run, steps)) for run in runs[:-1]]
    exact = (ops is not None and capabilities(ops).packed_prefill
             and _kernel_chains(torch.zeros(1, 4, 1, 64), runs[0][1][0], ops))
    assert same == ([True, True, True] if exact else [False, True, True]), same


@pytest.mark.parametrize("levels", ["ngram,full", "ngram,retrieval:40,full", "streaming:24,full",
                                    "ngram,streaming:24,retrieval:96,full"])
def test_speculation_stays_exact_on_quantized_weights(q4_k_m_file, levels):
    native, _ = models(q4_k_m_file)
    prompt = (torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(5)).tolist() * 4)
    # ar with the same prefill chunks: a 240-token chunk runs the linear layers on dequantized panels, 64-token
    # chunks on the integer kernel (its 16-bit activations), so the two prompts' caches differ (not speculation)
    ref = generate_ar(native, prompt, 48, config=TINY_SPEC).tokens
    assert generate(native, prompt, 48, stack=levels, config=TINY_SPEC).tokens == ref


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.no_grad()
def test_quantized_real_weights(tmp_path, arch, qtype):
    """Real weights quantized by gguf: Llama's Q/K rows (permuted by the converter) and Qwen2's biases."""
    hf_dir, _ = saved(tmp_path, arch)
    path = convert(hf_dir, tmp_path / "m.gguf", quantize=lambda name, w: (
        (gguf.quants.quantize(w, qtype), qtype) if w.ndim == 2 else None))
    native, fp32 = models(path)
    assert native.quantized
    ids = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(1))
    want = fp32(ids, new_cache(fp32, 200))
    tol = logits_tol(native, want, 200)
    torch.testing.assert_close(native(ids, new_cache(native, 200)), want, rtol=tol, atol=tol)
    assert generate_ar(native, ids[0, :120].tolist(), 40).tokens == generate_ar(fp32, ids[0, :120].tolist(), 40).tokens


@torch.no_grad()
def test_bf16_weights(q4_k_m_file):
    """--weights bf16: every projection as bf16 bytes (half of fp32), fp32 activations."""
    native, fp32 = models(q4_k_m_file)
    weights_to_bf16(native)
    assert all(t == int(Q.BF16) for m in native.modules() if isinstance(m, QuantLinear) for t in m.types)
    n_weights = sum(p.numel() for p in fp32.parameters() if p.dim() == 2)
    held = {id(t): t for t in [*native.parameters(), *native.buffers()]}.values()
    assert sum(t.numel() * t.element_size() for t in held) == \
        2 * n_weights + sum(4 * p.numel() for p in fp32.parameters() if p.dim() == 1)
    for p in fp32.parameters():  # the model it computes: the dequantized weights rounded to bf16
        if p.dim() == 2:
            p.data = p.data.to(torch.bfloat16).float()
    pack_weights(fp32)
    ids = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(native(ids, new_cache(native, 100)), fp32(ids, new_cache(fp32, 100)), rtol=1e-4, atol=1e-4)


def test_unsupported_type_is_refused_by_name(tmp_path):
    hf_dir, _ = saved(tmp_path, "llama", **K_SHAPE)
    q2k = gguf.GGML_QUANT_SIZES[Q.Q2_K]

    def with_q2_k(name, w):
        if name != "blk.0.ffn_up.weight":
            return None
        return np.zeros((w.shape[0], w.shape[1] // q2k[0] * q2k[1]), np.uint8), Q.Q2_K

    path = convert(hf_dir, tmp_path / "q2k.gguf", quantize=with_q2_k)
    cache = tmp_path / "cache"
    with pytest.raises(TriforceError, match=r"Q2_K.*supported: .*Q4_K.*--weights bf16"):
        load_model(path, cache_dir=cache, progress=False)
    assert not cache.exists() or not any(cache.iterdir())  # refused before anything was written


@pytest.mark.parametrize("damage", ["truncated", "bad magic"])
def test_corrupt_gguf_is_refused_and_leaves_nothing(q4_k_m_file, tmp_path, damage):
    data = q4_k_m_file.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: len(data) * 6 // 10] if damage == "truncated" else b"GGUX" + data[4:])
    cache = tmp_path / "cache"
    for weights in ("native", "fp32"):
        with pytest.raises(TriforceError, match="cannot read GGUF file"):
            load_model(bad, cache_dir=cache, progress=False, weights=weights)
    assert not cache.exists() or not any(cache.iterdir())


def test_info_counts_the_runtime_beside_weights_and_kv(monkeypatch):
    """`triforce info`'s verdict adds the runtime (Python, PyTorch, tokenizer, activations: memory.RUNTIME, measured)
    to weights + KV: a context that needs all the available memory for weights and KV alone does not fit."""
    if not embedded_available():
        pytest.skip("embedded model not installed")
    from triforce import memory
    from triforce.loading.inventory import inventory, report

    inv = inventory(None)
    need = inv.weight_bytes("native") + 8192 * inv.kv_bytes_per_token("bf16")
    for avail, verdict in ((need + memory.RUNTIME, "fits"), (need + memory.RUNTIME - (1 << 20), "DOES NOT FIT"),
                           (need + memory.HEADROOM, "DOES NOT FIT")):
        monkeypatch.setattr(memory, "available_bytes", lambda: avail)
        line = report(inv, "native", "bf16", 8192).splitlines()[-1]
        assert line.endswith(verdict) and "the runtime" in line, line


def test_info_and_memory_refusal(capsys):
    if not embedded_available():
        pytest.skip("embedded model not installed")
    assert cli_main(["info", "--context-length", "32768"]) == 0
    out = capsys.readouterr().out
    assert "Q4_1" in out and "Q8_0" in out and "KV cache per 1K tokens" in out and "fits" in out
    assert "fp16 22 MiB, int8 12 MiB" in out and "4-bit cache over a float target: 6.7 MiB" in out  # SmolLM2-135M
    # a context whose KV cache cannot fit: refused with the numbers before any prefill
    assert cli_main(["generate", "--prompt", "hi", "--max-context", "100000000", "--max-new-tokens", "90000000",
                     "--quiet"]) == 2
    err = capsys.readouterr().err
    default = default_kv_dtype(torch.float32)  # fp16, or bf16 on a CPU with AMX tiles
    assert f"the KV cache of 90000001 tokens ({default}) would take" in err and "GiB of memory is available" in err


@pytest.mark.skipif(not embedded_available(), reason="embedded model not installed")
@torch.no_grad()
def test_embedded_model_native_equals_fp32_weights(tmp_path, all_threads):
    """The default (native Q4_1 / Q8_0 blocks) against the fp32 conversion on a long prompt; the native
    load writes no weights to the cache (its tokenizer only)."""
    from triforce.corpus import demo_tokens

    native = load_model(cache_dir=tmp_path, progress=False)
    assert native.model.quantized
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [p.name for p in tmp_path.glob("*-tokenizer")]
    assert not list(tmp_path.rglob("*.safetensors"))
    fp32 = load_model(weights="fp32", progress=False)
    prompt = demo_tokens(native.tokenizer, 1500)
    a = generate_ar(native.model, prompt, 32).tokens
    assert a == generate_ar(fp32.model, prompt, 32).tokens
    assert weight_bytes(native.model) < weight_bytes(fp32.model) / 5


@pytest.mark.skipif(not embedded_available(), reason="embedded model not installed")
@torch.no_grad()
def test_gguf_on_a_gpu_is_held_in_the_model_dtype(monkeypatch):
    """On a GPU (loading.holds_quantized False: simulated here on the CPU) a GGUF's blocks are dequantized
    at load to --dtype, as a Hugging Face directory's weights are: plain Linear layers, the same weights."""
    import triforce.loading as loading

    native = load_model(progress=False).model
    monkeypatch.setattr(loading, "holds_quantized", lambda device: False)
    plain = load_model(progress=False, weights="native").model
    assert native.quantized and not plain.quantized
    assert not any(isinstance(m, QuantLinear) for m in plain.modules())
    w = plain.layers[0].wqkv.weight
    q = native.layers[0].wqkv
    ref = torch.cat([dequantize(q.part_rows(i, 0, n)) for i, n in enumerate(q.rows)])
    assert torch.equal(w, ref)


def test_info_on_a_hugging_face_directory(tmp_path, capsys):
    hf_dir, _ = saved(tmp_path, "llama")
    assert cli_main(["info", "--model", str(hf_dir), "--context-length", "100"]) == 0
    out = capsys.readouterr().out
    assert "| F32 | 16 |" in out and "KiB" in out and "a 100-token context" in out
    assert cli_main(["info", "--model", str(tmp_path / "missing")]) == 2
    assert "model not found" in capsys.readouterr().err


@pytest.fixture(scope="module")
def long_q4_k_m_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q4km-long")
    hf_dir, _ = saved(tmp, "llama", **dict(K_SHAPE, max_position_embeddings=1400))
    return convert(hf_dir, tmp / "q4_k_m.gguf", quantize=q4_k_m)


class _CountingFused:
    """A kernel module counting its decode_layers (or `name`) calls."""

    def __init__(self, kern, name: str = "decode_layers"):
        self.kern, self.fused, self.name = kern, 0, name

    def __getattr__(self, name):
        fn = getattr(self.kern, name)
        if name != self.name:
            return fn

        def counted(*a):
            self.fused += 1
            return fn(*a)
        return counted


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@torch.no_grad()
def test_fused_decode_layer_is_the_layer_bit_for_bit(long_q4_k_m_file, isa, monkeypatch):
    """kernels/decode_layer.cpp (every layer in one C++ call) against Block.forward's Python path over the same
    kernels: decode steps and a 5-token verification past 1024 cached keys (where the attention kernel
    runs) through a full cache recording queries (fp16 K/V with native weights, bf16 with fp32 ones: the
    kernel rounds k and v into the cache itself), then a retrieval cache built from it, with native Q4_K_M
    weights (integer kernel) and fp32 ones (panels): the same logits, queries and cache, bit for bit."""
    from triforce.caches import RetrievalCache
    from triforce.execution import fused as fused_module

    if isa not in kernels.runnable_isas() or kernels.variant(isa) is None:
        pytest.skip(f"no {isa} kernels here")
    kern = kernels.variant(isa)
    native, fp32 = models(long_q4_k_m_file)
    ids = torch.randint(0, 96, (1, 1200), generator=torch.Generator().manual_seed(5))
    python_path = fused_module.layer_args
    for model, kv in ((native, torch.float16), (fp32, torch.bfloat16)):
        outs = {}
        for fused in (True, False):
            monkeypatch.setattr(fused_module, "layer_args", python_path if fused else (lambda block, ops: None))
            counting = _CountingFused(kern)
            with kernels.override(counting):
                cache = new_cache(model, 1300, record_queries=True, dtype=kv)
                model(ids[:, :1100], cache)  # prefill chunk: the Python path either way
                rows = [model(ids[:, i:i + 1], cache) for i in range(1100, 1104)]
                rows.append(model(ids[:, 1104:1109], cache))
                queries = cache.recorder.layers[1].clone()
                c = model.cfg
                retr = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, budget=1040, chunk_size=8, recent=16,
                                      max_new=64, dtype=torch.float16)
                retr.build(cache)
                rows += [model(ids[:, 1109:1110], retr), model(ids[:, 1110:1114], retr)]
            outs[fused] = torch.cat(rows, 1), queries, cache.k[:, :, :, :1109], cache.v[:, :, :, :1109]
            assert (counting.fused > 0) == fused
        for got, want in zip(outs[True], outs[False]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@torch.no_grad()
def test_fused_decode_layers_over_a_quantized_cache(long_q4_k_m_file, isa, monkeypatch):
    """kernels' decode_layers_quant (every layer in one call over an int8 cache) against Block.forward's Python
    path over the same kernels: decode steps crossing quantization groups and a 5-token verification, recording
    queries, then a kv4 cache reading the int8 cache's upper planes: the same logits, queries and codes, bit for
    bit."""
    from triforce.caches import QuantizedCache
    from triforce.execution import fused as fused_module

    if isa not in kernels.runnable_isas() or kernels.variant(isa) is None:
        pytest.skip(f"no {isa} kernels here")
    kern = kernels.variant(isa)
    native, _ = models(long_q4_k_m_file)
    ids = torch.randint(0, 96, (1, 1300), generator=torch.Generator().manual_seed(6))
    python_path = fused_module.layer_args
    outs = {}
    for fused in (True, False):
        monkeypatch.setattr(fused_module, "layer_args", python_path if fused else (lambda block, ops: None))
        counting = _CountingFused(kern, "decode_layers_quant")
        with kernels.override(counting):
            cache = new_cache(native, 1300, record_queries=True, dtype="int8")
            native(ids[:, :1000], cache)  # prefill chunk: the Python path either way
            rows = [native(ids[:, i:i + 1], cache) for i in range(1000, 1070)]  # a group quantized on the way
            rows.append(native(ids[:, 1070:1075], cache))
            queries = cache.recorder.layers[1].clone()
            c = native.cfg
            view = QuantizedCache(c.n_layers, c.n_kv_heads, c.head_dim, 1300, shared=cache)
            view.build(cache)
            rows += [native(ids[:, 1075:1076], view), native(ids[:, 1076:1080], view)]
        outs[fused] = (torch.cat(rows, 1), queries, cache.k_hi[:, :, :, :1024], cache.k_lo[:, :, :, :1024],
                       cache.v_lo[:, :, :, :1024], cache.buffer_k[:, :, :, :1075 - cache.buffer_start])
        assert (counting.fused > 0) == fused
    for got, want in zip(outs[True], outs[False]):
        assert torch.equal(got, want)


def test_kv_on_a_gpu_is_checked_against_the_gpu_memory(monkeypatch):
    """On CUDA the KV cache is checked against the GPU's free memory (simulated here), and a cache that
    does not fit is refused naming --offload-kv; with --offload-kv it is checked against RAM instead."""
    from types import SimpleNamespace

    from triforce import memory

    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=96, num_hidden_layers=32, hidden_size=4096,
                                   num_attention_heads=32, num_key_value_heads=8, intermediate_size=128))
    model = SimpleNamespace(cfg=cfg, kv_dtype=torch.bfloat16, device=torch.device("cuda"), offload_kv=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 80 << 30))
    memory.check_kv_fits(model, 32768)  # 4 GiB of bf16 K/V in 8 GiB free
    with pytest.raises(TriforceError, match="--offload-kv") as e:
        memory.check_kv_fits(model, 131072)  # 16 GiB
    assert "GPU memory" in str(e.value)
    model.offload_kv = True
    monkeypatch.setattr(memory, "available_bytes", lambda: 64 << 30)
    memory.check_kv_fits(model, 131072)  # in RAM: fits
