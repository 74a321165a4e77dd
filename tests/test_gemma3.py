"""Gemma 3 text models equal transformers' Gemma3ForCausalLM, from a Hugging Face directory and from a GGUF
file in llama.cpp's converter layout: (1 + w) norms, sandwich norms, scaled embeddings, GeGLU, QK-norm,
query_pre_attn_scalar, final logit softcapping, and sliding-window layers with their own RoPE, checked at
positions far past the window. The sliding-window cache (a ring) equals the one-shot forward fed token by
token, in chunks and across rollbacks; drafting levels act on the global layers and every stack equals ar."""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file

from conftest import hf_tiny
from triforce import kernels
from triforce.config import ModelConfig
from triforce.errors import TriforceError
from triforce.generate import generate_ar
from triforce.caches import FullCache, RetrievalCache, SlidingWindowCache, StreamingCache
from triforce.loading import build_model
from triforce.loading.gguf_file import check_gguf_architecture, read_gguf
from triforce.loading.hf import load_hf_checkpoint
from triforce.sampling import SamplingParams
from triforce.speculation.settings import SpecConfig
from triforce.caches import new_cache

V, WINDOW, T = 96, 16, 200  # positions 0..199: twelve windows
# 1 KV head for 4 query heads, head_dim 32 != hidden / heads = 16
GEMMA = dict(num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, tie_word_embeddings=True)


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(seed))


def saved(tmp_path: Path, **overrides):
    """A tiny random Gemma 3 saved with save_pretrained, and transformers' model read back from it."""
    import transformers

    hf_dir = tmp_path / "hf"
    hf_tiny("gemma3", **dict(GEMMA, **overrides)).save_pretrained(str(hf_dir))
    return hf_dir, transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


@torch.no_grad()
def assert_matches(ours, ref, prompt_len: int = 170) -> float:
    """Logits at positions 0..T-1 within 1e-4 of transformers' and greedy continuations identical, on the
    compiled kernels (where they build) and on PyTorch's path. -> the largest logit error."""
    ids = ids_of(T)
    want = ref(ids).logits
    prompt, new = ids[:, :prompt_len], T - prompt_len
    greedy = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, prompt_len:].tolist()
    errors = []
    for module in (kernels.cpu(), None):
        with kernels.override(module):
            got = ours(ids, new_cache(ours, T))
            assert generate_ar(ours, prompt[0].tolist(), new, SamplingParams()).tokens == greedy
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        errors.append((got - want).abs().max().item())
    return max(errors)


@pytest.mark.parametrize("variant", ["plain", "softcap-scaled"])
def test_hf_directory_matches_transformers(tmp_path, variant):
    """Layers alternate (sliding_window_pattern 3: two sliding, one global); queries scaled by
    query_pre_attn_scalar 24 (not head_dim 32); the second variant adds final logit softcapping and
    linear RoPE scaling of the global layers."""
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    extra = {}
    if variant == "softcap-scaled":
        rope["full_attention"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
        extra = dict(final_logit_softcapping=3.0)
    hf_dir, ref = saved(tmp_path, num_hidden_layers=6, sliding_window_pattern=3, query_pre_attn_scalar=24,
                        rope_parameters=rope, **extra)
    assert ref.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    cfg, sd, _ = load_hf_checkpoint(hf_dir)
    assert cfg.sliding_layers == (0, 1, 3, 4) and cfg.sliding_window == WINDOW and cfg.head_dim == 32
    assert cfg.rope.theta == 1e6 and cfg.rope_local.theta == 1e4 and cfg.attention_scale == 24 ** -0.5
    ours = build_model(cfg, sd)
    err = assert_matches(ours, ref)
    # The window matters at these positions: without it, the logits are far off.
    wide = build_model(replace(cfg, sliding_window=T), sd)
    assert (wide(ids_of(T), new_cache(wide, T)) - ref(ids_of(T)).logits).abs().max() > 1e-2
    print(f"gemma3 {variant}: max |logit error| {err:.2e}")


def test_transformers_4_config_reads_the_same():
    """A config.json of transformers 4.x (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern,
    no layer_types) gives the same ModelConfig as 5.x's rope_parameters per layer type."""
    new = hf_tiny("gemma3", **GEMMA, num_hidden_layers=6, sliding_window_pattern=3,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}).config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=3)
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)
    with pytest.raises(TriforceError, match="attention logit softcapping"):
        ModelConfig.from_hf({**new, "attn_logit_softcapping": 50.0})
    with pytest.raises(TriforceError, match="bidirectional"):
        ModelConfig.from_hf({**new, "use_bidirectional_attention": True})


