"""The Llama-family forward (Llama 2/3.x, SmolLM/SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 3) in one file.

Native grouped-query attention: the g = Hq / Hkv query heads sharing a KV head are folded into the
query-length axis ([B, Hkv, g*T, D]), so K/V are never repeated per query head. The KV cache is an
argument of every forward (see caches/base.py); positions are the cache's logical length onwards.

Gemma 3 differs by configuration flags (config.ModelConfig): (1 + w) RMSNorms (the 1 is added to the
weights at load time), norms on the attention and MLP outputs too, embeddings scaled by sqrt(hidden),
GeGLU, QK-norm, query_pre_attn_scalar, final logit softcapping, and sliding-window layers with their own
RoPE, whose window the KV cache implements (caches/sliding.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .caches.base import KVCache, TokenBlock, kv_dtype
from .config import ModelConfig
from .errors import TriforceError
from .execution import Execution, Linear, QuantLinear, attention
from .rope import Rotary, apply_rotary

if TYPE_CHECKING:  # (a CUDA graph's view of a cache: execution/graphs.py makes it)
    from .caches.static import StaticView


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32. Gemma's (1 + w) norms hold 1 + w as
    `weight` (load_hf_state_dict adds the 1 in fp32), which is what transformers multiplies by."""

    backend: kernels.Backend = kernels.TORCH  # the model's, set by execution.Execution.for_model

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := self.backend.ops) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)



