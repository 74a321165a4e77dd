"""Read a GGUF file (llama.cpp's format) into a Hugging Face-style config and fp32 state dict.

The config is what transformers' config.json for the same model holds (our ModelConfig.from_hf reads
it back), inverting llama.cpp's converter (convert_hf_to_gguf.py: TextModel.set_gguf_parameters,
LlamaModel.generate_extra_tensors and LlamaModel.permute). Quantised tensors are dequantised with the
`gguf` package. The converter permutes the rows of Q and K for the "llama" architecture only
(interleaved RoPE pairs); we undo that so the weights follow the Hugging Face half-split RoPE layout
that our forward uses.

Gemma 3 (`gemma3`, llama.cpp's Gemma3Model converter): the converter stores every norm weight as 1 + w
(Gemma3RMSNorm's factor) and does not permute Q/K; the file carries the sliding window but, unless newer
writers add them, neither the layer pattern nor the local RoPE base, which llama.cpp then takes as 6 and
1e4 (llama-hparams.h, models/gemma3.cpp): we do the same, and, like llama.cpp, scale queries by
head_dim ** -0.5 (hidden / heads for the 62-layer 27B) since the file has no query_pre_attn_scalar.

Whatever in the file would change the forward and is not understood here (a RoPE scaling type, a
key under `{arch}.rope.` or `{arch}.attention.`, `{arch}.final_logit_softcapping` outside Gemma 3, a
tensor name) raises a TriforceError naming it: nothing is skipped silently.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import ggml_blocks
from ..config import GEMMA3_LOCAL_ROPE_THETA, GEMMA3_SLIDING_WINDOW_PATTERN, SUPPORTED_ARCHITECTURES
from ..errors import TriforceError
from .gguf_check import STRING, check_gguf, damaged, gguf_architecture, value_type_name

# GGUF architecture -> (HF model_type, HF class). Only "llama" has its Q/K rows permuted by the converter.
_GGUF_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
               "qwen3": ("qwen3", "Qwen3ForCausalLM"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}

# GGUF block tensor -> HF name under model.layers.{i}. Biases are optional (HF attention_bias).
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
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma's four block norms (gguf-py's TensorNameMap for gemma3): ffn_norm is the norm before the MLP.
_SANDWICH_NORM_NAMES = {"attn_norm.weight": "input_layernorm.weight",
                        "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-pair frequency divisors (Llama 3.x RoPE scaling)


def _unsupported_architecture(arch, path) -> TriforceError:
    return TriforceError(f"unsupported GGUF architecture {arch!r} in {path}: supported are {', '.join(_GGUF_ARCHS)}")


def check_gguf_architecture(path: Path) -> str:
    """The file's GGUF architecture if we support it, else a TriforceError naming the supported ones.
    Reads the header only: milliseconds, before anything slow is imported or converted."""
    arch = gguf_architecture(path)
    if arch not in _GGUF_ARCHS:
        raise _unsupported_architecture(arch, path)
    return arch


# The keys read as strings, and as real numbers (an integer type is accepted there too); every other key read
# is an integer, a bool or an array of them (a float there is a damaged value type). Without `{arch}.`.
_STRING_KEYS = {"rope.scaling.type", "tokenizer.ggml.model"}
_REAL_KEYS = {"rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon", "rope.scaling.factor",
              "rope.scale_linear", "rope.scaling.attn_factor", "final_logit_softcapping"} | {
    f"rope.scaling.yarn_{k}" for k in ("attn_factor", "beta_fast", "beta_slow", "ext_factor", "log_multiplier")}
_FLOATS = {6, 12}  # GGUF's float32, float64


class _Metadata:
    """The key-value pairs of a GGUF file, read by name; remembers which were read, so that
    `unread` can name the ones this module does not understand."""

    def __init__(self, reader, arch: str, path: Path):
        self.fields, self.arch, self.path = reader.fields, arch, path
        self.read: set[str] = set()

    def name(self, key: str) -> str:
        """`{arch}.key`; a key starting with general. or tokenizer. as is."""
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def raw(self, key: str, default=None):
        """The value of `key` as stored: arrays as lists. A string where a number belongs, or the reverse (a
        damaged value type), is a TriforceError naming the key."""
        name = self.name(key)
        self.read.add(name)
        f = self.fields.get(name)
        if f is None:
            return default
        types = [int(t) for t in f.types]
        want = "a string" if key in _STRING_KEYS else "a number" if key in _REAL_KEYS else "an integer"
        if (types[-1] == STRING) != (want == "a string") or (want == "an integer" and types[-1] in _FLOATS):
            found = value_type_name(types[0], types[1] if len(types) > 1 else None)
            raise damaged(self.path, f"metadata '{name}'", f"{found}, {want} expected", truncated=False)
        return f.contents()

    def required(self, key: str) -> int:
        """`get(key)` as a positive integer; a TriforceError naming the key if it is missing or not one."""
        value = self.get(key)
        if value is None:
            raise damaged(self.path, "the metadata", f"no {self.name(key)} key, which every model file holds",
                          truncated=False)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise damaged(self.path, f"metadata '{self.name(key)}'", f"{value!r}, a positive integer expected",
                          truncated=False)
        return int(value)

    def get(self, key: str, default=None):
        """`raw(key)`, where per-layer arrays whose values are all equal (llama.cpp's model saver may
        write them) count as that value; other arrays are refused."""
        value = self.raw(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise TriforceError(f"{self.name(key)} differs between layers in {self.path} ({value}): not supported")
            value = value[0]
        return value

    def unread(self, *sections: str) -> list[str]:
        prefixes = tuple(f"{self.arch}.{s}" for s in sections)
        return sorted(k for k in self.fields if k.startswith(prefixes) and k not in self.read)


def _rope_parameters(meta: _Metadata, head_dim: int, context: int) -> dict:
    """transformers' `rope_parameters` for the file's `{arch}.rope.*` keys (as the converter wrote them
    from the HF config: TextModel.set_gguf_parameters), without the rope_freqs factors."""
    rp = {"rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    dims = int(meta.get("rope.dimension_count", head_dim))
    if dims != head_dim:
        raise TriforceError(f"{meta.path} rotates {dims} of each head's {head_dim} dimensions "
                            f"(partial RoPE): not supported")
    meta.get("rope.scaling.finetuned")  # a note on how the model was trained: no effect on the forward
    # llama.cpp: a missing or 0 factor means 1; `rope.scale_linear` is the old name of the factor; a
    # missing type means linear.
    factor, old_name = meta.get("rope.scaling.factor"), meta.get("rope.scale_linear")
    factor = float(factor or old_name or 1.0)
    stype = meta.get("rope.scaling.type") or ("linear" if factor != 1.0 else "none")
    attn_factor = float(meta.get("rope.scaling.attn_factor", 1.0))
    if attn_factor != 1.0:  # llama.cpp scales cos/sin by it, for every type; transformers has no such key
        raise TriforceError(f"{meta.arch}.rope.scaling.attn_factor = {attn_factor} in {meta.path}: not supported")
    # The YaRN keys are read (so not refused as unknown) whatever the type: llama.cpp uses them for YaRN only.
    yarn = {k: meta.get(f"rope.scaling.{k}") for k in ("original_context_length", "yarn_attn_factor", "yarn_beta_fast",
                                                       "yarn_beta_slow", "yarn_ext_factor", "yarn_log_multiplier")}
    if stype == "none":
        rp["rope_type"] = "default"
    elif stype == "linear":
        rp.update(rope_type="linear", factor=factor)
    elif stype == "yarn":
        # The converter writes transformers' attention_factor, beta_fast and beta_slow under the yarn_*
        # names; extrapolation_factor (ext) has no transformers equivalent: only its default, 1, is
        # accepted (a negative value is llama.cpp's "unset", which means 1 for YaRN).
        ext = yarn["yarn_ext_factor"]
        if ext is not None and float(ext) >= 0 and float(ext) != 1.0:
            raise TriforceError(f"{meta.arch}.rope.scaling.yarn_ext_factor = {ext} in {meta.path}: "
                                f"only 1 (YaRN's default) is supported")
        rp.update(rope_type="yarn", factor=factor,
                  original_max_position_embeddings=int(yarn["original_context_length"] or context))
        for gguf_key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                                 ("yarn_beta_slow", "beta_slow")):
            if yarn[gguf_key] is not None:
                rp[hf_key] = float(yarn[gguf_key])
        if yarn["yarn_log_multiplier"]:  # llama.cpp (llama-context.cpp): mscale 1 over mscale_all_dim = this
            rp.update(mscale=1.0, mscale_all_dim=float(yarn["yarn_log_multiplier"]))
    else:
        raise TriforceError(f"unsupported RoPE scaling type {stype!r} in {meta.path}: triforce reads none, linear "
                            f"and yarn (and Llama 3.x's rope_freqs)")
    if meta.get("rope.dimension_count_swa") not in (None, dims):
        raise TriforceError(f"{meta.arch}.rope.dimension_count_swa = {meta.get('rope.dimension_count_swa')} differs "
                            f"from the full layers' {dims} in {meta.path}: not supported")
    return rp


def _gemma3_config(meta: _Metadata, rp: dict, n_layers: int, hidden: int, n_head: int, head_dim: int) -> dict:
    """The Gemma 3 part of the HF config (transformers 5.x Gemma3TextConfig), as llama.cpp reads the file."""
    window = int(meta.get("attention.sliding_window") or 0)  # absent or 0: no sliding-window layers
    pattern = meta.raw("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # per layer (llama.cpp's is_swa array)
        if len(pattern) != n_layers:
            raise TriforceError(f"{meta.name('attention.sliding_window_pattern')} has {len(pattern)} values for "
                                f"{n_layers} layers in {meta.path}")
        sliding = [bool(x) for x in pattern]
    else:  # llama_hparams::set_swa_pattern: layer il slides iff il % n < n - 1 (n = 0: all)
        n = int(pattern)
        sliding = [n == 0 or il % n < n - 1 for il in range(n_layers)]
    local_theta = float(meta.get("rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_THETA)
    softcap = meta.get("final_logit_softcapping")
    return {
        "rope_parameters": {"full_attention": rp,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if window and s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": hidden // n_head if n_layers == 62 else head_dim,
        "final_logit_softcapping": float(softcap) if softcap else None,
        "hidden_activation": "gelu_pytorch_tanh",
    }


class _PlainMaps:
    """numpy, as gguf's reader module sees it inside open_reader: `memmap` gives a plain ndarray view of the
    map (its base, which keeps the map alive and is what ggml_blocks.QuantTensor looks for)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def memmap(*args, **kwargs):
        return np.memmap(*args, **kwargs).view(np.ndarray)


