"""Model configuration: the few numbers our forward needs, read from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .errors import TriforceError


@dataclass(frozen=True)
class Architecture:
    """What sets a supported model_type's forward apart from plain Llama."""

    qkv_bias: bool = False  # q/k/v projections always carry a bias (else only with attention_bias)
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before RoPE


# HF model_type -> its forward. SmolLM/SmolLM2 and Llama 2/3.x are "llama".
SUPPORTED_ARCHITECTURES = {
    "llama": Architecture(),
    "mistral": Architecture(),
    "qwen2": Architecture(qkv_bias=True),
    "qwen3": Architecture(qk_norm=True),
}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE variant. `type` is one of default, linear, dynamic, yarn, llama3.

    `freq_factors` (head_dim/2 values, or None) divide the inverse frequencies after the variant's own
    scaling: llama.cpp's `rope_freqs` tensor (theta_i = pos * base^(-2i/d) / freq_factors[i]), which is
    how GGUF files carry Llama 3.x's RoPE scaling.
    """

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
    freq_factors: tuple[float, ...] | None = None


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
    qk_norm: bool = False
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
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (Llama 2/3.x, SmolLM/SmolLM2, Mistral, Qwen2/2.5, Qwen3)"
            )
        spec = SUPPORTED_ARCHITECTURES[arch]
        n_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // n_heads
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
            freq_factors=_freq_factors(rp.get("freq_factors"), head_dim),
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
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_context=max_context,
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=spec.qkv_bias or bool(hf.get("attention_bias", False)),
            qk_norm=spec.qk_norm,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _freq_factors(values, head_dim: int) -> tuple[float, ...] | None:
    """`rope_parameters.freq_factors` of a config.json (written by our GGUF conversion) -> RopeConfig's."""
    if values is None:
        return None
    if len(values) != head_dim // 2 or not all(float(v) > 0 for v in values):
        raise TriforceError(f"rope freq_factors must be {head_dim // 2} positive numbers (head_dim / 2), "
                            f"got {len(values)}")
    return tuple(float(v) for v in values)
