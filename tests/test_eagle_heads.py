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
from test_speculation_distribution import ALPHA, V, exact_marginals, p_values, sample_counts
from triforce.drafthead.eagle import Eagle3Head
from triforce.drafthead.head import DraftHead
from triforce.drafthead.loading import load_head
from triforce.errors import TriforceError
from triforce.generate import generate
from triforce.sampling import SamplingParams
from triforce.speculation.settings import SpecConfig
from triforce.caches import new_cache

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


# --- the loaded weights are the written ones: a plain-torch forward of the file's tensors ---------------------

def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta):
    """x [T, heads, D], half-split RoPE (Llama's) at base theta."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    f = positions.float()[:, None] * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def _reference_layer(sd, attn_in, residual, positions, model, theta):
    """A Llama decoder layer from the file's tensors (layers.0.* / midlayer.*): causal attention over the T
    positions of attn_in, residual adds, the post-attention norm and the SiLU MLP."""
    c = model.cfg
    p = "midlayer." if "midlayer.fc" in sd or any(k.startswith("midlayer.") for k in sd) else "layers.0."
    w = {k[len(p):]: v.float() for k, v in sd.items() if k.startswith(p)}
    T, Hq, Hkv, D = attn_in.shape[0], c.n_heads, c.n_kv_heads, c.head_dim

    def proj(n):
        y = attn_in @ w[f"self_attn.{n}_proj.weight"].T
        return y + w[f"self_attn.{n}_proj.bias"] if f"self_attn.{n}_proj.bias" in w else y

    q = _rope(proj("q").view(T, Hq, D), positions, theta)
    k = _rope(proj("k").view(T, Hkv, D), positions, theta).repeat_interleave(Hq // Hkv, dim=1)
    v = proj("v").view(T, Hkv, D).repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    a = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, Hq * D) @ w["self_attn.o_proj.weight"].T
    h = residual + a
    m = _rms(h, w["post_attention_layernorm.weight"])
    return h + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


def _written(path):
    file = path / "pytorch_model.bin"
    if file.is_file():
        return torch.load(file, weights_only=True)
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("bias", [True, False])
def test_a_loaded_eagle1_head_computes_the_written_weights(tiny_llama, tmp_path, bias):
    path = write_eagle1(tiny_llama, tmp_path / "h", seed=3, bias=bias, qkv_bias=not bias)
    head, sd = load_head(path, tiny_llama), _written(path)
    T, H = 5, tiny_llama.cfg.hidden_size
    g = torch.Generator().manual_seed(4)
    feats, emb = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    positions = torch.arange(7, 7 + T)
    with torch.no_grad():
        got = head(feats[None], emb[None], positions)[0]
        x = torch.cat([emb, feats], -1) @ sd["fc.weight"].float().T + (sd["fc.bias"].float() if bias else 0)
        want = _reference_layer(sd, x, x, positions, tiny_llama, 10000.0)  # no input_layernorm: the fc output itself
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_a_loaded_eagle3_head_computes_the_written_weights(deep_llama, tmp_path, norm_before_residual):
    draft_tokens = [1, 4, 5, 9, 30, 64, 95]
    path = write_eagle3(deep_llama, tmp_path / "h", seed=5, draft_tokens=draft_tokens, rope_theta=500000.0,
                        **({"norm_before_residual": True} if norm_before_residual else {}))
    head, sd = load_head(path, deep_llama), _written(path)
    T, H = 5, deep_llama.cfg.hidden_size
    g = torch.Generator().manual_seed(6)
    feats, emb = torch.randn(T, 3 * H, generator=g), torch.randn(T, H, generator=g)
    positions = torch.arange(3, 3 + T)
    f = {k: v.float() for k, v in sd.items()}
    with torch.no_grad():
        got = head(feats[None], emb[None], positions)[0]
        h = feats @ f["fc.weight"].T
        normed = _rms(h, f["midlayer.hidden_norm.weight"])
        x = torch.cat([_rms(emb, f["midlayer.input_layernorm.weight"]), normed], -1)
        want = _reference_layer(sd, x, normed if norm_before_residual else h, positions, deep_llama, 500000.0)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # its own prediction (hidden wide) is fed as it is, past fc
        again = head(got[None], emb[None], positions)[0]
        normed = _rms(got, f["midlayer.hidden_norm.weight"])
        x = torch.cat([_rms(emb, f["midlayer.input_layernorm.weight"]), normed], -1)
        torch.testing.assert_close(again, _reference_layer(sd, x, normed if norm_before_residual else got, positions,
                                                           deep_llama, 500000.0), rtol=1e-4, atol=1e-4)
        logits = head.logits(got[-1], deep_llama)
    draft = _rms(got[-1], f["norm.weight"]) @ f["lm_head.weight"].T
    assert logits.shape == (deep_llama.cfg.vocab_size,)
    torch.testing.assert_close(logits[draft_tokens], draft, rtol=1e-4, atol=1e-4)
    outside = [t for t in range(deep_llama.cfg.vocab_size) if t not in draft_tokens]
    assert torch.isneginf(logits[outside]).all()


def test_the_target_gives_the_inputs_of_the_layers_an_eagle3_head_reads():
    """Transformer.forward(hidden=True, layers=...) -> the inputs of those layers, concatenated: transformers'
    hidden_states[i] (the embeddings for i = 0), what EAGLE's modeling_llama_kv.py and vLLM capture."""
    hf = hf_tiny("llama", seed=2, num_hidden_layers=8)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
        logits, features = ours(ids, new_cache(ours, 16), hidden=True, layers=(0, 4, 5))
        plain = ours(ids, new_cache(ours, 16), hidden=True)[0]
    torch.testing.assert_close(features, torch.cat([states[0], states[4], states[5]], -1), rtol=1e-3, atol=1e-3)
    assert torch.equal(logits, plain)


