"""Model configuration: the few numbers our forward needs, read from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .errors import TriforceError

# model_type -> whether q/k/v projections carry a bias. SmolLM/SmolLM2 and Llama 2/3.x are "llama".
SUPPORTED_ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE variant. `type` is one of default, linear, dynamic, yarn, llama3."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_context: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V stored per token over all layers, in fp32."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * 4

    def with_overrides(self, rope_theta: float | None = None, max_context: int | None = None) -> ModelConfig:
        cfg = self
        if rope_theta is not None:
            if rope_theta <= 0:
                raise TriforceError(f"--rope-theta must be positive, got {rope_theta}")
            cfg = replace(cfg, rope=replace(cfg.rope, theta=float(rope_theta)))
        if max_context is not None:
            if max_context <= 0:
                raise TriforceError(f"--max-context must be positive, got {max_context}")
            cfg = replace(cfg, max_context=int(max_context))
        return cfg

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        arch = hf.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise TriforceError(
                f"unsupported architecture {arch!r}: triforce supports "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (Llama 2/3.x, SmolLM/SmolLM2, Mistral, Qwen2/2.5)"
            )
        n_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
        rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
        if rtype not in ("default", "linear", "dynamic", "yarn", "llama3"):
            raise TriforceError(f"unsupported RoPE type {rtype!r}: use default, linear, dynamic, yarn or llama3")
        rope = RopeConfig(
            theta=float(theta),
            type=rtype,
            factor=float(rp.get("factor", 1.0) or 1.0),
            original_max_position=rp.get("original_max_position_embeddings"),
            low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
            beta_fast=float(rp.get("beta_fast") or 32.0),
            beta_slow=float(rp.get("beta_slow") or 1.0),
            attention_factor=rp.get("attention_factor"),
            mscale=rp.get("mscale"),
            mscale_all_dim=rp.get("mscale_all_dim"),
            truncate=bool(rp.get("truncate", True)),
        )
        max_context = int(hf.get("max_position_embeddings", 4096))
        # Sliding-window attention (Mistral v0.1, some Qwen2 configs) is not implemented: within the
        # window it equals full attention, so the usable context is capped at the window.
        window = hf.get("sliding_window")
        if window and (arch == "mistral" or hf.get("use_sliding_window")) and window < max_context:
            max_context = int(window)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hidden // n_heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_context=max_context,
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=SUPPORTED_ARCHITECTURES[arch] or bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
