"""Published EAGLE heads (drafthead/eagle.py) in a stack: tiny random heads written in the layouts the published
ones use (key names, shapes, config.json fields as SafeAILab/EAGLE writes them: eagle/model/cnets1.py and
eagle/train/*config*.json for EAGLE-1; eagle/model/cnets.py, eagle/traineagle3/ for EAGLE-3; vLLM's
llama_eagle.py / llama_eagle3.py load the same), loaded for the tiny test models. Greedy output is ar's; the loaded
head computes what a plain-torch forward of the written weights computes; sampled output follows the target's
distribution with an EAGLE-3 draft vocabulary (q is 0 outside it); and every way a head can be wrong for the
target is refused with a clear error."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import hf_tiny, ours_from_hf
from test_speculation_distribution import ALPHA, POSITIONS, V, exact_marginals, p_values
from triforce.drafthead.eagle import Eagle3Head
from triforce.drafthead.head import DraftHead, load_head
from triforce.errors import TriforceError
from triforce.generate import generate
from triforce.sampling import SamplingParams
from triforce.speculation.config import SpecConfig

CFG = dict(gamma=3, gamma_draft=2, budget=20, chunk_size=4, recent=4, rebuild_every=8, sink=2, window=6, ngram=2,
           prefill_chunk=64, adapt=False)


def _config(model, **fields) -> dict:
    """config.json of a head for `model`, with the fields EAGLE's published configs carry (eagle/train/
    EAGLE-LLaMA3-Instruct-8B, eagle/traineagle3/config.json), sized for the tiny model."""
    c = model.cfg
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": 2 * c.hidden_size,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
            "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
            "use_cache": True, "vocab_size": c.vocab_size, **fields}


def _layer(model, g, inputs: int, prefix: str, eagle3: bool, qkv_bias: bool = False) -> dict:
    """One Llama decoder layer's tensors under `prefix` (EAGLE-1: no input_layernorm; EAGLE-3: q/k/v over
    2 * hidden, input_layernorm and hidden_norm)."""
    c = model.cfg
    H, D, F_ = c.hidden_size, c.head_dim, 2 * c.hidden_size

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    a, m = prefix + "self_attn.", prefix + "mlp."
    t = {a + "q_proj.weight": w(c.n_heads * D, inputs), a + "k_proj.weight": w(c.n_kv_heads * D, inputs),
         a + "v_proj.weight": w(c.n_kv_heads * D, inputs), a + "o_proj.weight": w(H, c.n_heads * D),
         m + "gate_proj.weight": w(F_, H), m + "up_proj.weight": w(F_, H), m + "down_proj.weight": w(H, F_),
         prefix + "post_attention_layernorm.weight": 1 + w(H, std=0.1)}
    if qkv_bias:
        for n, rows in (("q", c.n_heads * D), ("k", c.n_kv_heads * D), ("v", c.n_kv_heads * D)):
            t[a + n + "_proj.bias"] = w(rows)
    if eagle3:
        t[prefix + "input_layernorm.weight"] = 1 + w(H, std=0.1)
        t[prefix + "hidden_norm.weight"] = 1 + w(H, std=0.1)
    return t


def _save(path, config: dict, sd: dict, filename: str):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    sd = {k: v.half() if v.is_floating_point() else v for k, v in sd.items()}  # published heads are fp16
    if filename.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(sd, str(path / filename))
    else:
        torch.save(sd, path / filename)
    return path


def write_eagle1(model, path, seed=0, bias=True, qkv_bias=False, embed=True, filename="pytorch_model.bin",
                 **fields):
    """An EAGLE-1 head as SafeAILab/EAGLE saves one (eagle/model/cnets1.py Model: fc over [embedding, feature]
    with a bias unless config "bias": false, layers.0 without input_layernorm, the frozen embed_tokens too)."""
    g = torch.Generator().manual_seed(seed)
    H = model.cfg.hidden_size
    sd = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.15, **_layer(model, g, H, "layers.0.", False, qkv_bias)}
    if bias:
        sd["fc.bias"] = torch.randn(H, generator=g) * 0.1
    if embed:
        sd["embed_tokens.weight"] = model.embed.weight.detach().clone()
    config = _config(model, **({} if bias else {"bias": False}), **({"qkv_bias": True} if qkv_bias else {}), **fields)
    return _save(path, config, sd, filename)


def write_eagle3(model, path, seed=0, draft_tokens=None, filename="pytorch_model.bin", prefix="midlayer.",
                 **fields):
    """An EAGLE-3 head as SafeAILab/EAGLE saves one (eagle/model/cnets.py Model, eagle/traineagle3/: fc over
    three target layers' features without a bias, midlayer with q/k/v over 2 * hidden, norm, lm_head over the
    draft vocabulary, d2t (draft id i -> target id i + d2t[i]) and t2d (target id -> in the draft vocabulary))."""
    g = torch.Generator().manual_seed(seed)
    H, Vt = model.cfg.hidden_size, model.cfg.vocab_size
    draft_tokens = sorted(draft_tokens if draft_tokens is not None else range(0, Vt, 2))
    Vd = len(draft_tokens)
    sd = {"fc.weight": torch.randn(H, 3 * H, generator=g) * 0.1, **_layer(model, g, 2 * H, prefix, True),
          "norm.weight": 1 + torch.randn(H, generator=g) * 0.1, "lm_head.weight": torch.randn(Vd, H, generator=g),
          "d2t": torch.tensor([t - i for i, t in enumerate(draft_tokens)], dtype=torch.long),
          "t2d": torch.tensor([t in draft_tokens for t in range(Vt)], dtype=torch.bool)}
    return _save(path, _config(model, draft_vocab_size=Vd, **fields), sd, filename)


@pytest.fixture(scope="module")
def deep_llama():
    """A tiny Llama deep enough for EAGLE-3's default layers 2, n // 2, n - 3 to be three (2, 4, 5)."""
    return ours_from_hf(hf_tiny("llama", seed=1, num_hidden_layers=8))