def open_reader(path: Path):
    """gguf.GGUFReader over a plain ndarray view of the file's memory map: the same fields and tensors,
    parsed 2-2.5x faster (np.memmap's subclass hooks run on each of the reader's ~1M slices: 1.6 s of the
    embedded file's 98K vocabulary strings, measured; 0.6 s this way). Should gguf stop reading
    `np.memmap` through its module's `np`, this is the plain reader again."""
    import gguf  # start-up: gguf is 40 ms to import, only GGUF files need it
    import gguf.gguf_reader as module

    saved = module.np
    module.np = _PlainMaps()
    try:
        return gguf.GGUFReader(str(path))
    finally:
        module.np = saved


# What a value of the file that passed check_gguf can still raise where it is used (a tensor of another
# size than the settings give it, a count used as a size): read_gguf turns these into one TriforceError,
# without their wording (numpy's or torch's, about arrays, not the file).
_DAMAGED = (TypeError, ValueError, KeyError, IndexError, OverflowError, ZeroDivisionError, AttributeError,
            struct.error)


def read_gguf(path: Path, progress: bool = True, keep_quantized: bool = False,
              check_tokenizer: bool = False) -> tuple[dict, dict[str, torch.Tensor | ggml_blocks.QuantTensor]]:
    """_read_gguf, where a value of the file that cannot be used (a damaged or hand-made file) is a
    TriforceError naming the file and the part (check_gguf), never another exception."""
    part = ["the header"]  # what _read_gguf is reading, for the error
    try:
        return _read_gguf(path, progress, keep_quantized, check_tokenizer, part)
    except TriforceError:
        raise
    except _DAMAGED as e:
        raise damaged(path, part[0], f"a value that cannot be used ({type(e).__name__})", truncated=False) from e


