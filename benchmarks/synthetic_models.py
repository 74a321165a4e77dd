"""A model of real shapes with random quantized weights, for timing decode steps of models we cannot
ship (speed does not depend on the weights' values: the bytes read and the arithmetic are those of
the real model).

LLAMA_1B is Llama 3.2 1B's shape; `q4_k_m_model` fills it in the Q4_K_M layout llama.cpp writes
(Q4_K projections, Q6_K for the tied embedding / LM head and for half of the layers' V and down
projections), optionally with fewer layers.
"""
from __future__ import annotations

import numpy as np
import torch

from triforce.config import ModelConfig
from triforce.ggml_blocks import random_blocks

LLAMA_1B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
Q4_K, Q6_K = 12, 14


def q4_k_m_model(n_layers: int | None = None, shape: dict = LLAMA_1B, kv_dtype: str = "fp16", seed: int = 0):
    """Our Transformer of `shape` (n_layers of them if given) with random Q4_K_M-layout weights."""
    from triforce.loading import build_model

    hf = dict(shape, num_hidden_layers=n_layers or shape["num_hidden_layers"])
    cfg = ModelConfig.from_hf(hf)
    rng = np.random.default_rng(seed)
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    sd: dict = {"model.embed_tokens.weight": random_blocks(Q6_K, cfg.vocab_size, h, rng),
                "model.norm.weight": torch.ones(h)}
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        heavy = Q6_K if i % 2 == 0 else Q4_K  # llama.cpp's use_more_bits: about half of the layers
        sd.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            a + "q_proj.weight": random_blocks(Q4_K, cfg.n_heads * d, h, rng),
            a + "k_proj.weight": random_blocks(Q4_K, cfg.n_kv_heads * d, h, rng),
            a + "v_proj.weight": random_blocks(heavy, cfg.n_kv_heads * d, h, rng),
            a + "o_proj.weight": random_blocks(Q4_K, h, cfg.n_heads * d, rng),
            p + "mlp.gate_proj.weight": random_blocks(Q4_K, f, h, rng),
            p + "mlp.up_proj.weight": random_blocks(Q4_K, f, h, rng),
            p + "mlp.down_proj.weight": random_blocks(heavy, h, f, rng),
        })
    return build_model(cfg, sd, kv_dtype=kv_dtype)
