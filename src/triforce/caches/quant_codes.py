"""The quantized KV cache's codes (quantized.py): its groups, 8-bit codes and their two 4-bit planes, and which
positions a query reads quantized.

Codes. Keys are quantized per channel over groups of GROUP_K = 64 consecutive tokens (one scale and
zero point per group and channel: keys have outlier channels); values per token over groups of
GROUP_V = 32 channels. A value x becomes the 8-bit code c = clamp(round((x - zero) / scale), 0, 255) with
scale = (max - min) / 255 and zero = min of its group (both stored in fp16; the codes are computed from the
stored fp16 numbers), so x ~ c * scale + zero within scale / 2. The code is stored as two 4-bit planes,
upper = c >> 4 and lower = c & 15, each packed two codes per byte in the order the kernel's integer dot
products read them (`pack_keys`, `pack_values`): the 8-bit reading is (16 * upper + lower) * scale + zero,
the 4-bit reading (QuantSpec's draft) uses the upper plane alone, (16 * upper + 8) * scale + zero (within
8.5 * scale). `bits=4` stores only the upper plane.
"""
from __future__ import annotations

import torch

GROUP_K = 64  # tokens per key group (per-channel scales)
GROUP_V = 32  # channels per value group (per-token scales)
PACK = 32  # channels per packing block of a plane (see pack)
LEVELS = 255  # 8-bit codes 0..255


def fp_from(position: int) -> int:
    """The first position a query at `position` reads in full precision (earlier ones: from the planes)."""
    return GROUP_K * max(0, position // GROUP_K - 1)


def fp_from_tensor(positions: torch.Tensor) -> torch.Tensor:
    return ((positions // GROUP_K - 1).clamp(min=0) * GROUP_K).long()


KEY_LANE = 8  # channels of one token per 4-byte lane of the key planes (4 in low nibbles, 4 in high ones)


def _key_lane(d: int) -> int:
    return min(KEY_LANE, d)


def _value_block(d: int) -> int:
    return min(PACK, d)


def pack_keys(codes: torch.Tensor) -> torch.Tensor:
    """Key codes [..., G, 64, D] (uint8: groups, tokens, channels) -> one plane's bytes [..., G * 64, D / 2],
    two 4-bit codes (the low nibbles of `codes`) per byte. Per group, lanes of 8 channels of one token:
    [D / 8][64 tokens][4 bytes], byte b of token t's lane k holding channel 8k + b in its low nibble and
    8k + 4 + b in its high one (vpdpbusd's 4-byte lanes: a vector is 16 tokens, one query dword per lane)."""
    *lead, G, n, D = codes.shape
    o = _key_lane(D)
    c = (codes & 15).reshape(*lead, G, n, D // o, 2, o // 2).transpose(-4, -3)  # [..., G, D / o, n, 2, o / 2]
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*lead, G * n, D // 2)


def unpack_keys(plane: torch.Tensor, n: int = GROUP_K) -> torch.Tensor:
    """A key plane [..., G * n, D / 2] -> its 4-bit codes [..., G, n, D] (uint8)."""
    *lead, rows, half = plane.shape
    D, G = 2 * half, rows // n
    o = _key_lane(D)
    p = plane.reshape(*lead, G, D // o, n, o // 2)
    return torch.stack((p & 15, p >> 4), dim=-2).transpose(-4, -3).reshape(*lead, G, n, D)


def pack_values(codes: torch.Tensor) -> torch.Tensor:
    """Value codes [..., n, D] (uint8, n even) -> one plane's bytes [..., n, D / 2]: per pair of tokens and
    block of 32 channels, 32 bytes, byte 2j + i holding token i's channel j in its low nibble and channel
    16 + j in its high one (widened to 16-bit words, a vector pairs two tokens per channel: vpdpwssd's lanes)."""
    *lead, n, D = codes.shape
    P = _value_block(D)
    c = (codes & 15).reshape(*lead, n // 2, 2, D // P, 2, P // 2).movedim(-4, -1)  # [..., n/2, D/P, 2, P/2, 2]
    return (c[..., 0, :, :] | (c[..., 1, :, :] << 4)).reshape(*lead, n, D // 2)


def unpack_values(plane: torch.Tensor) -> torch.Tensor:
    """A value plane [..., n, D / 2] -> its 4-bit codes [..., n, D] (uint8)."""
    *lead, n, half = plane.shape
    D = 2 * half
    P = _value_block(D)
    p = plane.reshape(*lead, n // 2, D // P, P // 2, 2)
    return torch.stack((p & 15, p >> 4), dim=-3).movedim(-1, -4).reshape(*lead, n, D)


def codes_of(hi: torch.Tensor, lo: torch.Tensor | None) -> torch.Tensor:
    """Unpacked 4-bit codes -> fp32 codes on the 8-bit scale: 16 * upper + lower, or 16 * upper + 8 from the upper
    plane alone."""
    c = hi.float() * 16
    return c + (lo.float() if lo is not None else 8.0)


def by_group(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Per-token value scales [..., n, NB] <-> their storage order [..., n / 64 groups of [NB, 64]]."""
    *lead, n, nb = x.shape
    if inverse:
        return x.reshape(*lead, n // GROUP_K, nb, GROUP_K).transpose(-1, -2).reshape(*lead, n, nb)
    return x.reshape(*lead, n // GROUP_K, GROUP_K, nb).transpose(-1, -2).reshape(*lead, n, nb)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., N] (any float) grouped over its last dim -> (codes [..., N] uint8, scale [...], zero [...] fp16):
    zero = min, scale = (max - min) / 255, both rounded to fp16 first; codes from the fp16 numbers."""
    x = x.float()
    lo, hi = x.amin(-1), x.amax(-1)
    scale, zero = ((hi - lo) / LEVELS).half(), lo.half()
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((x - zero.float()[..., None]) / s[..., None]).clamp_(0, LEVELS).to(torch.uint8)
    return codes, scale, zero