def _prompt(model, n=60, seed=1):
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy_is_ar(model, path, stack="head,full"):
    prompt = _prompt(model)
    ar = generate(model, prompt, 40, SamplingParams(), method="ar")
    res = generate(model, prompt, 40, SamplingParams(), stack=stack, config=SpecConfig(**CFG, head=str(path)))
    assert res.tokens == ar.tokens
    head = res.stats["levels"][-1]
    assert head["level"] == "head" and head["tokens"] > 0 and head["catch_up_rows"] > 0


@pytest.mark.parametrize("variant", ["llama2 (fc bias)", "llama3 (bias false)", "qwen2 (qkv_bias)"])
def test_greedy_output_with_an_eagle1_head_is_ar_output(tiny_llama, tmp_path, variant):
    kw = {"llama2 (fc bias)": {}, "llama3 (bias false)": dict(bias=False, rope_theta=500000.0, embed=False),
          "qwen2 (qkv_bias)": dict(qkv_bias=True)}[variant]
    path = write_eagle1(tiny_llama, tmp_path / "h", **kw)
    assert isinstance(load_head(path, tiny_llama), DraftHead)
    _greedy_is_ar(tiny_llama, path)


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.safetensors"])
@pytest.mark.parametrize("stack", ["head,full", "head,retrieval,full"])
def test_greedy_output_with_an_eagle3_head_is_ar_output(deep_llama, tmp_path, filename, stack):
    path = write_eagle3(deep_llama, tmp_path / "h", filename=filename, architectures=["LlamaForCausalLMEagle3"])
    head = load_head(path, deep_llama)
    assert isinstance(head, Eagle3Head) and head.feature_layers == (2, 4, 5)
    _greedy_is_ar(deep_llama, path, stack)
