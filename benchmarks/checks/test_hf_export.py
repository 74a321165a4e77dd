"""The Hugging Face directory handed to vLLM (benchmarks/hf_export.py) computes what triforce computes: a tiny quantized
GGUF exported with a long-context RoPE profile gives transformers the logits triforce gives with that profile."""
from __future__ import annotations

import json

import pytest
import torch

from hf_export import export_hf
from test_fuzz_gguf import _tokenizer
from test_gguf_loading import convert, saved
from triforce import kernels
from triforce.caches import new_cache
from triforce.errors import TriforceError
from triforce.loading import load_model

THETA, CONTEXT = 4.0e5, 512  # the tiny model is saved with base 1e4 and 2048 positions: both must change


@pytest.fixture(scope="module")
def tiny_q5_gguf(tmp_path_factory):
    """A tiny llama GGUF with Q5_0 matrices and a tokenizer (what export_hf reads from the embedded model's
    Q4_1 file: quantized weights, dequantized on the way)."""
    import gguf

    tmp = tmp_path_factory.mktemp("hf-export")
    hf_dir, _ = saved(tmp, "llama", rope_parameters={"rope_type": "default", "rope_theta": 1.0e4})
    q5 = gguf.GGMLQuantizationType.Q5_0
    return convert(hf_dir, tmp / "tiny.gguf", extra=_tokenizer,
                   quantize=lambda name, w: (gguf.quants.quantize(w, q5), q5) if w.ndim == 2 else None)


@torch.no_grad()
def test_export_computes_our_logits_with_the_profile(tiny_q5_gguf, tmp_path):
    import transformers

    cache = tmp_path / "cache"
    out = export_hf(tmp_path / "hf", str(tiny_q5_gguf), rope_theta=THETA, max_context=CONTEXT, cache_dir=cache,
                    progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_parameters"]["rope_theta"] == THETA == cfg["rope_theta"]
    assert cfg["max_position_embeddings"] == CONTEXT
    assert (out / "tokenizer.json").exists() and not list(tmp_path.glob(".tmp*"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(ref) is transformers.LlamaForCausalLM
    ours = load_model(str(tiny_q5_gguf), rope_theta=THETA, max_context=CONTEXT, cache_dir=cache, progress=False,
                      kv_dtype="fp32", weights="fp32")
    # long enough that a RoPE base of 1e4 and 4e5 give different logits
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    want = ref(ids).logits
    with kernels.override(None):
        got = ours.model(ids, new_cache(ours.model, ids.shape[1]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    ref.config.rope_parameters["rope_theta"] = 1.0e4  # (the test can tell: the native base gives other logits)
    other = transformers.LlamaForCausalLM(ref.config).eval()
    other.load_state_dict(ref.state_dict())
    assert (other(ids).logits - want).abs().max() > 1e-2
    # the same request again reuses the directory; another profile into it is refused
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert export_hf(out, str(tiny_q5_gguf), rope_theta=THETA, max_context=CONTEXT, cache_dir=cache,
                     progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(TriforceError, match="remove it or choose another directory"):
        export_hf(out, str(tiny_q5_gguf), rope_theta=1.0e5, max_context=CONTEXT, cache_dir=cache, progress=False)


def test_an_export_killed_mid_write_leaves_nothing_the_next_one_keeps(tiny_q5_gguf, tmp_path):
    """A killed export leaves its temporary folder (`.tmp-<pid>-...`, its pid gone): the next export beside it
    removes it and writes a whole directory."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".tmp-{int(dead.stdout)}-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    out = export_hf(tmp_path / "hf", str(tiny_q5_gguf), rope_theta=THETA, max_context=CONTEXT,
                    cache_dir=tmp_path / "cache", progress=False)
    assert not stale.exists() and (out / "model.safetensors").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "hf"]
