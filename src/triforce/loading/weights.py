"""Weights into a built model and transformed inside it: a Hugging Face state dict onto our fused modules, the CPU
kernels' packed copies, a bf16 draft copy, and bf16 storage of every projection. The model (model.py) only computes;
which modules hold its weights, and in what format, is decided here, from outside it."""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..config import ModelConfig
from ..execution import Linear, QuantEmbedding, QuantLinear
from ..ggml_blocks import BF16, QuantTensor, dequantize, to_bf16
from ..model import Transformer

PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")  # a Block's linear layers

# Our block norms -> their Hugging Face names. Llama's post_attention_layernorm is the norm before the
# MLP, Gemma's the one on the attention output.
_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                   "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def hf_layout(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter -> the Hugging Face tensors it is made of, in order (fused projections: their
    parts concatenated along the outputs; q/k/v and gate/up)."""
    ours = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        ours["lm_head.weight"] = ["lm_head.weight"]
    norms = _SANDWICH_NORMS if cfg.sandwich_norms else _NORMS
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for name, hf_name in norms.items():
            ours[f"layers.{i}.{name}.weight"] = [p + hf_name + ".weight"]
        ours[f"layers.{i}.wqkv.weight"] = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        if cfg.qkv_bias:
            ours[f"layers.{i}.wqkv.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        ours[f"layers.{i}.wo.weight"] = [a + "o_proj.weight"]
        if cfg.qk_norm:
            ours[f"layers.{i}.q_norm.weight"] = [a + "q_norm.weight"]
            ours[f"layers.{i}.k_norm.weight"] = [a + "k_norm.weight"]
        ours[f"layers.{i}.w_gate_up.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        ours[f"layers.{i}.w_down.weight"] = [p + "mlp.down_proj.weight"]
    return ours


def load_hf_state_dict(model: Transformer, sd: dict[str, torch.Tensor | QuantTensor]) -> None:
    """Load a Hugging Face Llama-style (or Gemma 3) state dict, fusing q/k/v and gate/up projections.
    Norm weights get cfg.norm_weight_offset added in fp32 (Gemma's 1 + w).

    Weights given as QuantTensor (GGUF blocks kept as stored) become QuantLinear / QuantEmbedding
    modules holding those bytes; a fused projection with a part in plain fp32 is dequantized whole
    (no file we know of does that)."""
    cfg = model.cfg
    layout = hf_layout(cfg)
    quantized = {name: [sd[n] for n in names] for name, names in layout.items()
                 if all(isinstance(sd[n], QuantTensor) for n in names) and name.endswith("weight")
                 and not name.endswith("norm.weight")}
    ours: dict[str, torch.Tensor] = {}
    for name, names in layout.items():
        if name in quantized:
            continue
        parts = [dequantize(sd[n]) if isinstance(sd[n], QuantTensor) else sd[n] for n in names]
        ours[name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if cfg.norm_weight_offset:
        ours = {k: v.float() + cfg.norm_weight_offset if k.endswith("norm.weight") else v for k, v in ours.items()}
    for name, parts in quantized.items():
        owner_name = name.rsplit(".", 1)[0]
        parent, _, attr = owner_name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if owner_name == "embed":
            module = QuantEmbedding(parts[0])
        else:
            bias = ours.get(f"{owner_name}.bias")  # loaded below too (assign): a parameter of the module
            module = QuantLinear(parts, None if bias is None else bias.to(model.dtype))
        setattr(owner, attr, module)
    if cfg.tie_word_embeddings and "embed.weight" in quantized:
        model.lm_head = QuantLinear(quantized["embed.weight"])
    dtype = model.dtype
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in ours.items()}, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings and not model.quantized:
        model.lm_head.weight = model.embed.weight


def pack_weights(model: Transformer) -> None:
    """Pre-pack the linear layers' weights for decode and verification forwards on CPU (see Linear)."""
    model.execution.fused.clear()  # the fused layers' arguments name the packed weights
    for m in model.modules():
        if isinstance(m, (Linear, QuantLinear)):
            m.pack()


def draft_weights(model: Transformer) -> Transformer:
    """The model with its linear layers' weights in bf16 (panel kernel, fp32 activations), sharing everything else
    (embedding, norms, the fp32 weights): half the weight bytes per forward, for draft levels whose output the fp32
    model verifies. Returns the model itself where the kernels are unavailable, and for weights kept quantized
    (already fewer bytes than bf16)."""
    if not model.backend.enabled or model.quantized:
        return model

    def lowp(lin: Linear) -> Linear:
        new = copy.copy(lin)  # shares the parameters; gets its own panels
        new.pack(torch.bfloat16)
        return new

    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    layers = []
    for block in model.layers:
        b = copy.copy(block)
        b._modules = dict(block._modules)
        for name in PROJECTIONS:
            b._modules[name] = lowp(block._modules[name])
        layers.append(b)
    draft._modules["layers"] = nn.ModuleList(layers)
    draft._modules["lm_head"] = lowp(model.lm_head)
    return draft


def weights_to_bf16(model: Transformer) -> None:
    """Hold every projection and the embedding as bf16 bytes (QuantLinear / QuantEmbedding of GGML type BF16,
    converted a few rows at a time), activations staying fp32: half of fp32's bytes."""
    ops = model.backend.ops

    def bf16(weight) -> QuantTensor:
        if isinstance(weight, QuantTensor):
            return to_bf16(weight, ops)
        w = weight.detach().to(torch.bfloat16).contiguous()
        return QuantTensor(w.view(torch.uint8), BF16, tuple(w.shape))

    def bf16_linear(lin: Linear | QuantLinear) -> QuantLinear:
        parts = lin.parts if isinstance(lin, QuantLinear) else [lin.weight]
        return QuantLinear([bf16(p) for p in parts], None if lin.bias is None else lin.bias.detach())

    for block in model.layers:
        for name in PROJECTIONS:
            setattr(block, name, bf16_linear(getattr(block, name)))
    table = bf16(model.embed.table if isinstance(model.embed, QuantEmbedding) else model.embed.weight)
    model.lm_head = QuantLinear([table]) if model.cfg.tie_word_embeddings else bf16_linear(model.lm_head)
    model.embed = QuantEmbedding(table)
    model.select_backend()
