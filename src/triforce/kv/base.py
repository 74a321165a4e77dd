"""The KV-cache interface shared by every cache.

A forward pass over T new tokens calls, in order:
  `prepare(T)` once   -> the mask shared by all layers,
  `update(layer, q, k, v)` per layer -> the keys/values (and mask) that layer attends over,
  `commit(T)` once    -> the new tokens become part of the sequence.

Keys are stored after RoPE at their absolute positions, so a cache may keep any subset of the
sequence, in any order. `length` is the logical sequence length (the absolute position of the next
token), whatever the cache physically keeps. All storage is preallocated; `rollback(n)` is O(1).
"""
from __future__ import annotations

import torch

from ..errors import TriforceError


class KVCache:
    n_layers: int
    length: int

    def prepare(self, n_new: int) -> None:
        raise NotImplementedError

    def update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store k, v [B, Hkv, T, D] for `layer`; return (K, V [B, Hkv, S, D], mask).

        mask: None (all keys visible), CAUSAL (see above), or [T, S] bool, True where new token i
        may attend to key j.
        q [B, Hq, T, D] is passed for caches that select keys by query (it is not stored by default).
        """
        raise NotImplementedError

    def commit(self, n_new: int) -> None:
        self.length += n_new

    def rollback(self, length: int) -> None:
        """Forget every token at position >= `length`."""
        raise NotImplementedError


# A mask marker: every key but the newest T is visible to all T new tokens, and the newest T keys
# (the new tokens themselves) are causal. Attention can then skip building and applying a [T, S] mask.
CAUSAL = "causal"


def causal_mask(n_new: int, n_past: int, device: torch.device) -> torch.Tensor:
    """[T, n_past + T] bool: new token i sees all past keys and new keys 0..i."""
    rows = torch.arange(n_new, device=device)[:, None]
    cols = torch.arange(n_past + n_new, device=device)[None, :]
    return cols <= rows + n_past


def check_capacity(needed: int, capacity: int, what: str) -> None:
    if needed > capacity:
        raise TriforceError(
            f"{what} holds {capacity} tokens but {needed} are needed: raise --max-context "
            f"(or shorten the prompt / --max-new-tokens)"
        )
