"""Published EAGLE draft heads (EAGLE-1 and EAGLE-3), loaded from a local directory in their own layouts.

A directory holds config.json and the weights as model.safetensors or pytorch_model.bin (EAGLE's ea_model.py
tries pytorch_model.bin, then model.safetensors). What the layouts are, and where they were read from
(docs/eagle_heads.md lists them in full):

EAGLE-1 (SafeAILab/EAGLE eagle/model/cnets1.py, ea_model.py; e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B):
    fc.weight [H, 2H], fc.bias [H] unless config.json says "bias": false   (over [embedding, feature])
    layers.0.self_attn.{q,k,v,o}_proj.weight (q/k/v biases when "qkv_bias"), layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight: one Llama decoder layer with no input_layernorm (layer index 0)
    embed_tokens.weight [V, H] (optional: the target's own, which EAGLE loads from the target)
    It reads the target's last hidden state after the final norm (what the LM head reads, as triforce's own
    heads do), and its output goes through the target's LM head.
EAGLE-3 (eagle/model/cnets.py, eagle/traineagle3/; vLLM llama_eagle3.py; e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
    fc.weight [H, 3 * target_hidden_size] (no bias) over the inputs of target layers 2, n // 2 and n - 3
    (eagle/model/modeling_llama_kv.py; vLLM's default, or config.json's eagle_aux_hidden_state_layer_ids)
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight; midlayer.self_attn.{q,k,v}_proj
    [., 2H] over [input_layernorm(embedding), hidden_norm(h)], o_proj, midlayer.mlp.* ("layers.0." also read,
    as vLLM renames midlayer. to)
    norm.weight [H], lm_head.weight [draft_vocab_size, H], d2t [draft_vocab_size] (draft id i is target id
    i + d2t[i]; absent when draft_vocab_size == vocab_size), t2d [vocab_size] (not needed), embed_tokens optional.
    Its pre-norm output is the next step's feature; its own norm and LM head give logits over the draft
    vocabulary, which are -inf for the target tokens outside it (q is 0 there: the acceptance rule stays exact).
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..config import _rope_config
from ..errors import TriforceError
from ..execution import Linear
from ..model import Block, RMSNorm, Transformer
from ..rope import Rotary
from .head import DraftHead, HeadConfig, _Causal, target_fingerprint

WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
EAGLE1, EAGLE3 = "EAGLE-1", "EAGLE-3"
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def load_eagle(directory: str | os.PathLike, model: Transformer) -> DraftHead | Eagle3Head:
    """The EAGLE-1 or EAGLE-3 head in `directory` (its published layout) for `model`; TriforceError naming the
    problem when the weights are missing or damaged, the layout is not EAGLE's, or the head was made for a
    model of another hidden size, vocabulary or architecture."""
    d = Path(directory)
    config = _read_config(d)
    sd = _read_weights(d)
    if any(k.startswith("midlayer.") or k == "layers.0.hidden_norm.weight" for k in sd):
        return _eagle3(d, config, {k.replace("midlayer.", "layers.0.", 1): v for k, v in sd.items()}, model)
    if "fc.weight" in sd and "layers.0.self_attn.q_proj.weight" in sd:
        return _eagle1(d, config, sd, model)
    raise TriforceError(f"{d} holds weights of an unknown layout (tensors {_names(sd)}): triforce loads EAGLE-1 heads "
                        f"(fc.weight, layers.0.*) and EAGLE-3 heads (fc.weight, midlayer.*, norm, lm_head, d2t), or "
                        f"its own from `triforce train-drafter`")


class _JoinNorm(nn.Module):
    """EAGLE-3's layer input in place of a decoder layer's input norm: [input_layernorm(embedding), hidden_norm(h)]
    (2 * hidden wide, what its q/k/v projections read); h is the layer's input and its residual. `embeddings` are
    set for each forward. `prenormed` (config norm_before_residual): h is already hidden_norm'ed (the residual is)."""

    def __init__(self, hidden: int, eps: float, prenormed: bool):
        super().__init__()
        self.input_norm, self.hidden_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.prenormed = prenormed
        self.embeddings: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_norm(self.embeddings), h if self.prenormed else self.hidden_norm(h)], dim=-1)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head with HeadDrafter's interface (DraftHead's): forward(features, embeddings, positions, cache)
    -> predictions, logits(prediction, lm_model) -> [V]. `features` are either the target's (the inputs of
    `feature_layers`, concatenated: fc mixes them) or its own predictions (hidden wide: fed as they are)."""

    def __init__(self, cfg: HeadConfig, layer_cfg, target_hidden: int, draft_vocab: int,
                 feature_layers: tuple[int, ...], norm_before_residual: bool = False):
        super().__init__()
        self.cfg, self.feature_layers = cfg, feature_layers
        H = cfg.hidden_size
        self.fc = Linear(len(feature_layers) * target_hidden, H, bias=False)
        self.layer = Block(cfg.layer_config(layer_cfg), 0)
        self.layer.wqkv = Linear(2 * H, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.layer.attn_norm = _JoinNorm(H, cfg.rms_norm_eps, norm_before_residual)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = Linear(H, draft_vocab, bias=False)
        # target id of each draft id (None: the draft vocabulary is the target's)
        self.register_buffer("targets", None)
        self.rotary = Rotary(layer_cfg.rope, cfg.head_dim, layer_cfg.max_context)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, cache=None
                ) -> torch.Tensor:
        """features [B, T, 3 * target hidden] (the target's) or [B, T, hidden] (predictions), embeddings
        [B, T, hidden] at positions [T] -> the predictions [B, T, hidden] (the layer's output before `norm`)."""
        h = self.fc(features) if features.shape[-1] == self.fc.in_features else features
        join = self.layer.attn_norm
        if join.prenormed:
            h = join.hidden_norm(h)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        join.embeddings = embeddings
        try:
            return self.layer(h, cos, sin, _Causal() if cache is None else cache)
        finally:
            join.embeddings = None

    def logits(self, prediction: torch.Tensor, lm_model: Transformer) -> torch.Tensor:
        """The next-token logits [V] over the target's vocabulary of a prediction [hidden]: its own norm and LM
        head over the draft vocabulary, -inf for every target token outside it."""
        draft = self.lm_head(self.norm(prediction[None]))[0].float()
        if self.targets is None:
            return draft
        out = draft.new_full((self.cfg.vocab_size,), float("-inf"))
        out[self.targets] = draft
        return out


def _read_config(d: Path) -> dict:
    try:
        config = json.loads((d / "config.json").read_text())
    except Exception as e:
        raise TriforceError(f"cannot read the draft head's config.json in {d} ({e}): copy it again from where the "
                            f"head was published") from e
    if not isinstance(config, dict):
        raise TriforceError(f"the draft head's config.json in {d} is not a JSON object: copy it again from where "
                            f"the head was published")
    return config


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    path = next((d / f for f in WEIGHT_FILES if (d / f).is_file()), None)
    if path is None:
        raise TriforceError(f"the draft head in {d} has a config.json but no weights: expected "
                            f"{' or '.join(WEIGHT_FILES)} beside it (download the head's weights file too)")
    try:
        if path.suffix == ".safetensors":
            sd = load_file(str(path))
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ValueError("not a dictionary of tensors")
    except Exception as e:
        raise TriforceError(f"cannot read the draft head's weights {path} ({type(e).__name__}: {e}): the file is "
                            f"damaged or incomplete; download it again") from e
    return sd


def _names(sd: dict) -> str:
    names = sorted(sd)
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _field(config: dict, name: str, d: Path, default=None):
    value = config.get(name, default)
    if value is None:
        raise TriforceError(f"the draft head's config.json in {d} lacks {name!r}: copy the config.json published "
                            f"with the head")
    return value


def _check_target(d: Path, kind: str, config: dict, model: Transformer, hidden: int) -> None:
    """The hidden size and vocabulary the head was made for against the target's; its layer is Llama-style."""
    c = model.cfg
    fix = "use the head published for this model, or train one with `triforce train-drafter --model ...`"
    if hidden != c.hidden_size:
        raise TriforceError(f"the {kind} head in {d} reads features of hidden size {hidden}, but this {c.arch} model's "
                            f"hidden size is {c.hidden_size}: {fix}")
    vocab = int(_field(config, "vocab_size", d))
    if vocab != c.vocab_size:
        raise TriforceError(f"the {kind} head in {d} was made for a vocabulary of {vocab} tokens, but this {c.arch} "
                            f"model's is {c.vocab_size}: {fix}")
    act, layers = config.get("hidden_act", "silu"), config.get("num_hidden_layers", 1)
    if act != "silu" or layers != 1 or config.get("model_type", "llama") not in ("llama", "qwen2", "mistral"):
        raise TriforceError(f"the {kind} head in {d} has an architecture triforce does not run (model_type "
                            f"{config.get('model_type')!r}, {layers} layers, {act} MLP): it loads heads of one "
                            f"Llama-style decoder layer with a SiLU MLP")


def _layer_config(d: Path, config: dict, model: Transformer, input_norm: bool, qkv_bias: bool
                  ) -> tuple[HeadConfig, object]:
    """The head's HeadConfig and the ModelConfig its layer is built from: its own RoPE (rope_theta, rope_scaling:
    EAGLE's heads carry their own, which need not be the target's), eps and max_position_embeddings."""
    H = int(_field(config, "hidden_size", d))
    n_heads = int(_field(config, "num_attention_heads", d))
    head_dim = int(config.get("head_dim") or H // n_heads)
    rp = dict(config.get("rope_scaling") or {})
    try:
        rope = _rope_config(rp, config.get("rope_theta", 10000.0), head_dim)
    except TriforceError as e:
        raise TriforceError(f"the draft head in {d}: {e}") from e
    eps = float(config.get("rms_norm_eps", 1e-6))
    cfg = HeadConfig(H, n_heads, int(config.get("num_key_value_heads") or n_heads), head_dim,
                     int(_field(config, "intermediate_size", d)), eps, model.cfg.vocab_size, target_fingerprint(model),
                     trained={"source": str(d)}, input_norm=input_norm, qkv_bias=qkv_bias)
    layer_cfg = replace(model.cfg, rope=rope, rms_norm_eps=eps, norm_weight_offset=0.0,
                        max_context=int(config.get("max_position_embeddings") or model.cfg.max_context))
    return cfg, layer_cfg


def _layer_weights(sd: dict, qkv_bias: bool, join_norm: bool) -> dict[str, torch.Tensor]:
    """Block's fused tensors from a layer's Llama names (layers.0.*)."""
    p = "layers.0."
    a, m = p + "self_attn.", p + "mlp."
    ours = {"layer.wqkv.weight": torch.cat([sd[a + n + ".weight"] for n in _ATTN[:3]]),
            "layer.wo.weight": sd[a + "o_proj.weight"],
            "layer.w_gate_up.weight": torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]),
            "layer.w_down.weight": sd[m + "down_proj.weight"],
            "layer.mlp_norm.weight": sd[p + "post_attention_layernorm.weight"]}
    if qkv_bias:
        ours["layer.wqkv.bias"] = torch.cat([sd[a + n + ".bias"] for n in _ATTN[:3]])
    if join_norm:
        ours["layer.attn_norm.input_norm.weight"] = sd[p + "input_layernorm.weight"]
        ours["layer.attn_norm.hidden_norm.weight"] = sd[p + "hidden_norm.weight"]
    return ours


def _expected(qkv_bias: bool, join_norm: bool) -> set[str]:
    p = "layers.0."
    names = {p + "self_attn." + n + ".weight" for n in _ATTN} | {p + "mlp." + n + ".weight" for n in _MLP}
    names.add(p + "post_attention_layernorm.weight")
    if qkv_bias:
        names |= {p + "self_attn." + n + ".bias" for n in _ATTN[:3]}
    if join_norm:
        names |= {p + "input_layernorm.weight", p + "hidden_norm.weight"}
    return names


def _load(d: Path, kind: str, head: nn.Module, ours: dict[str, torch.Tensor], sd: dict, expected: set[str]):
    """Copy `ours` into the head (fp32), refusing tensors it does not know and shapes its config.json contradicts."""
    unknown = sorted(set(sd) - expected - {"embed_tokens.weight", "t2d"})
    if unknown:
        raise TriforceError(f"the {kind} head in {d} has tensors its layout does not have ({', '.join(unknown[:6])}): "
                            f"triforce loads the published {kind} layout (docs/eagle_heads.md)")
    missing = sorted(n for n in expected if n not in sd)
    if missing:
        raise TriforceError(f"the {kind} head in {d} lacks {', '.join(missing[:6])}: its weights file is incomplete; "
                            f"download it again")
    own = head.state_dict()
    for name, tensor in ours.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise TriforceError(f"the {kind} head in {d} is damaged or disagrees with its config.json: {name} has "
                                f"shape {tuple(tensor.shape)}, the config says {tuple(own[name].shape)}")
    head.load_state_dict({k: v.float() for k, v in ours.items()}, strict=False)
    return head.eval()


def _check_embeddings(d: Path, kind: str, sd: dict, model: Transformer) -> None:
    emb = sd.get("embed_tokens.weight")
    if emb is not None and emb.shape[0] != model.cfg.vocab_size:
        raise TriforceError(f"the {kind} head in {d} embeds a vocabulary of {emb.shape[0]} tokens, but this "
                            f"{model.cfg.arch} model's is {model.cfg.vocab_size}: use the head published for "
                            f"this model")


def _eagle1(d: Path, config: dict, sd: dict, model: Transformer) -> DraftHead:
    H = int(_field(config, "hidden_size", d))
    _check_target(d, EAGLE1, config, model, H)
    _check_embeddings(d, EAGLE1, sd, model)
    qkv_bias = "layers.0.self_attn.q_proj.bias" in sd
    cfg, layer_cfg = _layer_config(d, config, model, input_norm=False, qkv_bias=qkv_bias)
    head = DraftHead(cfg, layer_cfg)
    bias = sd.get("fc.bias")
    if bias is None and config.get("bias", True):  # EAGLE's default: fc has a bias unless config.json says "bias": false
        raise TriforceError(f"the {EAGLE1} head in {d} lacks fc.bias, which its config.json promises (no \"bias\": "
                            f"false): its weights file is incomplete; download it again")
    ours = {"fc.weight": sd["fc.weight"], "fc.bias": torch.zeros(H) if bias is None else bias,
            **_layer_weights(sd, qkv_bias, join_norm=False)}
    return _load(d, EAGLE1, head, ours, sd, _expected(qkv_bias, False) | {"fc.weight"} | ({"fc.bias"} if bias is not None else set()))


def _feature_layers(d: Path, config: dict, model: Transformer) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads: config.json's eagle_aux_hidden_state_layer_ids (top
    level or in eagle_config, as vLLM and SGLang read them), else EAGLE's 2, n // 2, n - 3."""
    n = model.cfg.n_layers
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    layers = tuple(sorted(int(i) for i in (ids or (2, n // 2, n - 3))))  # concatenated in layer order, as captured
    if len(set(layers)) != 3 or not all(0 <= i < n for i in layers):
        raise TriforceError(f"the {EAGLE3} head in {d} reads the inputs of target layers {list(layers)}, which this "
                            f"{n}-layer {model.cfg.arch} model does not have as three distinct layers: an EAGLE-3 head "
                            f"needs the deeper model it was trained for")
    return layers


def _eagle3(d: Path, config: dict, sd: dict, model: Transformer) -> Eagle3Head:
    H = int(_field(config, "hidden_size", d))
    target_hidden = int(config.get("target_hidden_size") or H)
    _check_target(d, EAGLE3, config, model, target_hidden)
    if target_hidden != H:
        raise TriforceError(f"the {EAGLE3} head in {d} is {H} wide over a {target_hidden}-wide target "
                            f"(target_hidden_size): triforce loads EAGLE-3 heads as wide as their target")
    _check_embeddings(d, EAGLE3, sd, model)
    layers = _feature_layers(d, config, model)
    V = model.cfg.vocab_size
    draft_vocab = int(config.get("draft_vocab_size") or config.get("vocab_size"))
    cfg, layer_cfg = _layer_config(d, config, model, input_norm=True, qkv_bias=False)
    head = Eagle3Head(cfg, layer_cfg, target_hidden, draft_vocab, layers, bool(config.get("norm_before_residual")))
    expected = _expected(False, True) | {"fc.weight", "norm.weight", "lm_head.weight"}
    if draft_vocab != V or "d2t" in sd:  # (EAGLE drops an identity d2t; vLLM applies whichever it finds)
        expected.add("d2t")
    missing = sorted(n for n in expected if n not in sd)
    if missing:
        raise TriforceError(f"the {EAGLE3} head in {d} lacks {', '.join(missing[:6])}: its weights file is "
                            f"incomplete; download it again")
    if "d2t" in sd:
        d2t = sd["d2t"]
        targets = torch.arange(draft_vocab) + d2t.long() if tuple(d2t.shape) == (draft_vocab,) else None
        if targets is None or int(targets.min()) < 0 or int(targets.max()) >= V or len(targets.unique()) != draft_vocab:
            raise TriforceError(f"the {EAGLE3} head in {d} maps its {draft_vocab}-token draft vocabulary (d2t) onto "
                                f"tokens outside this {model.cfg.arch} model's vocabulary of {V}, or onto one token "
                                f"twice: use the head published for this model")
        head.targets = targets
    ours = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
            **_layer_weights(sd, False, join_norm=True)}
    return _load(d, EAGLE3, head, ours, sd, expected)
