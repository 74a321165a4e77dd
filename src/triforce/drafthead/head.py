"""A trained draft head (EAGLE's design): one transformer layer over the target's own features.

At position i the head reads the pair (f[i-1], x[i]): the target's feature after token i - 1 (the final
norm's output, what its LM head reads) and the embedding of token i, mixes them with a linear layer, runs
one decoder layer (its own small KV cache over a window of positions), and predicts f[i]. The target's LM
head turns the prediction into next-token logits, whose distribution is the q the verifier checks the drafted token against. To draft further it feeds its own
prediction as the next step's feature.

    f[n-2], x[n-1] -> f^[n-1] -> x[n] ~ q      (f[n-2]: the verifier computed it; x[n-1]: its last token)
    f^[n-1], x[n]  -> f^[n]   -> x[n+1] ~ q    (its own prediction, after the first drafted token)

The head owns its layer and mixing weights only; the embedding and the LM head are the target's, read at
load time (so a head is a few MB). On disk: a directory with config.json and head.safetensors.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..caches.base import SlotKV
from ..config import ModelConfig
from ..execution import Linear, QuantLinear
from ..ggml_blocks import dequantize
from ..model import Block, Transformer
from ..rope import Rotary

CONFIG_FILE, WEIGHTS_FILE = "config.json", "head.safetensors"
FORMAT = "triforce-draft-head/1"


def target_fingerprint(model: Transformer) -> str:
    """What a head must match in its target: the architecture and the shapes of what it reads (the features,
    the layers' RoPE, the LM head). The weights' format may differ (a head trained over the Q4_1 file also
    drafts for its bf16 or fp32 copy)."""
    c = model.cfg
    return f"{c.arch}-hidden{c.hidden_size}-layers{c.n_layers}-heads{c.n_heads}x{c.head_dim}-vocab{c.vocab_size}"


def dense_weight(lin) -> torch.Tensor:
    """A linear layer's weight as a dense fp32 matrix [out, in], whether held as a tensor or in GGML blocks."""
    if isinstance(lin, QuantLinear):
        return torch.cat([dequantize(p, lin.backend.ops) for p in lin.parts]).float()
    return lin.weight.detach().float()


def embed_tokens(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The target's input embeddings of tokens [...] -> fp32 [..., hidden] (no gradient)."""
    with torch.no_grad():
        return model._embed(tokens).float()


@dataclass
class HeadConfig:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    target: str  # target_fingerprint of the model it was trained for
    window: int = 1024  # positions the head's own KV cache keeps (its attention window)
    format: str = FORMAT
    trained: dict = field(default_factory=dict)  # how it was made: command, seed, data, losses, acceptance
    # a published EAGLE-1 head's layer (drafthead/eagle.py): no RMSNorm on its input (the fc output), and
    # q/k/v biases (EAGLE's Qwen2 heads); triforce's own heads keep the defaults
    input_norm: bool = True
    qkv_bias: bool = False

    @classmethod
    def for_target(cls, model: Transformer, **kw) -> HeadConfig:
        c = model.cfg
        return cls(c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps,
                   c.vocab_size, target_fingerprint(model), **kw)

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The ModelConfig of the head's one Llama-style layer (RoPE as the target's)."""
        return replace(target, n_layers=1, hidden_size=self.hidden_size, n_heads=self.n_heads,
                       n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                       qkv_bias=self.qkv_bias, qk_norm=False, sandwich_norms=False, activation="silu",
                       query_pre_attn_scalar=None, sliding_window=None, sliding_layers=(), rope_local=None)


class _Causal:
    """The cache interface for a forward over whole sequences with no cache (training): each position sees
    itself and the positions before it."""

    def update(self, layer, q, k, v):
        return SlotKV(k, v)  # every position a new token: a causal chain


class DraftHead(nn.Module):
    """The head's weights: `fc` mixes [embedding, feature] (2 * hidden -> hidden), `layer` is one decoder layer."""

    feature_layers = None  # it reads the target's final-norm output (an EAGLE-3 head: the inputs of three layers)

    def __init__(self, cfg: HeadConfig, target_cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = Block(cfg.layer_config(target_cfg), 0)
        if not cfg.input_norm:
            self.layer.attn_norm = nn.Identity()
        self.rotary = Rotary(target_cfg.rope, cfg.head_dim, target_cfg.max_context)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, cache=None
                ) -> torch.Tensor:
        """features [B, T, hidden] (f[i-1]), embeddings [B, T, hidden] (of x[i]) at positions [T] -> the
        predicted features f^[i] [B, T, hidden]. cache None: a causal forward over the T positions (training);
        else a KV cache of one layer, whose prepare()/commit() the caller runs."""
        x = self.fc(torch.cat([embeddings, features], dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return self.layer(x, cos, sin, _Causal() if cache is None else cache)

    def logits(self, prediction: torch.Tensor, lm_model: Transformer) -> torch.Tensor:
        """The next-token logits [V] of a prediction [hidden]: the target's LM head (and softcap) over it."""
        return lm_model._head_logits(prediction[None].to(lm_model.dtype))[0]  # the head is fp32, a GPU target bf16

    def init_from(self, model: Transformer, layer: int | None = None) -> None:
        """Start the layer from one of the target's (default its last), its output projections zeroed, and fc as
        [0 | I]: the head starts as the identity (predicting the feature it reads) and learns from there."""
        src = model.layers[model.cfg.n_layers - 1 if layer is None else layer]
        with torch.no_grad():
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                getattr(self.layer, name).weight.copy_(dense_weight(getattr(src, name)))
            for name in ("attn_norm", "mlp_norm"):
                getattr(self.layer, name).weight.copy_(getattr(src, name).weight.float())
            self.layer.wo.weight.zero_()
            self.layer.w_down.weight.zero_()
            h = self.cfg.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, h:] = torch.eye(h)
            self.fc.bias.zero_()

    def save(self, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write config.json and head.safetensors atomically (each to a temporary name, then renamed; the
        weights first, so a directory with a config always has its weights). `dtype`: the weights' on disk
        (bf16 halves a shipped head; loading casts back to fp32); default as held."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (WEIGHTS_FILE + ".tmp")
        weights = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(weights, str(tmp), metadata={"format": FORMAT})
        os.replace(tmp, d / WEIGHTS_FILE)
        tmp = d / (CONFIG_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self.cfg), indent=1) + "\n")
        os.replace(tmp, d / CONFIG_FILE)
