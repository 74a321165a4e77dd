"""What a model holds and what running it will take, without loading it (`triforce info`).

For a GGUF file: its tensors by GGML type (the header and a memory map: nothing is read or
dequantized); for a Hugging Face directory: its safetensors headers. Bytes are what each --weights
choice holds in memory; KV bytes what the cache allocates per token in each --kv-dtype.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .. import memory
from ..config import KV_DTYPES, WEIGHTS, ModelConfig, kv_dtype_name
from ..errors import TriforceError
from ..ggml_blocks import QuantTensor, type_name
from . import DEFAULT_MAX_CONTEXT, DEFAULT_ROPE_THETA, default_kv_dtype, gguf_file_of
from .gguf_file import check_gguf_architecture, read_gguf
from .hf import read_hf_config

VECTOR = " (1-D)"  # the suffix of a format row of vectors (norms, biases)


@dataclass
class Inventory:
    source: str
    config: ModelConfig
    formats: dict[str, list[int]] = field(default_factory=dict)  # type name -> [tensors, parameters, bytes]

    def add(self, fmt: str, matrix: bool, values: int, nbytes: int) -> None:
        """Count one tensor of `values` values stored in `nbytes` bytes as `fmt`."""
        row = self.formats.setdefault(fmt if matrix else fmt + VECTOR, [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + values, row[2] + nbytes

    @property
    def parameters(self) -> int:
        return sum(v[1] for v in self.formats.values())

    def weight_bytes(self, weights: str) -> int:
        """Bytes of the weights held as `weights` (WEIGHTS; memory.held_bytes)."""
        return sum(memory.held_bytes(values, nbytes, not name.endswith(VECTOR), weights)
                   for name, (_, values, nbytes) in self.formats.items())

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        return memory.kv_bytes(self.config, 1, memory.kv_value_bytes(kv_dtype))


def inventory(path: str | os.PathLike | None, rope_theta: float | None = None,
              max_context: int | None = None) -> Inventory:
    gguf_path = gguf_file_of(path)
    if gguf_path is not None:
        check_gguf_architecture(gguf_path)
        hf, sd = read_gguf(gguf_path, progress=False, keep_quantized=True)
        cfg = ModelConfig.from_hf(hf)
        inv = Inventory(str(path) if path else "SmolLM2-135M-Instruct (embedded default)", cfg)
        for t in sd.values():
            if isinstance(t, QuantTensor):
                inv.add(type_name(t.qtype), True, t.shape[0] * t.shape[1], t.nbytes)
            else:
                inv.add("F32", t.dim() > 1, t.numel(), t.numel() * t.element_size())
        if path is None:
            rope_theta = DEFAULT_ROPE_THETA if rope_theta is None else rope_theta
            max_context = DEFAULT_MAX_CONTEXT if max_context is None else max_context
    else:
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise TriforceError(f"model not found: {directory} (pass a Hugging Face model directory or a .gguf file)")
        cfg = ModelConfig.from_hf(read_hf_config(directory))
        inv = Inventory(str(directory), cfg)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise TriforceError(f"{directory} has no *.safetensors weights")
        for f in files:
            with safe_open(str(f), "pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    # an HF directory's native weights are fp32 in memory (load_model), whatever the file holds
                    inv.add(sl.get_dtype(), len(sl.get_shape()) > 1, n, 4 * n)
    inv.config = inv.config.with_overrides(rope_theta=rope_theta, max_context=max_context)
    return inv


def report(inv: Inventory, weights: str, kv_dtype: str | None, context: int | None) -> str:
    """The text `triforce info` prints."""
    cfg = inv.config
    if kv_dtype:
        kv_dtype = kv_dtype_name(kv_dtype)
    else:  # what a run would use: fp16, or bf16 on a CPU with AMX tiles (fp32 activations; nothing is built)

        kv_dtype = default_kv_dtype(torch.float32, build=False)
    context = context or cfg.max_context
    lines = [f"model: {inv.source}",
             f"  {cfg.arch}: {cfg.n_layers} layers, hidden {cfg.hidden_size}, {cfg.n_heads} query / {cfg.n_kv_heads} KV "
             f"heads of {cfg.head_dim}, MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size}, context "
             f"{cfg.max_context} tokens",
             f"  parameters: {inv.parameters / 1e6:,.1f} M",
             "weights (as stored):",
             "  | format | tensors | parameters | bytes |", "  |---|---|---|---|"]
    for name, (n, params, b) in sorted(inv.formats.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"  | {name} | {n} | {params / 1e6:,.2f} M | {memory.gib(b)} |")
    lines.append("held in memory, by --weights: " + ", ".join(
        f"{w} {memory.gib(inv.weight_bytes(w))}" for w in WEIGHTS))
    lines.append("KV cache per 1K tokens, by --kv-dtype: " + ", ".join(
        f"{d} {memory.gib(1024 * inv.kv_bytes_per_token(d))}" for d in KV_DTYPES)
        + f" (a kv4 level's own 4-bit cache over a float target: {memory.gib(1024 * inv.kv_bytes_per_token('int4'))})")
    wb, kb = inv.weight_bytes(weights), context * inv.kv_bytes_per_token(kv_dtype)
    total = wb + kb + memory.RUNTIME
    avail = memory.available_bytes()
    # (this process already holds PyTorch, part of the runtime counted again: the verdict errs on the safe side)
    verdict = "" if avail is None else (
        f"; available {memory.gib(avail)}: " + ("fits" if total <= avail else "DOES NOT FIT"))
    lines.append(f"a {context}-token context with --weights {weights} --kv-dtype {kv_dtype}: weights {memory.gib(wb)} "
                 f"+ KV {memory.gib(kb)} + the runtime (Python, PyTorch, tokenizer, activations; measured with the "
                 f"embedded model) about {memory.gib(memory.RUNTIME)} = {memory.gib(total)} at its peak{verdict}")
    return "\n".join(lines)
