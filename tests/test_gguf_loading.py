"""GGUF files as llama.cpp's converter writes them load to the model transformers runs from the Hugging
Face directory they came from: every RoPE scaling the converter writes, Qwen3's QK-norm, and clear
errors (never silent skips) for what the loader does not understand."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import hf_tiny
from triforce import kernels
from triforce.config import ModelConfig
from triforce.errors import TriforceError
from triforce.generate import generate_ar
from triforce.loading import build_model
from triforce.loading.gguf_file import check_gguf_architecture, read_gguf
from triforce.loading.hf import load_hf_checkpoint
from triforce.sampling import SamplingParams
from triforce.caches import new_cache

THETA = 10000.0
ORIGINAL_CONTEXT = 64  # the tests run to position 300: well past it, where the scaling matters
ROPES = {
    "none": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT},
    "yarn-tuned": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL_CONTEXT,
                   "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25},
    # head_dim 16, base 1e4: pair 0 keeps its frequency, pairs 1-2 are smoothed, pairs 3-7 divided by 8
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL_CONTEXT},
}


def permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (conversion/llama.py), verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def llama3_rope_factors(rope_params: dict, hparams: dict) -> torch.Tensor:
    """llama.cpp's LlamaModel.generate_extra_tensors (conversion/llama.py): the `rope_freqs` tensor."""
    base = rope_params.get("rope_theta", 10000.0)
    if (dim := hparams.get("head_dim")) is None:
        dim = hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope_params.get("factor", 8.0)
    low_freq_factor = rope_params.get("low_freq_factor", 1.0)
    high_freq_factor = rope_params.get("high_freq_factor", 4.0)
    old_context_len = rope_params.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32)


def convert(hf_dir: Path, out: Path, extra=None, quantize=None) -> Path:
    """Write the save_pretrained directory `hf_dir` as GGUF the way llama.cpp's convert_hf_to_gguf.py
    (llama.cpp vendored in llama-cpp-python 0.3.36, conversion/base.py and llama.py) does with
    --outtype f32, less the tokenizer: TextModel.set_gguf_parameters, LlamaModel.set_gguf_parameters,
    LlamaModel.generate_extra_tensors, and the tensors renamed by gguf-py's TensorNameMap with Q/K
    permuted for the "llama" architecture only. `extra(writer)` may add more before writing;
    `quantize(gguf_name, fp32 array)` may return (raw blocks, GGML type) to store a tensor quantized."""
    hp = json.loads((hf_dir / "config.json").read_text())
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
            "qwen3": gguf.MODEL_ARCH.QWEN3}[hp["model_type"]]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    # TextModel.set_gguf_parameters
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope_type, factor = rope.get("rope_type"), rope.get("factor")
    if rope_type == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if (attn := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
        if (beta_fast := rope.get("beta_fast")) is not None:
            w.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := rope.get("beta_slow")) is not None:
            w.add_rope_scaling_yarn_beta_slow(beta_slow)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == gguf.MODEL_ARCH.LLAMA:  # LlamaModel.set_gguf_parameters and generate_extra_tensors
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(head_dim or hp["hidden_size"] // hp["num_attention_heads"])
        if rope_type == "llama3":
            w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, hp).numpy())
    names = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == gguf.MODEL_ARCH.LLAMA:  # LlamaModel.modify_tensors (undo_permute)
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = permute(t, hp["num_attention_heads"], hp["num_attention_heads"])
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                t = permute(t, hp["num_attention_heads"], hp["num_key_value_heads"])
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        stored = quantize(gguf_name, t.float().numpy()) if quantize is not None else None
        if stored is None:
            w.add_tensor(gguf_name, t.float().numpy())
        else:
            w.add_tensor(gguf_name, stored[0], raw_dtype=stored[1])
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def saved(tmp_path: Path, arch: str, **overrides) -> tuple[Path, torch.nn.Module]:
    """A tiny random model saved with save_pretrained, and transformers' model read back from it."""
    import transformers

    hf_dir = tmp_path / "hf"
    hf_tiny(arch, **overrides).save_pretrained(str(hf_dir))
    return hf_dir, transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def from_gguf(path: Path):
    hf, sd = read_gguf(path, progress=False)
    cfg = ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf(json.loads(json.dumps(hf))) == cfg  # what the cached conversion reads back
    return build_model(cfg, sd)


@torch.no_grad()
def assert_matches(ours, ref, T: int = 300, prompt_len: int = 250) -> float:
    """Logits at positions 0..T-1 within 1e-4 of transformers', on the compiled kernels (where they
    build) and on PyTorch's path; greedy continuations identical. -> the largest logit error."""
    ids = torch.randint(0, 96, (1, T), generator=torch.Generator().manual_seed(0))
    want = ref(ids).logits
    errors = []
    for module in (kernels.cpu(), None):
        with kernels.override(module):
            got = ours(ids, new_cache(ours, T))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        errors.append((got - want).abs().max().item())
    prompt = ids[:, :prompt_len]
    new = T - prompt_len
    greedy = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, prompt_len:].tolist()
    assert generate_ar(ours, prompt[0].tolist(), new, SamplingParams()).tokens == greedy
    return max(errors)


@pytest.mark.parametrize("variant", list(ROPES))
def test_llama_gguf_matches_transformers(tmp_path, variant):
    hf_dir, ref = saved(tmp_path, "llama", rope_parameters=dict(ROPES[variant], rope_theta=THETA))
    path = convert(hf_dir, tmp_path / "model.gguf")
    ours = from_gguf(path)
    if variant == "llama3":  # carried as llama.cpp's per-pair factors, not as transformers' llama3 type
        assert ours.cfg.rope.type == "default" and ours.cfg.rope.freq_factors[0] == 1.0
    else:
        assert ours.cfg.rope.type == ROPES[variant]["rope_type"]
    err = assert_matches(ours, ref)
    print(f"{variant}: max |logit error| {err:.2e}")


