"""The machine's memory bandwidth, the physical floor of a decode step, and a prefill's arithmetic."""
from __future__ import annotations

import time

import torch

from ..execution import Linear, QuantEmbedding
from ..memory import kv_bytes, kv_value_bytes


def measure_bandwidth(gib: float | None = None, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Memory read bandwidth in bytes/s of `device`: a sum over a `gib` GiB fp32 tensor there (default 1 GiB,
    4 on a GPU, so that the timer's resolution is small beside it), best of `repeats`."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.ones(int((gib or (4.0 if cuda else 1.0)) * 2**30 / 4), device=device)
    x.sum()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read by one decode step (the embedding table only as the LM head's weights:
    the lookup itself reads one row). Linear layers holding bf16 panels (a draft-weights
    copy, loading.weights.draft_weights) are counted at the panels' size, weights kept in GGML blocks
    (QuantLinear) at their stored bytes: that is what they read."""
    read_as = {id(m.weight): m.panels.numel() * m.panels.element_size() for m in model.modules()
               if isinstance(m, Linear) and m.panels is not None and m.panels.dtype != m.weight.dtype}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # QuantLinear's blocks are buffers
    total = sum(read_as.get(i, t.numel() * t.element_size()) for i, t in tensors.items())
    table = model.embed.raw if isinstance(model.embed, QuantEmbedding) else model.embed.weight
    head = {id(t) for t in [*model.lm_head.parameters(), *model.lm_head.buffers()]}
    if id(table) not in head:  # (a tied head packed for the kernels holds its own copy: quantized.pack_rows)
        total -= table.numel() * table.element_size()
    return total


def kv_bytes_per_token(model, kv_element_size: float | None = None) -> int:
    """K and V bytes of one token over every layer, with elements of `kv_element_size` bytes (None:
    those of the model's own cache, memory.kv_value_bytes(model.kv_dtype)). (cfg.kv_bytes_per_token counts fp32 elements.)"""
    return kv_bytes(model.cfg, 1, kv_value_bytes(model.kv_dtype) if kv_element_size is None else kv_element_size)


def floor_seconds(model, kv_tokens: int, bandwidth: float, kv_element_size: float | None = None) -> float:
    """(weight bytes + KV bytes read) / bandwidth for one decode step attending to `kv_tokens`, whose
    K/V elements take `kv_element_size` bytes (None: those of the model's own cache, model.kv_dtype)."""
    return (weight_bytes(model) + kv_tokens * kv_bytes_per_token(model, kv_element_size)) / bandwidth


def prefill_flops(cfg, n: int) -> tuple[float, float]:
    """(attention, linear layers) FLOPs of prefilling n tokens from an empty cache: causal attention, 4 head_dim
    FLOPs per (query head, visible key) for q k and p v; the layers' projections, 2 FLOPs per weight and token
    (the LM head runs for the last token only: left out)."""
    attention = 4.0 * cfg.head_dim * cfg.n_heads * cfg.n_layers * n * (n + 1) / 2
    h = cfg.hidden_size
    per_token = cfg.n_layers * (2 * h * cfg.head_dim * (cfg.n_heads + cfg.n_kv_heads) + 3 * h * cfg.intermediate_size)
    return attention, 2.0 * n * per_token
