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
    gemma: bool = False  # Gemma 3's forward: see _gemma3_fields


# Element types of the KV cache (--kv-dtype for the target's, --draft-kv-dtype for the drafting caches):
# only the stored K/V change type (cast when written); activations and weights keep theirs. A target
# with another KV dtype is another model: `ar` and every stack use the same one, so output stays exact.
# int8 is the hierarchical quantized layout (caches/quantized.py: 8-bit KIVI-grouped codes as two 4-bit
# planes, the newest tokens at fp16): the target's cache only; the drafting levels' caches are float
# (FLOAT_KV_DTYPES), and a kv4 level reads an int8 target's upper planes.
KV_DTYPES = ("fp32", "bf16", "fp16", "int8")
FLOAT_KV_DTYPES = ("fp32", "bf16", "fp16")
# The defaults, for fp32 weights: the target's cache, and the caches of the drafting levels (retrieval,
# streaming, a small draft model), whose precision only moves acceptance. fp16: half the bytes of fp32, and
# the embedded model's perplexity at 32K tokens within 0.01% of fp32's (bf16: 0.04%): docs/kv_dtype.md. On a
# CPU with AMX tiles the target's default is bf16 instead (loading.default_kv_dtype: verifications on the tiles).
DEFAULT_KV_DTYPE = "fp16"
DEFAULT_DRAFT_KV_DTYPE = "fp16"

# How a model's weights are held (--weights): native keeps a GGUF file's blocks as stored (ggml_blocks.py).
WEIGHTS = ("native", "bf16", "fp32")
WEIGHTS_HELP = ("how the weights are held: native (default) keeps a GGUF file's quantized blocks as stored "
                "(memory = the file's tensor bytes; kernels dequantize them in registers); bf16 holds every "
                "projection in bf16 (2 bytes per weight); fp32 dequantizes the file once to a cached fp32 copy "
                "(4 bytes). A Hugging Face directory's native weights are its fp32 ones. Activations are fp32 in all. "
                "On CUDA (--device cuda) native and bf16 hold the weights in --dtype instead: the quantized "
                "kernels are the CPU's.")

_KV_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


def kv_dtype_name(value, what: str = "KV cache dtype", choices: tuple[str, ...] = KV_DTYPES) -> str:
    """One of `choices` ('fp32', 'bf16', 'fp16', 'int8') for one of those names, a torch dtype name (float32,
    bfloat16, float16, int8) or a torch dtype; TriforceError naming the valid values for anything else."""
    name = str(value).removeprefix("torch.")
    name = _KV_ALIASES.get(name, name)
    if name not in choices:
        raise TriforceError(f"{what} {value!r} is not supported: choose one of {', '.join(choices)}")
    return name