def convert_gemma3(hf_dir: Path, out: Path, swa_base: bool = True, extra=None) -> Path:
    """Write the save_pretrained directory `hf_dir` as GGUF the way llama.cpp's convert_hf_to_gguf.py (vendored
    in llama-cpp-python 0.3.36: conversion/base.py TextModel.set_gguf_parameters, conversion/gemma.py
    Gemma3Model) does with --outtype f32, less the tokenizer: every norm weight stored as 1 + w, Q/K not
    permuted, the sliding window but no layer pattern or query_pre_attn_scalar. `swa_base`: whether the local
    RoPE base is written (rope.freq_base_swa, by newer converters; files without it mean 1e4). `extra(writer)`
    may add more before writing."""
    hp = json.loads((hf_dir / "config.json").read_text())
    rope = hp["rope_parameters"]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA3])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    if swa_base:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if hp.get("sliding_window_pattern") != 1:
        w.add_sliding_window(hp["sliding_window"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, hp["num_hidden_layers"])
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name.endswith("norm.weight"):  # Gemma3Model.norm_shift
            t = t + 1
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), t.float().numpy())
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("variant", ["swa-base", "defaults", "pattern-key"])
def test_gguf_matches_transformers(tmp_path, variant):
    """Final logit softcapping; the local RoPE base read from the file (2e4) or, absent, llama.cpp's default
    1e4; the layer pattern llama.cpp's default (seven layers: layer 5 global, the others sliding) or, as
    newer writers may store it, a per-layer array (pattern 3)."""
    local = 2e4 if variant == "swa-base" else 1e4
    layers = dict(num_hidden_layers=7)  # llama.cpp's default pattern 6: layer 5 global
    if variant == "pattern-key":
        layers = dict(num_hidden_layers=6, sliding_window_pattern=3)
    hf_dir, ref = saved(tmp_path, **layers, query_pre_attn_scalar=32, final_logit_softcapping=4.0,
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": local}})
    sliding = [t == "sliding_attention" for t in ref.config.layer_types]
    extra = (lambda w: w.add_sliding_window_pattern(sliding)) if variant == "pattern-key" else None
    path = convert_gemma3(hf_dir, tmp_path / "model.gguf", swa_base=variant == "swa-base", extra=extra)
    assert check_gguf_architecture(path) == "gemma3"
    hf, sd = read_gguf(path, progress=False)
    cfg = ModelConfig.from_hf(json.loads(json.dumps(hf)))  # what the cached conversion reads back
    want, _, _ = load_hf_checkpoint(hf_dir)
    assert cfg.sliding_layers == tuple(i for i, s in enumerate(sliding) if s) and cfg.rope_local.theta == local
    assert cfg.sliding_layers == ((0, 1, 3, 4) if variant == "pattern-key" else (0, 1, 2, 3, 4, 6))
    # the same but for eps (GGUF holds it in float32) and the special tokens (no tokenizer written here)
    assert replace(cfg, rms_norm_eps=want.rms_norm_eps, bos_token_id=want.bos_token_id,
                   eos_token_ids=want.eos_token_ids) == want
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():  # norms back to w, not 1 + w
        torch.testing.assert_close(sd[name], tensor, atol=1e-6, rtol=0)
    err = assert_matches(build_model(cfg, sd), ref)
    print(f"gemma3 GGUF ({variant}): max |logit error| {err:.2e}")


@pytest.fixture(scope="module")
def tiny_gemma():
    """Ours only (no reference needed): six layers, sliding pattern 3, window 16."""
    hf = hf_tiny("gemma3", seed=3, **GEMMA, num_hidden_layers=6, sliding_window_pattern=3)
    return build_model(ModelConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()))


def ring_cache(model, extra: int) -> SlidingWindowCache:
    c = model.cfg
    return SlidingWindowCache(c.layer_windows, c.n_kv_heads, c.head_dim, T + 16, extra=extra)


