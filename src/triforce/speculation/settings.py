"""The knobs of the speculation levels (torch-free: the CLI parses them before loading anything).

A stack (stack.py) says which levels run and how many tokens each drafts; SpecConfig holds what
the levels of each kind need (default budgets, chunking, the rebuild policy, StreamingLLM sinks,
the n-gram length) and the defaults the named methods expand with.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import DEFAULT_DRAFT_KV_DTYPE, FLOAT_KV_DTYPES, kv_dtype_name
from ..errors import TriforceError


@dataclass(frozen=True)
class SpecConfig:
    # gamma 4 / gamma-draft 3: `triforce tune` at 32K predicted 2.0x at T = 0 and 1.4x at T = 0.6 for
    # them, against 1.85x / 1.2x for the earlier 6 / 2 (docs/benchmarks.md); tune per machine and temperature
    gamma: int = 4  # named methods: tokens drafted per verification by the full target (top level)
    gamma_draft: int = 3  # named method triforce: tokens the bottom drafter proposes per retrieval verification
    draft: str = "ngram"  # named method triforce: its bottom drafter, "ngram", "head", "streaming" or "draft" (a model)
    budget: int = 4096  # retrieval cache: tokens kept per layer and KV head (a level without :BUDGET)
    chunk_size: int = 8
    recent: int = 64  # newest tokens always kept by the retrieval cache
    rebuild_every: int = 256  # rebuild the retrieval cache after this many new tokens
    rebuild_below: float = 0.0  # ... or when the top level's recent acceptance falls below this (0: off)
    sink: int = 16  # StreamingLLM cache: sink tokens; window = budget - sink (a level without :BUDGET: `window`)
    window: int = 512
    ngram: int = 3  # longest n-gram matched by the n-gram drafter
    # a stack with levels between an n-gram bottom and `full`: the top verifies an n-gram proposal itself when
    # proposals from matches of its length were lately accepted at least this often (shortcut.NGramShortcut);
    # 0: never. Chosen on the 32K bench (docs/benchmarks.md)
    ngram_shortcut: float = 0.6
    prefill_chunk: int = 512
    # the named triforce stack adapts its route and gammas to what it measures while it runs (planner.py);
    # False (--no-adapt): the stack runs as given
    adapt: bool = True
    draft_weights: str = "bf16"  # weights of the target when it drafts (retrieval / streaming levels): bf16 or fp32
    # KV cache dtype of the drafting levels (retrieval, streaming, a small draft model; a kv4 level's
    # full-precision buffer): fp32, bf16 or fp16.
    # The target's own cache (full level, ar) has the model's kv_dtype (--kv-dtype).
    draft_kv_dtype: str = DEFAULT_DRAFT_KV_DTYPE
    head: str = ""  # a `head` level's draft head directory (--head); "": the one shipped for the embedded model

    def validate(self) -> None:
        for name in ("gamma", "gamma_draft", "chunk_size", "rebuild_every", "window", "ngram", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise TriforceError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.ngram_shortcut <= 1.0:
            raise TriforceError(f"--ngram-shortcut must be between 0 (never) and 1, got {self.ngram_shortcut}")
        if self.sink < 0 or self.recent < 0:
            raise TriforceError("--sink and --recent must be >= 0")
        if self.draft not in ("ngram", "head", "streaming", "draft"):
            raise TriforceError(f"unknown drafter {self.draft!r}: use ngram, head, streaming, or a draft model")
        if self.draft_weights not in ("bf16", "fp32"):
            raise TriforceError(f"--draft-weights must be bf16 or fp32, got {self.draft_weights!r}")
        kv_dtype_name(self.draft_kv_dtype, "--draft-kv-dtype", FLOAT_KV_DTYPES)

    @property
    def streaming_budget(self) -> int:
        return self.sink + self.window