@pytest.mark.parametrize("variant", ["none", "yarn"])
def test_qwen3_matches_transformers(tmp_path, variant):
    """Qwen3 (QK-norm, head_dim 32 != hidden / heads = 16), from its HF directory and from GGUF (whose
    Q/K rows the converter leaves unpermuted)."""
    hf_dir, ref = saved(tmp_path, "qwen3", head_dim=32, rope_parameters=dict(ROPES[variant], rope_theta=THETA))
    cfg, sd, _ = load_hf_checkpoint(hf_dir)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 32
    err_dir = assert_matches(build_model(cfg, sd), ref)
    ours = from_gguf(convert(hf_dir, tmp_path / "model.gguf"))
    assert ours.cfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)  # GGUF holds it in float32
    assert replace(ours.cfg, rms_norm_eps=cfg.rms_norm_eps) == cfg
    err_gguf = assert_matches(ours, ref)
    print(f"qwen3 {variant}: max |logit error| directory {err_dir:.2e}, GGUF {err_gguf:.2e}")


def test_qwen2_gguf_matches_transformers(tmp_path):
    """Qwen2: q/k/v biases, Q/K rows not permuted by the converter."""
    hf_dir, ref = saved(tmp_path, "qwen2", rope_parameters=dict(ROPES["yarn"], rope_theta=THETA))
    ours = from_gguf(convert(hf_dir, tmp_path / "model.gguf"))
    assert ours.cfg.qkv_bias and ours.cfg.rope.type == "yarn"
    print(f"qwen2 yarn: max |logit error| {assert_matches(ours, ref):.2e}")


@pytest.mark.parametrize("extra, named", [
    (lambda w: w.add_string("llama.rope.scaling.type", "longrope"), "'longrope'"),
    (lambda w: w.add_string("llama.rope.scaling.type", "ntk-by-parts"), "'ntk-by-parts'"),
    (lambda w: w.add_array("llama.rope.dimension_sections", [4, 4, 0, 0]), "llama.rope.dimension_sections"),
    (lambda w: w.add_float32("llama.attention.logit_softcapping", 30.0), "llama.attention.logit_softcapping"),
    (lambda w: w.add_float32("llama.rope.scaling.attn_factor", 0.5), "llama.rope.scaling.attn_factor"),
    (lambda w: w.add_tensor("blk.1.ffn_gate_inp.weight", np.zeros((4, 64), np.float32)), "'blk.1.ffn_gate_inp.weight'"),
    (lambda w: w.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, np.float32)), "'blk.0.attn_q_norm.weight'"),
    (lambda w: w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32)), "'rope_factors_long.weight'"),
])
def test_what_is_not_understood_is_refused(tmp_path, extra, named):
    """An unknown scaling type, RoPE or attention key, or tensor (QK-norm weights in a Llama file
    too: its forward has none) is named in a TriforceError, never skipped."""
    hf_dir, _ = saved(tmp_path, "llama", rope_parameters={"rope_type": "default", "rope_theta": THETA})
    path = convert(hf_dir, tmp_path / "model.gguf", extra=extra)
    with pytest.raises(TriforceError, match=named.replace(".", r"\.")):
        read_gguf(path, progress=False)


def test_partial_rope_is_refused(tmp_path):
    hf_dir, _ = saved(tmp_path, "qwen3", head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": THETA})
    path = convert(hf_dir, tmp_path / "model.gguf", extra=lambda w: w.add_rope_dimension_count(16))
    with pytest.raises(TriforceError, match="partial RoPE"):
        read_gguf(path, progress=False)


def _write_gemma2(path: Path, vocab: int = 50_000) -> Path:
    """The header of a gemma2 GGUF (an unsupported architecture) with a real-sized vocabulary (what makes
    gguf.GGUFReader slow)."""
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_refused_fast(tmp_path):
    path = _write_gemma2(tmp_path / "tiny-gemma2.gguf")
    # "fast" relative to a baseline taken here: gguf.GGUFReader parsing the same header (about 0.7 s for
    # this vocabulary, a few thousand times the check's time), so a busy host slows both alike
    t0 = time.perf_counter()
    gguf.GGUFReader(str(path))
    reader = time.perf_counter() - t0
    t0 = time.perf_counter()
    with pytest.raises(TriforceError, match="'gemma2'.*supported are llama, qwen2, qwen3, gemma3"):
        check_gguf_architecture(path)
    took = time.perf_counter() - t0
    assert took < reader / 10, (took, reader)
    hf_dir, _ = saved(tmp_path, "llama")
    assert check_gguf_architecture(convert(hf_dir, tmp_path / "llama.gguf")) == "llama"
    (tmp_path / "not.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(TriforceError, match="cannot read GGUF file"):
        check_gguf_architecture(tmp_path / "not.gguf")


def test_cli_refuses_unsupported_architecture(tmp_path):
    """One line naming the supported architectures, exit code 2, no traceback, and quickly (python,
    torch and transformers start within the time; the check itself is milliseconds)."""
    path = _write_gemma2(tmp_path / "tiny-gemma2.gguf")
    # the baseline: the same interpreter starting the same CLI and printing its help (python, torch and
    # transformers imported the same way), timed here so that a busy host slows both alike
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "triforce", "generate", "--help"], capture_output=True, timeout=600, check=True)
    baseline = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "triforce", "generate", "--prompt", "hi", "--model", str(path),
                        "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in ("gemma2", "llama", "qwen2", "qwen3", "gemma3")), r.stderr
    assert took < 3 * baseline + 1, (took, baseline)  # about 1.1 s each on an idle 2-core machine
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing converted
