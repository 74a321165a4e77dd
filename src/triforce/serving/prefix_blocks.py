"""A prefix cache's block (prefix_cache.py) and its keys: a block's key is the chain hash of its tokens and its
parent's key, so it names the whole prefix up to the block's end; the settings key names everything the cached K/V
depend on (the model's weights, the KV dtype, RoPE, the block size, the compute backend)."""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass

import torch

from .. import kernels
from ..config import kv_dtype_name
from ..model import Transformer

FORMAT = 1  # of the block files and the manifest; bump when either changes
_SAMPLES_PER_TENSOR = 4096  # weight elements hashed per tensor for the model fingerprint


def model_fingerprint(model: Transformer) -> str:
    """A hash of the model: its config and, per weight tensor (parameters and buffers, quantized
    blocks included), its name, shape, dtype and a strided sample of its values. Hashing every byte of
    a 7B model would take minutes at each start; two models with different weights differ in (nearly)
    every sample."""
    h = hashlib.sha256(repr(model.cfg).encode())
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    for name, t in sorted(tensors.items()):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        try:
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            h.update(flat[::step][:_SAMPLES_PER_TENSOR].float().cpu().numpy().tobytes())
        except (RuntimeError, TypeError):  # a packed / quantized tensor without a plain view: shape only
            pass
    return h.hexdigest()[:24]


def _compute_backend(model: Transformer) -> str:
    """Which operations computed the K/V (the compiled kernels or PyTorch, and torch's version):
    another backend may differ in the last bits."""
    enabled = bool(getattr(getattr(model.layers[0], "backend", None), "enabled", False)) if len(model.layers) else False
    isa = "torch"
    if enabled:
        try:
            isa = kernels.chosen_isa() or "torch"
        except Exception:  # noqa: BLE001 - a bad TRIFORCE_ISA was already reported when the model loaded
            isa = "kernels"
    return f"{isa}|torch {torch.__version__}"


def settings_key(model: Transformer, block_size: int) -> dict:
    """Everything the cached K/V depend on. Blocks are reused (and files loaded) only under equal keys."""
    cfg = model.cfg
    return {
        "format": FORMAT,
        "model": model_fingerprint(model),
        "kv_dtype": kv_dtype_name(model.kv_dtype),
        "weights_dtype": str(model.dtype).removeprefix("torch."),
        "rope": json.loads(json.dumps(asdict(cfg.rope))),
        "rope_local": json.loads(json.dumps(asdict(cfg.rope_local))) if cfg.rope_local else None,
        "max_context": cfg.max_context,
        "block_size": block_size,
        "compute": _compute_backend(model),
    }


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def chain_hash(parent: str | None, tokens) -> str:
    """The key of a block: its tokens and its parent's key (None for the first block)."""
    h = hashlib.sha256((parent or "root").encode())
    h.update(b"|" + ",".join(map(str, tokens)).encode())
    return h.hexdigest()[:32]


def leading(keys, present) -> int:
    """How many of `keys` (a prompt's block keys, root first) are in `present`, from the first on: the blocks a
    cache holding `present` would reuse."""
    return sum(1 for _ in itertools.takewhile(present.__contains__, keys))


def block_keys(tokens, block_size: int) -> list[str]:
    """The keys of the whole blocks of `tokens`, root first: what a PrefixCache of this block size
    looks up for this prompt (a router matches them against the keys a replica holds)."""
    keys, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = chain_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


@dataclass(eq=False)
class Block:
    key: str
    parent: str | None
    index: int  # the block covers positions [index * C, (index + 1) * C)
    tokens: tuple[int, ...]
    k: torch.Tensor  # [n_layers, n_kv_heads, C, head_dim], the model's KV dtype
    v: torch.Tensor
    q_last: torch.Tensor  # [n_layers, n_heads, head_dim]: post-RoPE queries of the block's last token
    children: int = 0  # cached blocks whose parent this is (a block with children is never evicted)
    last_used: int = 0
    file: tuple[int, str] | None = None  # (bytes, SHA-256) of its file on disk, once written
    owned: bool = True  # its file is ours to remove when it is evicted (not one another server wrote)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.q_last))
