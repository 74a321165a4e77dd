"""Rotary position embeddings: inverse frequencies for each RoPE variant, and their application.

Keys are cached *after* RoPE at their absolute positions, so every cache (full, streaming,
retrieval) can keep any subset of keys in any order without re-rotating them.
"""
from __future__ import annotations

import math

import torch

from .config import RopeConfig


def _yarn(inv_freq: torch.Tensor, rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position or max_position

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attention = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
    else:
        attention = get_mscale(factor)

    def correction_dim(n_rot: float) -> float:
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, attention


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_position: int) -> torch.Tensor:
    old = rope.original_max_position or max_position
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * out / rope.factor + smooth * out
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, out)


def inv_freq_and_scale(rope: RopeConfig, dim: int, max_position: int, seq_len: int = 0) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (fp32) and the cos/sin scale for `rope`.

    `max_position` is the model's configured context; `seq_len` matters only for dynamic NTK,
    whose base grows once the sequence passes the original context. `rope.freq_factors` (GGUF
    `rope_freqs`) divide the result: llama.cpp divides the base frequencies by them before its
    linear or YaRN scaling, and both of those multiply pair i by a constant of i alone (YaRN's ramp
    is indexed by pair, not by frequency), so the order does not matter.
    """
    inv_freq, scale = _variant(rope, dim, max_position, seq_len)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32, device=inv_freq.device)
    return inv_freq, scale


def _variant(rope: RopeConfig, dim: int, max_position: int, seq_len: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    if rope.type == "dynamic":
        orig = rope.original_max_position or max_position
        if seq_len > orig:
            base = base * ((rope.factor * seq_len / orig) - (rope.factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "yarn":
        return _yarn(inv_freq, rope, dim, max_position)
    if rope.type == "llama3":
        return _llama3(inv_freq, rope, max_position), 1.0
    return inv_freq, 1.0


class Rotary:
    """cos/sin for arbitrary absolute positions, computed on demand (no giant tables)."""

    def __init__(self, rope: RopeConfig, dim: int, max_position: int, device: torch.device | str = "cpu"):
        self.rope, self.dim, self.max_position = rope, dim, max_position
        self.inv_freq, self.scale = inv_freq_and_scale(rope, dim, max_position)
        self.inv_freq = self.inv_freq.to(device)
        self._dynamic_len = 0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (long) -> cos, sin [T, dim] in `dtype`."""
        if self.rope.type == "dynamic":
            # Like transformers: the base follows the longest sequence seen so far past the original context.
            seq_len = int(positions.max()) + 1
            orig = self.rope.original_max_position or self.max_position
            want = None
            if seq_len > max(orig, self._dynamic_len):
                want = seq_len  # grow only, as transformers does
            elif seq_len < orig and self._dynamic_len:
                want = 0  # back inside the original context: original frequencies
            if want is not None:
                inv, _ = inv_freq_and_scale(self.rope, self.dim, self.max_position, want)
                self.inv_freq, self._dynamic_len = inv.to(self.inv_freq.device), want
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [T, D]. Half-split (HF/NeoX) layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
