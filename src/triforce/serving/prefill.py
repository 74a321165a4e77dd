"""A prompt's full-cache prefill that starts from the cached blocks of its longest cached prefix.

`CachedPrefill` has PrefilledPrompt's interface (`model`, `cache`, `restore(prompt)`), so
`generate_stream(..., prefilled=...)` runs any stack on it: the full level starts from this cache,
the drafting levels are rebuilt from it as usual (a retrieval level from its K/V and the last
prompt token's queries; a streaming or draft level prefills its own small cache).

Invariant: the cache holds, bit for bit, what `prefill(model, cache, head, chunk)` would (head = the
prompt but its last token, as BuiltStack.prefill feeds it): reused blocks were whole prefill chunks at
the same positions (prefix_cache.py), and the rest is fed in chunks of the same size from a chunk
boundary on.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..caches import BufferPool, new_cache
from ..execution.runner import DIRECT, ModelRunner
from ..model import Transformer
from ..speculation.state import PrefilledPrompt
from .prefix_cache import PrefixCache


class Stopped(Exception):
    """The prefill was stopped between chunks (`should_stop` said so): the request was cancelled
    or timed out. `partial` is the CachedPrefill as far as it got (its whole blocks can be cached)."""

    def __init__(self, partial: CachedPrefill):
        super().__init__("prefill stopped")
        self.partial = partial


class CachedPrefill(PrefilledPrompt):
    """The full cache (record_queries, `capacity` tokens) holding the prompt's head: a PrefilledPrompt
    (its `restore`) made from cached blocks and a prefill of the rest.

    Attributes: reused_tokens (from the prefix cache), computed_tokens (prefilled here), seconds,
    block_queries (block index -> [n_layers, n_heads, D], the last-token queries of each whole
    block computed here: PrefixCache.insert stores those blocks). `pool`: takes the full cache's buffers from
    there where it keeps some of their shape (the caller gives them back with `cache.release()` when done).
    `runner`: runs the prefill's forwards (a server's, through its gate; execution/runner.py)."""

    def __init__(self, model: Transformer, prompt: list[int], capacity: int, chunk: int,
                 prefix_cache: PrefixCache | None = None, should_stop: Callable[[], bool] = lambda: False,
                 pool: BufferPool | None = None, runner: ModelRunner = DIRECT):
        # (not PrefilledPrompt.__init__, which prefills the whole prompt)
        t0 = time.perf_counter()
        self.model, self.head = model, list(prompt[:-1])
        self.block_queries: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            blocks = prefix_cache.lookup(self.head) if prefix_cache is not None else []
            n = len(blocks) * chunk  # block_size == chunk (the engine makes the prefix cache with its prefill chunk)

            def restore():
                cache = new_cache(model, capacity, record_queries=True, pool=pool)
                for i, b in enumerate(blocks):
                    cache.write_positions(i * chunk, b.k, b.v)
                cache.commit(n)
                return cache

            # With the cores to itself, between the batch's forwards (runner.exclusive): on the request's thread (one
            # OpenMP thread) it held up the batch anyway, as the gate waits while any member works outside it, and
            # took longer (8 requests at 8K at once on the Zen 3 VM: first tokens after 1.26-1.39 s against 1.49-1.55)
            with runner.prefilling(max(1, len(self.head) - n)):  # (the gate's order: a prefill's part; 1: itself)
                self.cache = runner.exclusive(restore)
            last_q = blocks[-1].q_last if blocks else None  # [n_layers, n_heads, D]
            ids = torch.tensor([self.head], device=model.device)
            for start in range(n, len(self.head), chunk):
                if should_stop():
                    raise Stopped(self)
                end = min(start + chunk, len(self.head))
                with runner.prefilling(len(self.head) - start):
                    runner.forward(model, ids[:, start:end], self.cache, last=1)  # the call state.prefill makes
                last_q = torch.stack([q[0, :, -1] for q in self.cache.recorder.layers])
                if end - start == chunk:
                    self.block_queries[start // chunk] = last_q
        # every state reads the last prompt token's queries (recorded from len(head) - 1), as PrefilledPrompt keeps them
        n_layers = len(self.cache.recorder.layers)  # the global layers' (a sliding-window model records no others)
        self.queries = ([last_q[i][None, :, None, :] for i in range(n_layers)] if last_q is not None
                        else [None] * n_layers)
        self.point = self.cache.checkpoint()
        self.reused_tokens, self.computed_tokens = n, len(self.head) - n
        self.seconds = time.perf_counter() - t0

