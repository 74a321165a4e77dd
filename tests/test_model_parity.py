"""Our forward equals transformers' implementation: logits and greedy tokens."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce.generate import generate_ar
from triforce.speculation.state import prefill
from triforce.sampling import SamplingParams


@torch.no_grad()
def test_logits_match_transformers(tiny_pair):
    hf, ours = tiny_pair
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits
    got = ours(ids, ours.new_cache(64))
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
    got = ours(ids, ours.new_cache(256))
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
    cache = smollm.model.new_cache(2048 + 64)
    got = prefill(smollm.model, cache, ids, chunk_size=512)
    torch.testing.assert_close(got, ref_out.logits[:, -1], atol=2e-3, rtol=1e-3)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                      do_sample=False, eos_token_id=None, pad_token_id=2)[0, 2048:].tolist()
    ours = generate_ar(smollm.model, prompt, 64, SamplingParams()).tokens
    assert ours == ref


def test_sliding_window_caps_the_context():
    """Sliding-window attention is not implemented: the context stops at the window, so that a longer
    prompt is refused with a clear error instead of silently diverging from the model."""
    from triforce.config import ModelConfig

    base = dict(hf_tiny("mistral").config.to_dict())
    assert ModelConfig.from_hf({**base, "sliding_window": 128}).max_context == 128
    assert ModelConfig.from_hf({**base, "sliding_window": None}).max_context == base["max_position_embeddings"]
    assert ModelConfig.from_hf({**base, "model_type": "qwen2", "sliding_window": 128,
                                "use_sliding_window": False}).max_context == base["max_position_embeddings"]
