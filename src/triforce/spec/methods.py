"""The named methods, each a stack of the same pieces:

    ar         full target, autoregressive
    ngram      n-gram lookup            -> full target
    streaming  target + StreamingLLM cache -> full target          (the paper's "naive policy")
    draft      a small model (full cache)  -> full target           (plain speculative decoding)
    retrieval  target + retrieval cache    -> full target           ("retrieval w/o hierarchy")
    triforce   drafter -> target + retrieval cache -> full target   (drafter: ngram, streaming or a model)
"""
from __future__ import annotations

import time
import weakref
from dataclasses import asdict, dataclass

import torch

from ..errors import TriforceError
from ..kv import RetrievalCache, StreamingCache
from ..model import Transformer
from ..sampling import SamplingParams
from .drafters import ModelDrafter, NGramDrafter
from .level import Level
from .state import ModelState

METHODS = ("ar", "triforce", "retrieval", "streaming", "ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    # gamma 4 / gamma-draft 3: `triforce tune` at 32K predicted 2.0x at T = 0 and 1.4x at T = 0.6 for
    # them, against 1.85x / 1.2x for the earlier 6 / 2 (docs/benchmarks.md); tune per machine and temperature
    gamma: int = 4  # tokens drafted per verification by the full target (top level)
    gamma_draft: int = 3  # tokens drafted per verification by the retrieval level (triforce only)
    draft: str = "ngram"  # triforce's bottom drafter: "ngram", "streaming" (target + StreamingLLM cache), or "model"
    budget: int = 4096  # retrieval cache: tokens kept per layer and KV head
    chunk_size: int = 8
    recent: int = 64  # newest tokens always kept by the retrieval cache
    rebuild_every: int = 256  # rebuild the retrieval cache after this many new tokens
    rebuild_below: float = 0.0  # ... or when the top level's recent acceptance falls below this (0: off)
    sink: int = 16  # StreamingLLM cache
    window: int = 512
    ngram: int = 3  # longest n-gram matched by the n-gram drafter
    prefill_chunk: int = 512
    draft_weights: str = "bf16"  # weights of the target when it drafts (retrieval / streaming levels): bf16 or fp32

    def validate(self, max_context: int, method: str) -> None:
        for name in ("gamma", "gamma_draft", "chunk_size", "rebuild_every", "window", "ngram", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise TriforceError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.sink < 0 or self.recent < 0:
            raise TriforceError("--sink and --recent must be >= 0")
        if method in ("triforce", "retrieval") and self.budget > max_context:
            raise TriforceError(f"--budget {self.budget} is larger than the model's context of {max_context} tokens: "
                                f"lower --budget (the retrieval cache must be smaller than the context to help)")
        if self.draft not in ("ngram", "streaming", "model"):
            raise TriforceError(f"unknown drafter {self.draft!r}: use ngram, streaming, or a draft model")
        if self.draft_weights not in ("bf16", "fp32"):
            raise TriforceError(f"--draft-weights must be bf16 or fp32, got {self.draft_weights!r}")


_DRAFT_WEIGHTS: weakref.WeakKeyDictionary[Transformer, Transformer] = weakref.WeakKeyDictionary()


def draft_weights_model(model: Transformer) -> Transformer:
    """model.with_draft_weights(), made once per model (it holds a bf16 copy of the weights)."""
    if model not in _DRAFT_WEIGHTS:
        _DRAFT_WEIGHTS[model] = model.with_draft_weights()
    return _DRAFT_WEIGHTS[model]


def drafting_model(model: Transformer, config: SpecConfig) -> Transformer:
    """The target as it runs when it drafts (retrieval and streaming levels): its bf16 draft-weights
    copy unless config.draft_weights is "fp32". Exactness does not depend on it: the full level
    verifies with the fp32 weights."""
    return draft_weights_model(model) if config.draft_weights == "bf16" else model


class SharedPrefill:
    """A full cache holding a prompt's prefill, reused by several runs (benchmarks): each run rolls
    it back to the prompt, so the prefill is paid once. Keeps the last token's queries for the
    retrieval build."""

    def __init__(self, model: Transformer, prompt: list[int], capacity: int, chunk_size: int = 512,
                 progress: bool = False):
        from ..generate import prefill

        self.head = list(prompt[:-1])
        self.cache = model.new_cache(capacity, record_queries=True)
        prefill(model, self.cache, torch.tensor([self.head], device=model.device), chunk_size, progress)
        self.queries = [q[:, :, -1:].clone() for q in self.cache.queries]

    def restore(self, head: list[int]):
        if head != self.head:
            raise ValueError("the shared prefill belongs to another prompt")
        self.cache.rollback(len(self.head))
        self.cache.queries = list(self.queries)
        self.cache.query_start = len(self.head) - 1
        return self.cache


class Decoder:
    """Holds a method's model states and its top proposer; runs prefill and the rebuild policy."""

    def __init__(self, method: str, model: Transformer, params: SamplingParams, config: SpecConfig,
                 generator: torch.Generator, prompt_len: int, max_new_tokens: int,
                 draft_model: Transformer | None = None, shared: SharedPrefill | None = None):
        if method not in METHODS:
            raise TriforceError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
        config.validate(model.cfg.max_context, method)
        self.method, self.model, self.params, self.config, self.generator = method, model, params, config, generator
        self.notes: list[str] = []
        self.rebuilds = 0
        self.rebuild_seconds = 0.0
        capacity = prompt_len + max_new_tokens + config.gamma + 2
        self.shared = shared
        if shared is not None:
            full_cache = shared.cache
            if full_cache.capacity < capacity:
                raise ValueError(f"the shared prefill's cache holds {full_cache.capacity} tokens, {capacity} needed")
        else:
            full_cache = model.new_cache(capacity, record_queries=method in ("triforce", "retrieval"))
        self.full = ModelState("full", model, full_cache, params)
        self.retrieval: ModelState | None = None
        self.streaming: ModelState | None = None
        self.draft_state: ModelState | None = None
        self.max_rollback = config.gamma * (config.gamma_draft + 1) + 8

        use_retrieval = method in ("triforce", "retrieval")
        if use_retrieval and prompt_len <= config.budget + config.chunk_size:
            self.notes.append(f"prompt ({prompt_len} tokens) fits in the retrieval budget ({config.budget}): "
                              f"the retrieval level would equal the full model, so it is skipped")
            use_retrieval = False
        if use_retrieval:
            c = model.cfg
            max_new = config.rebuild_every + 2 * self.max_rollback + 16
            cache = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, budget=config.budget,
                                   chunk_size=config.chunk_size, recent=config.recent, max_new=max_new,
                                   dtype=model.dtype, device=model.device)
            self.retrieval = ModelState("retrieval", drafting_model(model, config), cache, params)

        bottom = None
        if method == "ngram" or (method == "triforce" and config.draft == "ngram"):
            bottom = NGramDrafter(model.cfg.vocab_size, config.ngram, device=model.device)
        elif method == "streaming" or (method == "triforce" and config.draft in ("streaming", "model")):
            if method == "triforce" and config.draft == "model":
                drafter_model = self._check_draft_model(draft_model)
            else:
                drafter_model = drafting_model(model, config)
            c = drafter_model.cfg
            cache = StreamingCache(c.n_layers, c.n_kv_heads, c.head_dim, sink=config.sink, window=config.window,
                                   max_rollback=self.max_rollback, slack=max(config.prefill_chunk, config.window),
                                   dtype=drafter_model.dtype, device=drafter_model.device)
            self.streaming = ModelState("streaming", drafter_model, cache, params)
            bottom = ModelDrafter(self.streaming, generator)
        elif method == "draft":
            dm = self._check_draft_model(draft_model)
            self.draft_state = ModelState("draft", dm, dm.new_cache(capacity), params)
            bottom = ModelDrafter(self.draft_state, generator)

        if method == "ar" or (method == "retrieval" and self.retrieval is None):
            self.top = ModelDrafter(self.full, generator)
        elif method == "retrieval":
            self.top = Level("full", ModelDrafter(self.retrieval, generator), self.full, config.gamma, generator)
        elif method == "triforce" and self.retrieval is not None:
            middle = Level("retrieval", bottom, self.retrieval, config.gamma_draft, generator)
            self.top = Level("full", middle, self.full, config.gamma, generator)
        else:
            self.top = Level("full", bottom, self.full, config.gamma, generator)

    def _check_draft_model(self, dm: Transformer | None) -> Transformer:
        if dm is None:
            raise TriforceError("this method needs a draft model: pass --draft PATH (a small model that "
                                "shares the target's tokenizer)")
        if dm.cfg.vocab_size != self.model.cfg.vocab_size:
            raise TriforceError(f"the draft model's vocabulary ({dm.cfg.vocab_size}) differs from the target's "
                                f"({self.model.cfg.vocab_size}): it must share the target's tokenizer")
        return dm

    def prefill(self, prompt: list[int], progress: bool = False) -> None:
        """Every state reads the prompt but its last token (fed with the first draft); with a shared
        prefill, the full cache is just rolled back to it."""
        head = prompt[:-1]
        chunk = self.config.prefill_chunk
        if self.shared is not None:
            self.shared.restore(head)
            self.full.fed, self.full.stable = list(head), len(head)
        else:
            self.full.prefill(head, chunk, progress)
        if self.retrieval is not None:
            self._build_retrieval()
        if self.draft_state is not None:
            self.draft_state.prefill(head, chunk)
        if self.streaming is not None:
            self._prefill_streaming(head)

    def _prefill_streaming(self, head: list[int]) -> None:
        """Sinks plus the prompt's tail: the rest lies outside the window of every later token."""
        from ..generate import prefill

        st, cfg = self.streaming, self.config
        sink = min(cfg.sink, len(head))
        m = st.model
        if sink:
            prefill(m, st.cache, torch.tensor([head[:sink]], device=m.device), cfg.prefill_chunk)
        tail_from = max(sink, len(head) - cfg.window - self.max_rollback)
        if tail_from > st.cache.length:
            st.cache.skip_to(tail_from)
        if tail_from < len(head):
            prefill(m, st.cache, torch.tensor([head[tail_from:]], device=m.device), cfg.prefill_chunk)
        st.fed, st.stable = list(head), len(head)

    def _build_retrieval(self) -> None:
        t = time.perf_counter()
        self.retrieval.cache.build(self.full.cache)
        self.retrieval.fed = list(self.full.fed)
        self.retrieval.stable = len(self.full.fed)
        self.rebuilds += 1
        self.rebuild_seconds += time.perf_counter() - t

    def after_commit(self, seq: list[int], committed: int) -> None:
        """Rebuild policy of the retrieval cache, run between rounds."""
        if self.retrieval is None:
            return
        cache: RetrievalCache = self.retrieval.cache
        since = committed - cache.built_at
        room = cache.capacity - (cache.base + since)
        low = (self.config.rebuild_below > 0 and isinstance(self.top, Level) and len(self.top.recent) >= 4
               and sum(self.top.recent[-4:]) / 4 < self.config.rebuild_below and since >= 32)
        if since >= self.config.rebuild_every or room < 2 * self.max_rollback or low:
            self.full._sync(seq, committed)  # drop rejected drafts; keeps all but the newest token
            self._build_retrieval()

    def stats(self) -> dict:
        levels = []
        node = self.top
        while node is not None:
            levels.append(node.stats())
            node = getattr(node, "drafter", None)
        out = {"levels": levels, "config": asdict(self.config)}
        if self.retrieval is not None:
            out["retrieval_rebuilds"] = self.rebuilds
            out["retrieval_rebuild_seconds"] = round(self.rebuild_seconds, 4)
        if self.notes:
            out["notes"] = self.notes
        return out