# HF model_type -> its forward. SmolLM/SmolLM2 and Llama 2/3.x are "llama"; Gemma 3's text model
# (Gemma3ForCausalLM) is "gemma3_text".
SUPPORTED_ARCHITECTURES = {
    "llama": Architecture(),
    "mistral": Architecture(),
    "qwen2": Architecture(qkv_bias=True),
    "qwen3": Architecture(qk_norm=True),
    "gemma3_text": Architecture(qk_norm=True, gemma=True),
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
    # Gemma 3 (the defaults are the Llama family's forward)
    norm_weight_offset: float = 0.0  # every RMSNorm multiplies by (offset + weight): Gemma stores w, applies 1 + w
    sandwich_norms: bool = False  # RMSNorm also on the attention and MLP outputs, before each residual add
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the embedding's dtype
    activation: str = "silu"  # of the MLP gate: silu, gelu_tanh (Gemma's gelu_pytorch_tanh) or gelu
    query_pre_attn_scalar: float | None = None  # attention scores are scaled by its ** -0.5 (None: head_dim's)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # Sliding-window layers: the query at position i sees keys at positions (i - sliding_window, i]
    # (transformers' sliding_window_overlay), with their own RoPE (None: `rope`).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local: RopeConfig | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_windows(self) -> tuple[int | None, ...] | None:
        """Per layer, the sliding window it attends within (None: the whole sequence); None if no layer
        slides. A KV cache must implement exactly this (KVCache.windows)."""
        if not self.sliding_layers:
            return None
        return tuple(self.sliding_window if i in self.sliding_layers else None for i in range(self.n_layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V stored per token of context over all layers, in fp32. Sliding-window layers
        keep a fixed window, not a growing context: they are not counted."""
        growing = self.n_layers - len(self.sliding_layers)
        return growing * 2 * self.n_kv_heads * self.head_dim * 4

    def with_overrides(self, rope_theta: float | None = None, max_context: int | None = None) -> ModelConfig:
        """`rope_theta` replaces the base of `rope` (Gemma 3: the global layers'; the sliding-window
        layers keep theirs, as llama.cpp's --rope-freq-base does)."""
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
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (Llama 2/3.x, SmolLM/SmolLM2, Mistral, Qwen2/2.5, "
                f"Qwen3, Gemma 3 text models)"
            )
        spec = SUPPORTED_ARCHITECTURES[arch]
        n_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // n_heads
        rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        default_theta = hf.get("rope_theta", 10000.0)
        gemma = {}
        if spec.gemma:
            gemma = _gemma3_fields(hf, rp, head_dim)
            default_theta = hf.get("rope_theta", GEMMA3_GLOBAL_ROPE_THETA)
            if "full_attention" in rp or "sliding_attention" in rp:  # 5.x: per layer type; `rope` is the global layers'
                rp = dict(rp.get("full_attention") or {})
        rope = _rope_config(rp, default_theta, head_dim)
        max_context = int(hf.get("max_position_embeddings", 4096))
        # Sliding-window attention of Mistral v0.1 (every layer) and of Qwen2 configs with use_sliding_window (the
        # layers from max_window_layers on, or as layer_types says): run as Gemma 3's sliding layers are, each
        # within its window through the ring cache (caches/sliding.py), with the model's one RoPE; the context stays
        # max_position_embeddings.
        window = hf.get("sliding_window")
        if window and not spec.gemma and (arch == "mistral" or hf.get("use_sliding_window")) and window < max_context:
            gemma = _sliding_window_fields(hf, int(window))
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
            **gemma,
        )


_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def _sliding_window_fields(hf: dict[str, Any], window: int) -> dict[str, Any]:
    """The sliding-window layers of a Mistral or Qwen2 config (not Gemma 3's, which _gemma3_fields reads): as
    `layer_types` lists them, else every layer (Mistral) or those from `max_window_layers` on (Qwen2, as
    transformers' Qwen2Config builds its layer_types)."""
    n_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise TriforceError(f"unsupported layer_types {types}: one of sliding_attention or full_attention per layer")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif hf.get("model_type") == "qwen2" and hf.get("max_window_layers") is not None:
        sliding = tuple(range(int(hf["max_window_layers"]), n_layers))
    else:
        sliding = tuple(range(n_layers))
    if window < 1:
        raise TriforceError(f"sliding_window must be >= 1, got {window}")
    return dict(sliding_window=window, sliding_layers=sliding) if sliding else {}


def _rope_config(rp: dict, default_theta: float, head_dim: int) -> RopeConfig:
    """One `rope_parameters` dict (transformers 5.x; or 4.x's `rope_scaling`, `rope_theta` beside it) -> RopeConfig."""
    theta = rp.get("rope_theta", default_theta)
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rtype not in _ROPE_TYPES:
        raise TriforceError(f"unsupported RoPE type {rtype!r}: use default, linear, dynamic, yarn or llama3")
    return RopeConfig(
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


# transformers' Gemma3TextConfig defaults (default_theta, the BC sliding_window_pattern)
GEMMA3_GLOBAL_ROPE_THETA = 1_000_000.0
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _gemma3_fields(hf: dict[str, Any], rp: dict, head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 3 text config (transformers' Gemma3TextConfig and
    Gemma3ForCausalLM): (1 + w) RMSNorms, sandwich norms, embeddings scaled by sqrt(hidden), GeGLU,
    QK-norm, query_pre_attn_scalar, final logit softcapping, and sliding-window layers with their own
    RoPE (`rope_parameters["sliding_attention"]`, or 4.x's `rope_local_base_freq`).
    What it would not reproduce is refused."""
    if hf.get("attn_logit_softcapping") is not None:
        raise TriforceError(f"attention logit softcapping ({hf['attn_logit_softcapping']}) is not supported "
                            f"(Gemma 3 does not use it)")
    if hf.get("use_bidirectional_attention"):
        raise TriforceError("bidirectional attention (use_bidirectional_attention) is not supported: "
                            "triforce runs causal language models")
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"  # Gemma3MLP reads this key only
    if act not in _GEMMA_ACTIVATIONS:
        raise TriforceError(f"unsupported activation {act!r}: Gemma 3 support covers "
                            f"{', '.join(_GEMMA_ACTIVATIONS)}")
    n_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # transformers' BC: the pattern used to be an int
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise TriforceError(f"unsupported layer_types {types}: one of sliding_attention or full_attention per layer")
    window = hf.get("sliding_window")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    if "full_attention" in rp or "sliding_attention" in rp:
        local = dict(rp.get("sliding_attention") or {})
    else:
        local = {"rope_type": "default"}
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA))
    softcap = hf.get("final_logit_softcapping")
    return dict(
        norm_weight_offset=1.0,
        sandwich_norms=True,
        scale_embeddings=True,
        activation=_GEMMA_ACTIVATIONS[act],
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_softcap=float(softcap) if softcap else None,
        sliding_window=int(window) if sliding else None,
        sliding_layers=sliding,
        rope_local=_rope_config(local, GEMMA3_LOCAL_ROPE_THETA, head_dim) if sliding else None,
    )


def _freq_factors(values, head_dim: int) -> tuple[float, ...] | None:
    """`rope_parameters.freq_factors` of a config.json (written by our GGUF conversion) -> RopeConfig's."""
    if values is None:
        return None
    if len(values) != head_dim // 2 or not all(float(v) > 0 for v in values):
        raise TriforceError(f"rope freq_factors must be {head_dim // 2} positive numbers (head_dim / 2), "
                            f"got {len(values)}")
    return tuple(float(v) for v in values)
