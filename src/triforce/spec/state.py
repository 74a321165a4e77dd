"""A model with its KV cache, positioned over a prefix of the token sequence."""
from __future__ import annotations

import time

import torch

from ..kv import KVCache
from ..model import Transformer
from ..sampling import SamplingParams, probs_from_logits


class ModelState:
    """`fed` are the tokens whose K/V the cache holds (cache.length == len(fed)).

    Sequences passed in are `ctx` (a list of token ids) with ctx[:committed] final: tokens in there
    never change, so the match between `fed` and `ctx` is re-checked only past `stable`.
    """

    def __init__(self, name: str, model: Transformer, cache: KVCache, params: SamplingParams):
        self.name, self.model, self.cache, self.params = name, model, cache, params
        self.fed: list[int] = []
        self.stable = 0  # fed[:stable] is known to be committed
        self.forwards = 0
        self.seconds = 0.0

    def _sync(self, ctx: list[int], committed: int) -> int:
        """Roll back to the longest prefix of `fed` matching ctx, keeping at least one ctx token to
        feed (its logits give the next distribution); -> the kept length."""
        n, end = self.stable, min(len(self.fed), len(ctx) - 1)
        while n < end and self.fed[n] == ctx[n]:
            n += 1
        if n < len(self.fed):
            self.cache.rollback(n)
            del self.fed[n:]
        self.stable = min(n, committed)
        return n

    @torch.inference_mode()
    def score(self, ctx: list[int], committed: int, draft: list[int]) -> torch.Tensor:
        """Next-token distributions after ctx, ctx + draft[:1], ..., ctx + draft: [len(draft) + 1, V],
        from one forward over the ctx tokens not yet fed plus the draft."""
        n = self._sync(ctx, committed)
        feed = ctx[n:] + draft
        t = time.perf_counter()
        logits = self.model(torch.tensor([feed], device=self.model.device), self.cache, last=len(draft) + 1)[0]
        self.seconds += time.perf_counter() - t
        self.forwards += 1
        self.fed.extend(feed)
        return probs_from_logits(logits, self.params)

    def prefill(self, tokens: list[int], chunk_size: int = 512, progress: bool = False) -> None:
        """Feed `tokens` (from an empty cache) in chunks."""
        from ..generate import prefill

        assert not self.fed
        prefill(self.model, self.cache, torch.tensor([tokens], device=self.model.device), chunk_size, progress)
        self.fed = list(tokens)
        self.stable = len(tokens)