def _read_gguf(path: Path, progress: bool = True, keep_quantized: bool = False, check_tokenizer: bool = False,
               part: list[str] | None = None) -> tuple[dict, dict[str, torch.Tensor | ggml_blocks.QuantTensor]]:
    """-> (HF config dict, HF-named state dict). The config round-trips through JSON.

    The state dict holds fp32 tensors, or with `keep_quantized` the 2-D weights (projections,
    embedding, LM head) as QuantTensor: the file's own bytes, memory-mapped (a copy only where rows
    are reordered: Llama's Q and K), so resident memory is the file's tensor bytes; reading is then
    about the time gguf's reader takes to parse the header (seconds for a large vocabulary).

    `check_tokenizer` (before the tokenizer is rebuilt from the file): refuse a gemma3 file whose tokenizer
    transformers would rebuild wrongly. It picks its GGUF tokenizer converter by architecture and for gemma3
    always builds Gemma's SentencePiece tokenizer (tokenizer.ggml.model "llama"), whatever the file holds (a
    BPE "gpt2" one is then silently mis-tokenized)."""
    import gguf  # start-up: gguf is 40 ms to import, only GGUF files need it
    from gguf.quants import dequantize

    part = part if part is not None else ["the header"]
    arch = check_gguf_architecture(path)
    layout = check_gguf(path)  # every length, type, offset and size: gguf's reader then parses a sound file
    try:
        reader = open_reader(path)
    except Exception as e:  # (none known once check_gguf passed)
        raise damaged(path, "the header", f"gguf's reader fails ({type(e).__name__})", truncated=False) from e
    records = {t.name: t for t in layout.tensors}
    model_type, hf_class = _GGUF_ARCHS[arch]
    meta = _Metadata(reader, arch, path)
    if check_tokenizer and arch == "gemma3" and (kind := meta.get("tokenizer.ggml.model")) not in (None, "llama"):
        raise TriforceError(f"{path} is a gemma3 model with a {kind!r} tokenizer (tokenizer.ggml.model): "
                            f"transformers reads only Gemma's own SentencePiece tokenizer ('llama') correctly "
                            f"for this architecture, so its text would be tokenized wrongly")
    tensors = {t.name: t for t in reader.tensors}
    part[0] = "the metadata"
    n_layers = meta.required("block_count")
    if n_layers > len(tensors):  # every layer holds tensors: a damaged count is refused before anything is sized by it
        raise damaged(path, f"metadata '{meta.name('block_count')}'", f"declares {n_layers} layers, but the file "
                      f"holds {len(tensors)} tensors (a few per layer expected)", truncated=False)
    qkv_bias = SUPPORTED_ARCHITECTURES[model_type].qkv_bias or "blk.0.attn_q.bias" in tensors
    block_names = _block_names(model_type)
    _check_tensor_names(set(tensors), block_names, n_layers, qkv_bias, arch, path)
    n_head = meta.required("attention.head_count")
    n_kv = int(meta.get("attention.head_count_kv", n_head))
    hidden = meta.required("embedding_length")
    head_dim = int(meta.get("attention.key_length", hidden // n_head))
    if int(meta.get("attention.value_length", head_dim)) != head_dim:
        raise TriforceError(f"{path} has keys and values of different head sizes: not supported")
    if not meta.get("attention.causal", True):
        raise TriforceError(f"{path} is a non-causal (embedding) model: not supported")
    context = int(meta.get("context_length", 4096))
    rope_parameters = _rope_parameters(meta, head_dim, context)
    hf = {
        "model_type": model_type,
        "architectures": [hf_class],
        "vocab_size": int(meta.get("vocab_size", tensors["token_embd.weight"].shape[-1])),
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "intermediate_size": meta.required("feed_forward_length"),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": context,
        "rope_parameters": rope_parameters,
        "attention_bias": qkv_bias,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    _check_tensor_shapes(records, hf, block_names, path)
    gemma = SUPPORTED_ARCHITECTURES[model_type].gemma
    if gemma:
        hf.update(_gemma3_config(meta, rope_parameters, n_layers, hidden, n_head, head_dim))
    else:
        window = meta.get("attention.sliding_window")
        if window:  # attention within the window only: ModelConfig caps the context at it
            hf.update(sliding_window=int(window), use_sliding_window=True)
        if meta.get("rope.freq_base_swa") not in (None, rope_parameters["rope_theta"]):
            raise TriforceError(f"{arch}.rope.freq_base_swa = {meta.get('rope.freq_base_swa')} differs from the full "
                                f"layers' {rope_parameters['rope_theta']} in {path}: not supported")
    for swa in ("attention.key_length_swa", "attention.value_length_swa"):
        if meta.get(swa) not in (None, head_dim):
            raise TriforceError(f"{arch}.{swa} = {meta.get(swa)} differs from the head size {head_dim} in {path}: "
                                f"not supported")
    unknown = meta.unread("rope.", "attention.", "final_logit_softcapping")
    if unknown:
        raise TriforceError(f"{path} has settings triforce does not understand: {', '.join(unknown)}")
    if _ROPE_FREQS in tensors:
        part[0] = records[_ROPE_FREQS].describe()
        factors = dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type).astype(np.float64).ravel()
        if factors.shape != (head_dim // 2,):
            raise damaged(path, part[0], f"{factors.size} values, {head_dim // 2} expected (half the head size)",
                          truncated=False)
        _check_finite(factors, path, part[0])
        rope_parameters["freq_factors"] = factors.tolist()  # the global layers' (for Gemma 3)

    def kept(t) -> bool:
        return keep_quantized and len(t.shape) == 2 and int(t.tensor_type) != ggml_blocks.F32

    sd: dict[str, torch.Tensor | ggml_blocks.QuantTensor] = {}
    for t in tqdm(reader.tensors, desc="reading GGUF" if keep_quantized else "dequantising GGUF", unit="tensor",
                  disable=not progress):
        if t.name == _ROPE_FREQS:
            continue  # in the config (freq_factors) above
        part[0] = records[t.name].describe()
        w = t.data if kept(t) else dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if w.ndim == 1:  # norms, biases: small, and read here anyway
            _check_finite(w, path, part[0])
        if t.name in _TOP_NAMES:
            key = _TOP_NAMES[t.name]
        else:
            _, layer, rest = t.name.split(".", 2)
            key = f"model.layers.{layer}.{block_names[rest]}"
            if arch == "llama" and rest in ("attn_q.weight", "attn_q.bias"):
                w = _unpermute(w, n_head)
            elif arch == "llama" and rest in ("attn_k.weight", "attn_k.bias"):
                w = _unpermute(w, n_kv)
        if gemma and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # the converter stored 1 + w; Hugging Face's Gemma3RMSNorm holds w
        if kept(t):
            sd[key] = ggml_blocks.QuantTensor.from_numpy(w, int(t.tensor_type), int(t.shape[0]))
        else:
            sd[key] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    return hf, sd


def _check_finite(values: np.ndarray, path: Path, part: str) -> None:
    """A 1-D tensor's values are finite numbers: a NaN or infinity there is a bit flip in its data (the one
    damage to tensor data that is cheap to see: GGUF holds no checksum)."""
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise damaged(path, part, f"value #{bad[0]} is {values[bad[0]]}, a finite number expected (damaged data)",
                      truncated=False)


def _block_names(model_type: str) -> dict[str, str]:
    """GGUF block tensor names -> HF names (under model.layers.{i}.) that `model_type` has."""
    spec = SUPPORTED_ARCHITECTURES[model_type]
    names = dict(_NAMES, **(_QK_NORM_NAMES if spec.qk_norm else {}))
    if spec.gemma:
        names.update(_SANDWICH_NORM_NAMES)
    return names


def _check_tensor_names(names: set[str], block_names: dict[str, str], n_layers: int, qkv_bias: bool,
                        arch: str, path: Path) -> None:
    """Every tensor is one we load, and every one the forward needs is there. A name one or two bytes off a
    missing one is a damaged name."""
    needed = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{n}" for i in range(n_layers) for n in block_names
        if not n.endswith(".bias") or (qkv_bias and n.startswith(("attn_q.", "attn_k.", "attn_v.")))]
    missing = [n for n in needed if n not in names]
    for name in sorted(names):
        parts = name.split(".", 2)
        in_block = len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers
        if not (name in _TOP_NAMES or name == _ROPE_FREQS or (in_block and parts[2] in block_names)):
            near = [n for n in missing if len(n) == len(name) and sum(a != b for a, b in zip(n, name)) <= 2]
            if near:
                raise damaged(path, f"tensor '{name}'", f"an unknown name, where '{near[0]}' is missing",
                              truncated=False)
            raise TriforceError(f"{path} holds the tensor {name!r}, which triforce does not support for "
                                f"architecture {arch!r}")
    if missing:
        raise TriforceError(f"{path} lacks the tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


def _check_tensor_shapes(records: dict, hf: dict, block_names: dict[str, str], path: Path) -> None:
    """Every tensor (gguf_check.TensorRecord) has the shape the config gives it (rows, columns in numpy order;
    GGUF lists them reversed): a file whose sizes disagree is refused before any is read or allocated."""
    hidden, inter, hd = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    q, kv, vocab = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd, hf["vocab_size"]
    want = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,),
            "attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden), "attn_v.weight": (kv, hidden),
            "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_output.weight": (hidden, q),
            "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden), "ffn_down.weight": (hidden, inter),
            "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}
    wrong = []
    for name, t in records.items():
        if name == _ROPE_FREQS:
            continue  # checked against head_dim where it is read
        part = name if name in _TOP_NAMES else name.split(".", 2)[2]
        expected = want.get(part, (hidden,) if part.endswith("norm.weight") and part in block_names else None)
        shape = tuple(reversed(t.dims))
        if expected is not None and shape != expected:
            wrong.append((t, shape, expected))
    if not wrong:
        return
    t, shape, expected = wrong[0]
    settings = (f"hidden {hidden}, heads {hf['num_attention_heads']}/{hf['num_key_value_heads']} of {hd}, "
                f"feed-forward {inter}, vocabulary {vocab}")
    if len(wrong) == 1:  # one tensor's shape: its record is damaged
        raise damaged(path, t.describe(), f"shape {shape}, {expected} expected from its settings ({settings}): a "
                      f"damaged shape", truncated=False)
    raise damaged(path, "the metadata", f"its settings ({settings}) disagree with {len(wrong)} of the "
                  f"{len(records)} tensors: '{t.name}' has shape {shape}, {expected} expected from its settings: "
                  f"a damaged setting", truncated=False)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's LlamaModel.permute of Q/K rows (pairs (i, i + D/2) of each head made
    adjacent): rows [n_head * D] -> the Hugging Face order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