# --- clear errors: one sentence naming the problem and the fix -------------------------------------------------

@pytest.fixture(scope="module")
def wide_llama():
    return ours_from_hf(hf_tiny("llama", seed=3, hidden_size=48, intermediate_size=96, num_hidden_layers=8))


@pytest.fixture(scope="module")
def big_vocab_llama():
    return ours_from_hf(hf_tiny("llama", seed=4, vocab_size=128, num_hidden_layers=8))


@pytest.mark.parametrize("writer", [write_eagle1, write_eagle3])
def test_a_head_for_another_hidden_size_or_vocabulary_is_refused(deep_llama, wide_llama, big_vocab_llama, tmp_path,
                                                                 writer):
    path = writer(deep_llama, tmp_path / "h")
    with pytest.raises(TriforceError, match="hidden size 64, but this llama model's hidden size is 48"):
        load_head(path, wide_llama)
    with pytest.raises(TriforceError, match="vocabulary of 96 tokens, but this llama model's is 128"):
        load_head(path, big_vocab_llama)


def test_an_eagle3_head_whose_draft_vocabulary_maps_outside_the_target_is_refused(deep_llama, tmp_path):
    path = write_eagle3(deep_llama, tmp_path / "h", draft_tokens=[1, 2, 200])
    with pytest.raises(TriforceError, match="draft vocabulary \\(d2t\\) onto tokens outside"):
        load_head(path, deep_llama)


def test_an_eagle3_head_for_a_deeper_model_is_refused(tiny_llama, deep_llama, tmp_path):
    """EAGLE-3 reads the inputs of layers 2, n // 2 and n - 3: a 2-layer model has no three such layers."""
    with pytest.raises(TriforceError, match="target layers \\[-1, 1, 2\\].*2-layer llama model"):
        load_head(write_eagle3(tiny_llama, tmp_path / "a"), tiny_llama)
    path = write_eagle3(deep_llama, tmp_path / "b", eagle_aux_hidden_state_layer_ids=[1, 4, 9])
    with pytest.raises(TriforceError, match="target layers \\[1, 4, 9\\]"):
        load_head(path, deep_llama)


@pytest.mark.parametrize("change", [dict(hidden_act="gelu"), dict(num_hidden_layers=2), dict(model_type="gemma3")])
def test_a_head_of_another_architecture_is_refused(tiny_llama, tmp_path, change):
    path = write_eagle1(tiny_llama, tmp_path / "h", **change)
    with pytest.raises(TriforceError, match="architecture triforce does not run"):
        load_head(path, tiny_llama)


def test_a_head_without_its_weights_file_is_refused(tiny_llama, tmp_path):
    path = write_eagle1(tiny_llama, tmp_path / "h")
    (path / "pytorch_model.bin").unlink()
    with pytest.raises(TriforceError, match="no weights: expected pytorch_model.bin or model.safetensors"):
        load_head(path, tiny_llama)


