"""Read a GGUF file (llama.cpp's format) into a Hugging Face-style config and fp32 state dict.

Quantised tensors are dequantised with the `gguf` package. llama.cpp's converter permutes the rows
of Q and K for the "llama" architecture (interleaved RoPE pairs); we undo that so the weights follow
the Hugging Face half-split RoPE layout that our forward uses.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import TriforceError

_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2"}  # GGUF architecture -> HF model_type

_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of Q/K rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf(path: Path, progress: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (HF config dict, HF-named fp32 state dict)."""
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise TriforceError(f"cannot read GGUF file {path}: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise TriforceError(f"unsupported GGUF architecture {arch!r} in {path}: supported are {', '.join(_GGUF_ARCHS)}")
    a = arch
    n_head = int(_field(reader, f"{a}.attention.head_count"))
    n_kv = int(_field(reader, f"{a}.attention.head_count_kv", n_head))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    names = {t.name for t in reader.tensors}
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hf = {
        "model_type": _GGUF_ARCHS[arch],
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": int(_field(reader, f"{a}.vocab_size", int(emb.shape[-1]))),
        "hidden_size": hidden,
        "num_hidden_layers": int(_field(reader, f"{a}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(_field(reader, f"{a}.rope.dimension_count", hidden // n_head)),
        "intermediate_size": int(_field(reader, f"{a}.feed_forward_length")),
        "rms_norm_eps": float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(_field(reader, f"{a}.context_length", 4096)),
        "rope_theta": float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        hf["attention_bias"] = False
        hf["mlp_bias"] = False
    from tqdm.auto import tqdm

    sd: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantising GGUF", unit="tensor", disable=not progress):
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _NAMES:
                continue  # e.g. precomputed rope_freqs: not needed
            key = f"model.layers.{layer}.{_NAMES[rest]}"
            if arch == "llama" and rest in ("attn_q.weight", "attn_q.bias"):
                w = _unpermute(w, n_head)
            elif arch == "llama" and rest in ("attn_k.weight", "attn_k.bias"):
                w = _unpermute(w, n_kv)
        else:
            continue
        sd[key] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    return hf, sd