class Block(nn.Module):
    backend: kernels.Backend = kernels.TORCH  # the model's, set by execution.Execution.for_model

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.sliding = index in cfg.sliding_layers  # attends within cfg.sliding_window, with cfg.rope_local
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale, self.activation = cfg.attention_scale, cfg.activation
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wqkv = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)  # fused: one weight read
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # QK-norm (Qwen3, Gemma 3): RMSNorm over head_dim of every q and k head, before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Gemma's sandwich norms: on the attention and MLP outputs, before each residual add
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.w_gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x [B, T, hidden]; cos/sin [T, D] of this layer's RoPE -> [B, T, hidden]."""
        B, T, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(self.attn_norm(x))
        if self.q_norm is not None:
            qkv = self.qk_norm(qkv)
        if (ops := self.backend.ops) is not None:  # the same operations, fused (kernels/layer_ops.cpp)
            q, k, v = ops.rope_split(qkv, cos, sin, Hq, Hkv)
        else:
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = apply_rotary(q.view(B, T, Hq, D), cos, sin).transpose(1, 2)
            k = apply_rotary(k.view(B, T, Hkv, D), cos, sin).transpose(1, 2)
            v = v.view(B, T, Hkv, D).transpose(1, 2)
        a = self.wo(attention(q, cache.update(self.index, q, k, v), self.scale, ops).transpose(1, 2)
                    .reshape(B, T, Hq * D))
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = x + a
        m = self.w_down(self.gated(self.w_gate_up(self.mlp_norm(x)), ops))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return x + m

    def gated(self, gate_up: torch.Tensor, ops) -> torch.Tensor:
        """[..., 2F] (gate, up) -> act(gate) * up [..., F]: SwiGLU, or Gemma's GeGLU."""
        if self.activation == "silu" and ops is not None:
            return ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh" if self.activation == "gelu_tanh" else "none") * up

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [B, T, (Hq + 2 Hkv) D] -> the same with each q and k head RMS-normalised over D.
        Done on the fused projection so that RoPE, fused or not, follows unchanged."""
        B, T, _ = qkv.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = self.q_norm(q.reshape(B, T, Hq, D)).reshape(B, T, Hq * D)
        k = self.k_norm(k.reshape(B, T, Hkv, D)).reshape(B, T, Hkv * D)
        return torch.cat([q, k, v], dim=-1)


class Transformer(nn.Module):
    # How its forwards run (execution/): PyTorch's operations until select_backend chooses for the device
    execution = Execution()
    # Keep the target's full KV cache in pinned host memory, streamed to the GPU per layer (--offload-kv;
    # caches/offload.py); drafting caches stay on the GPU.
    offload_kv = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.windows = cfg.layer_windows  # what the KV cache must implement (KVCache.windows)
        self.init_rotary()

    def init_rotary(self) -> None:
        """RoPE frequencies (fp32, CPU): the global layers', and the sliding-window layers' own if any."""
        cfg = self.cfg
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_context)
        self.rotary_local = Rotary(cfg.rope_local, cfg.head_dim, cfg.max_context) if cfg.rope_local else None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (and the weights', unless they are kept quantized: QuantLinear)."""
        return self.norm.weight.dtype

    @property
    def quantized(self) -> bool:
        """Whether the weights are kept in GGML block formats (QuantLinear), not as fp32/bf16 tensors."""
        return isinstance(self.lm_head, QuantLinear)

    _kv_dtype: torch.dtype | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of this model's KV cache (new_cache): set it with a torch dtype or a name of
        config.KV_DTYPES ('fp32', 'bf16', 'fp16', 'int8': torch.int8, the quantized layout of
        caches/quantized.py); default (None): the weights' dtype. Only the stored K/V change: a model with
        another KV dtype is, exactly, another model (ar and every stack use it)."""
        return self._kv_dtype or self.dtype

    @kv_dtype.setter
    def kv_dtype(self, value) -> None:
        self._kv_dtype = None if value is None else kv_dtype(value)

    def _apply(self, fn, recurse=True):  # to(), cuda(), half(), ...: RoPE frequencies follow, the backend is re-chosen
        out = super()._apply(fn, recurse)
        for rotary in (out.rotary, out.rotary_local):
            if rotary is not None:
                rotary.inv_freq = rotary.inv_freq.to(out.device)
        if out.device.type != "meta":
            out.select_backend()
        return out

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: int | None = None,
                block: TokenBlock | None = None, hidden: bool = False, layers: tuple[int, ...] | None = None):
        """tokens [B, T] at positions cache.length .. cache.length + T - 1, a causal chain (or, with a
        TokenBlock, at positions cache.length + block.offsets, each seeing the tokens block.visible
        says: a draft tree) -> fp32 logits [B, T, V] (only the last `last` positions if given). The
        tokens are committed to the cache (a tree: until cache.keep() keeps its accepted path).
        `hidden`: -> (logits, features [B, T, hidden]), the final norm's output at every position (what
        the LM head reads; a trained draft head drafts from it, drafthead/). `layers` (with `hidden`): the
        features are instead the residual stream entering each of these layers (ascending; layer i's input is
        layer i - 1's output), concatenated [B, T, len(layers) * hidden]: what an EAGLE-3 head reads
        (drafthead/eagle.py). The layers then run one by one (the fused decode call gives no intermediates)."""
        if cache.windows != self.windows:
            raise TriforceError(f"{type(cache).__name__} does not implement the sliding-window layers of this "
                                f"{self.cfg.arch} model: use a SlidingWindowCache (any cache can hold its "
                                f"global layers)"
                                if self.windows is not None else
                                f"{type(cache).__name__} was made for a model with sliding-window layers")
        B, T = tokens.shape
        cache.prepare(T, block)
        positions = cache.length + (torch.arange(T, device=tokens.device) if block is None else block.offsets)
        rope = self.rotary.cos_sin(positions, self.dtype)
        rope_local = rope if self.rotary_local is None else self.rotary_local.cos_sin(positions, self.dtype)
        x = self._embed(tokens)
        taps = []
        if layers is None and (fused := self.execution.decode_layers(self, x, rope, cache)) is not None:
            x = fused
        else:
            for i, layer in enumerate(self.layers):
                if layers is not None and i in layers:
                    taps.append(x)
                x = layer(x, *(rope_local if layer.sliding else rope), cache)
        cache.commit(T)
        if hidden:
            features = self.norm(x)
            logits = self._head_logits(features if last is None else features[:, -last:])
            return logits, (features if layers is None else torch.cat(taps, dim=-1))
        if last is not None:
            x = x[:, -last:]
        return self._logits(x)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.cfg.scale_embeddings:  # as transformers: sqrt(hidden) as an fp32 tensor, cast to the dtype
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5).to(x.dtype)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm, the LM head and Gemma's softcap -> fp32 logits."""
        return self._head_logits(self.norm(x))

    def _head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The LM head and Gemma's softcap over the final norm's output -> fp32 logits."""
        logits = self.lm_head(features)
        if (cap := self.cfg.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def forward_static(self, tokens: torch.Tensor, positions: torch.Tensor, view: StaticView) -> torch.Tensor:
        """The forward with fixed shapes and no host synchronisation, for capture in a CUDA graph:
        tokens [B, T] at RoPE positions [T] (device tensors), stored at `view`'s slots of its cache,
        each token seeing the slots up to its own (view.prepare) -> fp32 logits [B, T, V]. The cache's
        Python-side length is not touched (the caller commits). Not for dynamic RoPE (its frequencies
        follow the length) or sliding-window models."""
        view.prepare()
        rope = self.rotary.cos_sin(positions, self.dtype)
        x = self._embed(tokens)
        for layer in self.layers:
            x = layer(x, *rope, view)
        return self._logits(x)

    def select_backend(self) -> None:
        """Choose, once, how this model runs on its device and dtype (execution.Execution); called when the
        model is built and when it moves."""
        self.execution = Execution.for_model(self)

    @property
    def backend(self) -> kernels.Backend:
        """The operations every layer runs (the execution's)."""
        return self.execution.backend

    @property
    def graphs(self):
        """On CUDA, the CUDA graphs of the decode-sized forwards (execution/graphs.py); None elsewhere or when off."""
        return self.execution.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.execution = self.execution.with_graphs(graphs)