def test_weights_of_an_unknown_layout_are_refused(tiny_llama, tmp_path):
    """A Medusa checkpoint (medusa_head.*), say: neither EAGLE layout."""
    path = _save(tmp_path / "h", _config(tiny_llama), {"medusa_head.0.0.linear.weight": torch.zeros(64, 64)},
                 "pytorch_model.bin")
    with pytest.raises(TriforceError, match="unknown layout \\(tensors medusa_head.0.0.linear.weight\\)"):
        load_head(path, tiny_llama)
    path = write_eagle1(tiny_llama, tmp_path / "hass", seed=1)  # an EAGLE-1 variant with extra norms
    sd = torch.load(path / "pytorch_model.bin", weights_only=True)
    sd["embedding_layernorm.weight"] = torch.ones(64, dtype=torch.float16)
    torch.save(sd, path / "pytorch_model.bin")
    with pytest.raises(TriforceError, match="tensors its layout does not have \\(embedding_layernorm.weight\\)"):
        load_head(path, tiny_llama)


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.safetensors"])
def test_a_damaged_head_is_refused(deep_llama, tmp_path, filename):
    path = write_eagle3(deep_llama, tmp_path / "h", filename=filename)
    data = (path / filename).read_bytes()
    (path / filename).write_bytes(data[: len(data) // 2])  # a download cut short
    with pytest.raises(TriforceError, match="damaged or incomplete; download it again"):
        load_head(path, deep_llama)
    path = write_eagle3(deep_llama, tmp_path / "short", filename=filename)
    sd = _written(path)
    del sd["midlayer.mlp.down_proj.weight"]
    _save(path, json.loads((path / "config.json").read_text()), sd, filename)
    with pytest.raises(TriforceError, match="lacks layers.0.mlp.down_proj.weight"):
        load_head(path, deep_llama)
    path = write_eagle1(deep_llama, tmp_path / "shape", filename=filename, intermediate_size=100)
    with pytest.raises(TriforceError, match="disagrees with its config.json: layer.w_gate_up.weight"):
        load_head(path, deep_llama)
    (path / "config.json").write_text("{not json")
    with pytest.raises(TriforceError, match="cannot read the draft head's config.json"):
        load_head(path, deep_llama)


# --- sampled output is exact with a draft vocabulary (q = 0 outside it) -----------------------------------------

DRAFT_TOKENS = [0, 2, 3, 5, 7]  # of V = 8


@pytest.fixture(scope="module")
def sampling_target():
    return ours_from_hf(hf_tiny("llama", seed=21, vocab_size=V, initializer_range=0.5, max_position_embeddings=256,
                                num_hidden_layers=3))


@pytest.fixture(scope="module")
def eagle3_dir(sampling_target, tmp_path_factory):
    """An EAGLE-3 head over all three layers' inputs of a 3-layer target, its LM head the target's rows of the
    draft vocabulary (so that q overlaps p) plus noise."""
    path = write_eagle3(sampling_target, tmp_path_factory.mktemp("eagle3"), seed=8, draft_tokens=DRAFT_TOKENS,
                        eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    sd = _written(path)
    sd["lm_head.weight"] = (sampling_target.lm_head.weight.detach()[DRAFT_TOKENS] + 0.1 * sd["lm_head.weight"].float())
    return _save(path, json.loads((path / "config.json").read_text()), sd, "pytorch_model.bin")


@pytest.fixture(scope="module")
def sampling_prompt():
    base = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    return (base * 4)[:48]


def test_an_eagle3_heads_q_is_zero_outside_its_draft_vocabulary(sampling_target, eagle3_dir, sampling_prompt,
                                                                monkeypatch):
    from triforce.drafthead.drafter import HeadDrafter

    rows = []
    original = HeadDrafter.propose

    def recording(self, ctx, committed, k):
        tokens, q = original(self, ctx, committed, k)
        if q is not None:
            rows.append(q)
        return tokens, q

    monkeypatch.setattr(HeadDrafter, "propose", recording)
    for seed in range(5):
        generate(sampling_target, sampling_prompt, 8, SamplingParams(temperature=1.0), stack="head,full",
                 config=SpecConfig(**CFG, head=str(eagle3_dir)), seed=seed)
    q = torch.cat(rows)
    outside = [t for t in range(V) if t not in DRAFT_TOKENS]
    assert q.shape[0] > 10 and torch.all(q[:, outside] == 0) and torch.allclose(q.sum(-1), torch.ones(q.shape[0]))


@pytest.mark.slow  # statistical tests beyond one per family (pyproject.toml's `slow` marker)
def test_sampled_tokens_with_an_eagle3_head_follow_the_target_distribution(sampling_target, eagle3_dir,
                                                                           sampling_prompt):
    params = SamplingParams(temperature=1.0)
    exact = exact_marginals(sampling_target, sampling_prompt, params)
    tops: list[dict] = []  # the top level's stats per run: the head's verifier in head,full
    counts = sample_counts((sampling_target, None), sampling_prompt, None, SpecConfig(**CFG, head=str(eagle3_dir)),
                           params=params, stack="head,full", tops=tops)
    accepted = sum(top["accepted"] for top in tops)
    pv = p_values(counts, exact)
    assert min(pv) > ALPHA, f"chi-square p-values {pv}"
    assert accepted > 100  # the head's drafts were accepted often enough for the check to test them
