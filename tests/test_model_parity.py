"""Our forward equals transformers' implementation: logits and greedy tokens."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce.generate import generate_ar
from triforce.speculation.state import prefill
from triforce.sampling import SamplingParams
from triforce.caches import new_cache


@torch.no_grad()
def test_logits_match_transformers(tiny_pair):
    hf, ours = tiny_pair
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits
    got = ours(ids, new_cache(ours, 64))
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_greedy_64_tokens_match_transformers(tiny_pair):
    hf, ours = tiny_pair
    prompt = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, min_new_tokens=64,
                      do_sample=False, pad_token_id=0, eos_token_id=None)[0, 20:].tolist()
    got = generate_ar(ours, prompt[0].tolist(), 64, SamplingParams()).tokens
    assert got == ref


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
@torch.no_grad()
def test_rope_variants_match_transformers(rope):
    hf = hf_tiny("llama", rope_parameters=dict(rope, rope_theta=10000.0), max_position_embeddings=256)
    ours = ours_from_hf(hf)
    # 200 tokens: past the original context of dynamic/yarn/llama3, so their scaling matters
    ids = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(2))
    ref = hf(ids).logits
    got = ours(ids, new_cache(ours, 256))
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_embedded_model_matches_transformers_at_2k(smollm, all_threads):
    """The embedded SmolLM2 (RoPE base 4e5): logits after a 2K-token prompt and 64 greedy tokens."""
    import transformers

    from triforce.corpus import demo_tokens

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm.hf_dir), dtype=torch.float32,
                                                           rope_parameters={"rope_type": "default", "rope_theta": 4e5})
    hf.eval()
    assert hf.config.rope_parameters["rope_theta"] == 4e5
    prompt = demo_tokens(smollm.tokenizer, 2048)
    ids = torch.tensor([prompt])
    ref_out = hf(ids, use_cache=True)
    cache = new_cache(smollm.model, 2048 + 64)
    got = prefill(smollm.model, cache, ids, chunk_size=512)
    # the prompt's rows take the decode step's arithmetic (the integer kernel where it runs: activations rounded to 16
    # bits a block), which differs from transformers' fp32 by up to 4.4e-3 at this position (logits up to 24) in one
    # decode step after 2,047 tokens, and 2.5-6.2e-3 here depending on the chunk
    torch.testing.assert_close(got, ref_out.logits[:, -1], atol=1e-2, rtol=1e-3)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                      do_sample=False, eos_token_id=None, pad_token_id=2)[0, 2048:].tolist()
    ours = generate_ar(smollm.model, prompt, 64, SamplingParams()).tokens
    assert ours == ref


def test_sliding_window_configs_run_as_sliding_window_models():
    """Mistral v0.1 (sliding_window 4096 in config.json: every layer) and Qwen2 with use_sliding_window (the layers
    from max_window_layers on) run with their windows, through the ring cache Gemma 3's sliding layers use; the
    context is not cut to the window."""
    from triforce.config import ModelConfig

    base = dict(hf_tiny("mistral").config.to_dict())
    cfg = ModelConfig.from_hf({**base, "sliding_window": 128})
    assert cfg.max_context == base["max_position_embeddings"] and cfg.layer_windows == (128, 128)
    assert cfg.rope_local is None  # the sliding layers use the model's one RoPE
    cfg = ModelConfig.from_hf({**base, "sliding_window": None})
    assert cfg.max_context == base["max_position_embeddings"] and cfg.layer_windows is None
    qwen = {**base, "model_type": "qwen2", "sliding_window": 128, "num_hidden_layers": 4, "layer_types": None}
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": False}).layer_windows is None
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 2}).layer_windows == \
        (None, None, 128, 128)
    assert ModelConfig.from_hf({**base, "sliding_window": 1024}).layer_windows is None  # a window past the context


@torch.no_grad()
def test_mistral_with_a_sliding_window_matches_transformers_past_the_window(tmp_path):
    """A tiny random Mistral with a 16-token window, saved as a Hugging Face directory and loaded back: logits
    equal transformers' at 120 positions (past the window, where full attention would differ), greedy decoding
    and chain stacks give transformers' tokens; draft trees are refused with a clear error."""
    from triforce.errors import TriforceError
    from triforce.generate import generate
    from triforce.loading import build_model
    from triforce.loading.hf import load_hf_checkpoint
    from triforce.speculation.settings import SpecConfig
    from triforce.speculation.stack import StackSpec

    hf = hf_tiny("mistral", sliding_window=16)
    hf.save_pretrained(str(tmp_path))
    cfg, sd, _ = load_hf_checkpoint(tmp_path)
    assert cfg.layer_windows == (16, 16) and cfg.max_context == 512
    ours = build_model(cfg, sd)
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids, new_cache(ours, 120)), hf(ids).logits, atol=1e-4, rtol=1e-4)
    prompt = ids[0, :90].tolist()
    want = hf.generate(ids[:, :90], attention_mask=torch.ones(1, 90, dtype=torch.long), max_new_tokens=30,
                       min_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 90:].tolist()
    assert generate_ar(ours, prompt, 30, SamplingParams()).tokens == want
    small = SpecConfig(budget=48, recent=8, sink=4, window=24, rebuild_every=16, prefill_chunk=32)
    for levels in ("ngram,retrieval:48,full", "streaming:28,full", "h2o:48,full", "kv4,full"):
        got = generate(ours, prompt, 30, SamplingParams(), stack=StackSpec.parse(levels, 3), config=small).tokens
        assert got == want, levels
    with pytest.raises(TriforceError, match="sliding-window"):
        generate(ours, prompt, 8, SamplingParams(), stack=StackSpec.parse("streaming:28,full", 3, tree="2,1"),
                 config=small)