@pytest.mark.parametrize("extra", [4, 64])
@torch.no_grad()
def test_ring_cache_fed_in_pieces_equals_one_shot(tiny_gemma, extra):
    """Token by token and in chunks (in place and, past `extra`, over ring + new keys) the ring cache
    gives the one-shot forward's logits, and its memory stays window - 1 + extra slots."""
    m = tiny_gemma
    ids = ids_of(T, seed=1)
    whole = m(ids, new_cache(m, T))
    for pieces in ([1] * T, [5, 1, 30, 3, 64, 65, 2, 7, 1, 22]):
        cache = ring_cache(m, extra)
        got, pos = [], 0
        for n in pieces:
            got.append(m(ids[:, pos:pos + n], cache))
            pos += n
        assert pos == T
        torch.testing.assert_close(torch.cat(got, dim=1), whole, atol=1e-4, rtol=1e-4)
        assert cache.k.shape[3] == WINDOW - 1 + extra


@torch.no_grad()
def test_ring_cache_rollback(tiny_gemma):
    """Every feed (in place, or of more than `extra` tokens) follows a rejected draft rolled back: the
    logits stay exact. A rollback deeper than the ring keeps is refused, never silently wrong."""
    m, extra = tiny_gemma, 8
    ids = ids_of(T, seed=2)
    whole = m(ids, new_cache(m, T))
    cache = ring_cache(m, extra)
    got, pos, step = [], 0, 0
    while pos < T:
        n = min([6, 1, 3, 12][step % 4], T - pos)
        draft = [3, 8, 5, 1][step % 4]
        m(ids_of(draft, seed=100 + step), cache)  # a draft, all rejected
        cache.rollback(pos)
        got.append(m(ids[:, pos:pos + n], cache))
        pos, step = pos + n, step + 1
    torch.testing.assert_close(torch.cat(got, dim=1), whole, atol=1e-4, rtol=1e-4)
    lowest = cache.min_rollback()  # `extra` below the highest position written (drafts included)
    assert lowest == cache.high - extra + 1 and T - extra <= lowest < T
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(lowest - 1)
    cache.rollback(lowest)  # exactly as deep as the ring allows: still exact
    torch.testing.assert_close(m(ids[:, lowest:], cache), whole[:, lowest:], atol=1e-4, rtol=1e-4)
    fresh = ring_cache(m, extra)  # before any slot is reused, any rollback is fine
    m(ids[:, :WINDOW], fresh)
    fresh.rollback(0)
    torch.testing.assert_close(m(ids[:, :40], fresh), whole[:, :40], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_caches_without_the_windows_are_refused(tiny_gemma):
    """A cache that does not implement the sliding-window layers (any cache but a SlidingWindowCache) is
    refused, never run with keys the model would not see."""
    m, c = tiny_gemma, tiny_gemma.cfg
    streaming = StreamingCache(c.n_layers, c.n_kv_heads, c.head_dim, sink=4, window=16)
    plain = FullCache(c.n_layers, c.n_kv_heads, c.head_dim, 64)
    for cache in (streaming, plain):
        with pytest.raises(TriforceError, match="use a SlidingWindowCache"):
            m(ids_of(4), cache)


def drafting_cache(model, global_cache) -> SlidingWindowCache:
    c = model.cfg
    return SlidingWindowCache(c.layer_windows, c.n_kv_heads, c.head_dim, global_cache=global_cache)


@torch.no_grad()
def test_retrieval_level_copies_the_ring(tiny_gemma):
    """A retrieval level of a sliding-window model selects over the global layers and copies the target's
    ring: with a budget holding the whole context it equals the target (same logits for the next tokens,
    after drafts rolled back on both sides); with a small budget it differs (the test can fail)."""
    m, c = tiny_gemma, tiny_gemma.cfg
    n_global = sum(w is None for w in c.layer_windows)
    ids = ids_of(T, seed=5)
    n = 150
    target = new_cache(m, T + 16, record_queries=True)
    m(ids[:, :n], target)
    m(ids_of(6, seed=9), target)  # a draft the target verified and rejected
    target.rollback(n)
    m(ids[:, n:n + 1], target)  # the last token fed: its queries score the chunks
    drafts = {}
    for budget in (n + 64, 40):
        drafts[budget] = drafting_cache(m, RetrievalCache(n_global, c.n_kv_heads, c.head_dim, budget=budget,
                                                          chunk_size=4, recent=8))
        drafts[budget].build(target)
        assert drafts[budget].length == n + 1 and drafts[budget].built_at == n + 1
    want = m(ids[:, n + 1:n + 9], target)
    for budget, equal in ((n + 64, True), (40, False)):
        got = torch.cat([m(ids[:, i:i + 1], drafts[budget]) for i in range(n + 1, n + 9)], dim=1)
        assert torch.allclose(got, want, atol=1e-4) == equal
    with pytest.raises(ValueError, match="ring of"):
        other = SlidingWindowCache(c.layer_windows, c.n_kv_heads, c.head_dim, global_cache=RetrievalCache(
            n_global, c.n_kv_heads, c.head_dim, budget=40, chunk_size=4, recent=8), extra=8)
        other.build(target)


GEMMA_SPEC = SpecConfig(gamma=4, gamma_draft=2, budget=48, chunk_size=4, recent=8, rebuild_every=16, sink=4, window=20,
                        ngram=3, prefill_chunk=64)
GEMMA_STACKS = [("ngram,retrieval,full", "3,4"), ("streaming,retrieval,full", "2,4"), ("retrieval,full", "4"),
                ("streaming:12,full", "3"), ("ngram,streaming:24,retrieval:40,retrieval:96,full", "2,2,3,4"),
                ("ngram,full", "5"), ("kv4,full", "4"), ("ngram,kv4,retrieval:40,full", "2,3,4"),
                ("ngram,h2o:40,full", "2,4")]


@pytest.mark.parametrize("levels,gammas", GEMMA_STACKS)
def test_every_stack_equals_ar_on_a_sliding_window_model(tiny_gemma, levels, gammas):
    """Retrieval and streaming levels act on the global layers of a Gemma-like model (the sliding-window
    layers keep the target's window): every stack is greedy-identical to ar, on a prompt many windows
    long, with rebuilds, and each drafting level proposes."""
    from triforce.generate import generate
    from triforce.speculation.stack import StackSpec

    m = tiny_gemma
    base = ids_of(60, seed=7)[0].tolist()
    prompt = (base * 4)[:230]  # repeats, so the n-gram drafter proposes
    ref = generate_ar(m, prompt, 60, config=GEMMA_SPEC).tokens  # the same prefill chunks
    res = generate(m, prompt, 60, stack=StackSpec.parse(levels, gammas), config=GEMMA_SPEC)
    assert res.tokens == ref
    assert not res.stats.get("notes")
    for lvl in res.stats["levels"][:-1]:
        assert lvl["rounds"] >= 1 and lvl["proposed"] >= 1
    if "retrieval" in levels:
        assert res.stats["retrieval_rebuilds"] >= 2


def test_prefilled_prompt_is_reused_on_a_sliding_window_model(tiny_gemma):
    """A prefilled prompt restores the ring too: generations after a long one start from the prompt's
    window (a plain rollback that deep is refused by the ring)."""
    from triforce.generate import generate
    from triforce.speculation.state import PrefilledPrompt

    m = tiny_gemma
    prompt = ids_of(150, seed=8)[0].tolist()
    ref = generate_ar(m, prompt, 100).tokens
    pre = PrefilledPrompt(m, prompt, len(prompt) + 200)
    for method in ("ar", "triforce", "ar"):
        assert generate(m, prompt, 100, method=method, config=GEMMA_SPEC, prefilled=pre).tokens == ref


def test_deep_gammas_are_refused_on_a_sliding_window_model(tiny_gemma):
    from triforce.generate import generate
    from triforce.speculation.stack import StackSpec

    with pytest.raises(TriforceError, match="draft trees"):
        generate(tiny_gemma, ids_of(100)[0].tolist(), 8, method="sequoia", config=GEMMA_SPEC)
    with pytest.raises(TriforceError, match="use smaller gammas"):
        generate(tiny_gemma, ids_of(100)[0].tolist(), 8, stack=StackSpec.parse("ngram,retrieval,full", "8,12"),
                 config=GEMMA_SPEC)


GEMMA3_ENV = "TRIFORCE_GEMMA3_GGUF"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"  # `./install.sh gemma3` puts it under the cache directory's gemma3/


def real_gemma3_file() -> Path:
    """The real Gemma 3 270M GGUF: $TRIFORCE_GEMMA3_GGUF, else where `./install.sh gemma3` puts it; skips if
    neither is there (a set variable naming no file fails: a typo must not turn into a skip)."""
    from triforce.storage import cache_root

    env = os.environ.get(GEMMA3_ENV)
    if env:
        assert Path(env).is_file(), f"${GEMMA3_ENV} = {env} is not a file"
        return Path(env)
    path = cache_root() / "gemma3" / GEMMA3_FILE
    if not path.is_file():
        pytest.skip(f"the Gemma 3 270M file is not at {path}: ./install.sh gemma3 (or set ${GEMMA3_ENV}; docs/gemma3.md)")
    return path


@pytest.mark.slow
def test_real_gemma3_270m_matches_transformers():
    """The real Gemma 3 270M GGUF (./install.sh gemma3, or TRIFORCE_GEMMA3_GGUF=path; docs/gemma3.md): against transformers
    loading the same file, teacher-forced on 1,024 tokens of the built-in corpus with BOS: argmax agreement
    >= 99% and perplexity within 1%."""
    path = real_gemma3_file()
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    import transformers

    from triforce.commands.perplexity import model_tokens, token_nll
    from triforce.corpus import demo_text
    from triforce.loading import load_model

    loaded = load_model(path, progress=False)
    ids = model_tokens(loaded.tokenizer, demo_text(8000))[:1024]
    assert ids[0] == loaded.tokenizer.bos_token_id
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        want = ref(x).logits[0]
        cache = new_cache(loaded.model, len(ids))
        got = torch.cat([loaded.model(x[:, s:s + 256], cache)[0] for s in range(0, len(ids), 256)])
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    ppl_ref = math.exp(torch.nn.functional.cross_entropy(want[:-1], x[0, 1:]).item())
    ppl = math.exp(token_nll(loaded.model, ids, 512).mean().item())
    print(f"argmax agreement {agreement:.4f}, perplexity {ppl:.3f} vs transformers {ppl_ref:.3f}")
    assert agreement >= 0.99
    assert abs(ppl / ppl_ref - 1) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("kind,n_prompt", [("prose", 8000), ("code", 4000)])
def test_real_gemma3_270m_every_stack_equals_ar(kind, n_prompt, all_threads):
    """The real Gemma 3 270M GGUF (./install.sh gemma3, or TRIFORCE_GEMMA3_GGUF=path): every named method and user stacks with
    retrieval and streaming levels (over its 3 global layers; its 15 sliding-window layers keep the
    target's window) give ar's greedy tokens on prose (Shakespeare) and code (Python)."""
    path = real_gemma3_file()
    from test_speculation_greedy import _code_tokens, assert_every_stack_equals_ar

    from triforce.corpus import demo_tokens
    from triforce.loading import load_model

    loaded = load_model(path, progress=False)
    model = loaded.model
    prompt = (demo_tokens(loaded.tokenizer, n_prompt, offset_chars=100_000) if kind == "prose"
              else _code_tokens(loaded.tokenizer, n_prompt))
    assert_every_stack_equals_ar(model, prompt, 32, ("triforce", "retrieval", "streaming", "ngram"), [
        ("streaming:256,full", "5"), ("ngram,retrieval:1024,full", "3,4"),
        ("ngram,streaming,retrieval:512,retrieval:1024,full", "2,2,3,4")])


def test_gemma3_chat_template_fallback():
    """A Gemma 3 file without a chat template (a base-model conversion) gets Gemma's turn format, the
    system message inside the first user turn, ending with the model's turn opened."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from triforce.loading import GEMMA3_CHAT_TEMPLATE

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(GEMMA3_CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": " Colour?"}]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nColour?<end_of_turn>\n<start_of_turn>model\n")
    assert template.render(messages=messages[1:2], add_generation_prompt=False) == "<start_of_turn>user\nHi<end_of_turn>\n"
