"""Level kinds: how each kind of level gets its model state, fills it from the prompt, and keeps
it up to date. Adding a kind means its grammar (stack.KIND_GRAMMAR: torch-free, the CLI checks stacks
before loading anything) and one class here, in KIND_CLASSES; importing this module checks the two agree.

Every kind but ngram gives a ModelState (a model with a KV cache): such a level can draft at the
bottom (ModelDrafter) or verify the level below. ngram has no model: it can only draft. The full
level's cache has the target's kv_dtype; the drafting levels' caches have config.draft_kv_dtype.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..caches import BufferPool, H2OCache, KVCache, RetrievalCache, SlidingWindowCache, StreamingCache, new_cache
from ..caches.base import Buildable, Rebuildable, Windowed, kv_dtype
from ..caches.quantized import QuantizedCache
from ..drafthead.drafter import HeadDrafter
from ..drafthead.loading import head_for
from ..errors import TriforceError
from ..execution.runner import DIRECT, ModelRunner
from ..loading.weights import draft_weights
from ..model import Transformer
from ..sampling import SamplingParams
from .drafters import Drafter, NGramDrafter
from .settings import SpecConfig
from .stack import KIND_GRAMMAR, LevelSpec
from .state import ModelState, prefill

_DRAFT_WEIGHTS: weakref.WeakKeyDictionary[Transformer, Transformer] = weakref.WeakKeyDictionary()


def draft_weights_model(model: Transformer) -> Transformer:
    """draft_weights(model), made once per model (it holds a bf16 copy of the weights)."""
    if model not in _DRAFT_WEIGHTS:
        _DRAFT_WEIGHTS[model] = draft_weights(model)
    return _DRAFT_WEIGHTS[model]


def drafting_model(model: Transformer, config: SpecConfig) -> Transformer:
    """The target as it runs when it drafts (retrieval and streaming levels): its bf16 draft-weights
    copy unless config.draft_weights is "fp32". Exactness does not depend on it: the full level
    verifies with the fp32 weights."""
    return draft_weights_model(model) if config.draft_weights == "bf16" else model


@dataclass
class BuildContext:
    """What the kinds need to build a level of one generation."""

    model: Transformer
    params: SamplingParams
    config: SpecConfig
    capacity: int  # tokens a full cache must hold: prompt + new tokens + a round's lookahead
    max_rollback: int  # tokens past the committed sequence a bounded cache must be able to drop
    draft_model: Transformer | None = None
    full_cache: object = None  # the full level's cache (given, e.g. prefilled, or made here)
    generator: torch.Generator | None = None  # the generation's (drafters that sample)
    pool: BufferPool | None = None  # where the drafting caches take their buffers (a server's), None: new ones
    runner: ModelRunner = DIRECT  # how the levels' forwards run (execution/runner.py)


class Kind:
    name = ""

    def state(self, build: BuildContext, spec: LevelSpec, name: str) -> ModelState | None:
        """The level's model state (None: a drafter without a model)."""
        raise NotImplementedError

    def drafter(self, build: BuildContext, spec: LevelSpec) -> Drafter:
        """A model-less bottom drafter (only kinds whose state() is None)."""
        raise NotImplementedError

    def connect_drafter(self, drafter: Drafter, above: list[ModelState]) -> None:
        """Connect the model-less bottom drafter to the model states above it (nearest first), before the first
        round; most need nothing."""

    def prefill(self, state: ModelState, head: list[int], full: ModelState, config: SpecConfig) -> None:
        state.prefill(head, config.prefill_chunk)

    def needs_queries(self) -> bool:
        """Whether the full cache must record queries (retrieval builds from them)."""
        return False

    def cache_tokens(self, config: SpecConfig, spec: LevelSpec, max_rollback: int, capacity: int) -> int:
        """The token slots of the level's own cache (config.draft_kv_dtype), as state() makes it for a generation
        whose full cache holds `capacity` tokens: what a server admits a request by (serving/engine.py
        request_bytes); 0 where the level has no cache of its own."""
        return 0


class Full(Kind):
    """The target with its full cache, in the model's kv_dtype (as `ar`'s: the output stays exact)."""

    name = "full"

    def state(self, build, spec, name):
        cache = build.full_cache if build.full_cache is not None else new_cache(build.model, build.capacity)
        return ModelState(name, build.model, cache, build.params, build.runner)


class NGram(Kind):
    name = "ngram"

    def state(self, build, spec, name):
        return None

    def drafter(self, build, spec):
        return NGramDrafter(build.model.cfg.vocab_size, build.config.ngram, device=build.model.device)


class Draft(Kind):
    """A small model sharing the target's tokenizer, with a full cache of its own (config.draft_kv_dtype)."""

    name = "draft"

    def state(self, build, spec, name):
        dm = build.draft_model
        if dm is None:
            raise TriforceError("a 'draft' level needs a draft model: pass --draft PATH (a small model that "
                                "shares the target's tokenizer)")
        if dm.cfg.vocab_size != build.model.cfg.vocab_size:
            raise TriforceError(f"the draft model's vocabulary ({dm.cfg.vocab_size}) differs from the target's "
                                f"({build.model.cfg.vocab_size}): it must share the target's tokenizer")
        return ModelState(name, dm, new_cache(dm, build.capacity, dtype=build.config.draft_kv_dtype), build.params,
                          build.runner)

    def cache_tokens(self, config, spec, max_rollback, capacity):
        return capacity  # (over the draft model's layers)


class Streaming(Kind):
    """The target (draft weights) with a StreamingLLM cache (config.draft_kv_dtype): `sink` tokens + a
    window of budget - sink."""

    name = "streaming"

    def state(self, build, spec, name):
        cfg = build.config
        m = drafting_model(build.model, cfg)
        settings = self._settings(cfg, spec, build.max_rollback)
        cache = drafting_cache(m, cfg, lambda n_layers, **kw: StreamingCache(n_layers, **settings, **kw))
        return ModelState(name, m, cache, build.params, build.runner)

    @staticmethod
    def _settings(config: SpecConfig, spec: LevelSpec, max_rollback: int) -> dict:
        window = (spec.budget or config.streaming_budget) - config.sink
        return dict(sink=config.sink, window=window, max_rollback=max_rollback,
                    slack=max(config.prefill_chunk, window))

    def cache_tokens(self, config, spec, max_rollback, capacity):
        return StreamingCache.slots(**self._settings(config, spec, max_rollback))

    def prefill(self, state, head, full, config):
        """Sinks plus the prompt's tail: the rest lies outside the window of every later token."""
        cache: Windowed = state.cache
        m = state.model
        sink = min(config.sink, len(head))
        if sink:
            prefill(m, cache, torch.tensor([head[:sink]], device=m.device), config.prefill_chunk,
                    runner=state.runner)
        tail_from = max(sink, len(head) - cache.tail_needed())
        if tail_from > cache.length:
            cache.skip_to(tail_from)
        if tail_from < len(head):
            prefill(m, cache, torch.tensor([head[tail_from:]], device=m.device), config.prefill_chunk,
                    runner=state.runner)
        state.fed, state.stable = list(head), len(head)


class Retrieval(Kind):
    """The target (draft weights) with a TriForce retrieval cache (config.draft_kv_dtype), built from the
    full cache (whose keys are cast when gathered) and rebuilt by the rebuild policy (rebuild.RebuildPolicy)."""

    name = "retrieval"

    def state(self, build, spec, name):
        cfg, m = build.config, drafting_model(build.model, build.config)
        cache = drafting_cache(m, cfg, lambda n_layers, **kw: self.new_cache(
            n_layers, budget=spec.budget or cfg.budget, recent=cfg.recent,
            max_new=self._appended(cfg, build.max_rollback), model=m, config=cfg, pool=build.pool, **kw))
        return ModelState(name, m, cache, build.params, build.runner)

    @staticmethod
    def _appended(config: SpecConfig, max_rollback: int) -> int:
        """Slots for the tokens appended between builds (a rebuild comes before they run out)."""
        return config.rebuild_every + 2 * max_rollback + 16

    def cache_tokens(self, config, spec, max_rollback, capacity):
        return (spec.budget or config.budget) + self._appended(config, max_rollback)

    def new_cache(self, n_layers, *, model, config, **kw) -> RetrievalCache:
        """The level's cache over n_layers layers (budget, recent, max_new and the drafting_cache arguments)."""
        return RetrievalCache(n_layers, chunk_size=config.chunk_size, **kw)

    def prefill(self, state, head, full, config):
        rebuild(state, full)

    def needs_queries(self) -> bool:
        return True


class H2O(Retrieval):
    """The target (draft weights) with an H2O cache (caches/h2o.py: per layer and KV head the positions the
    last recorded queries attended to most, plus the recent window), built and rebuilt as a retrieval cache."""

    name = "h2o"

    def new_cache(self, n_layers, *, model, config, **kw) -> H2OCache:
        return H2OCache(n_layers, scale=model.cfg.attention_scale, **kw)


class KV4(Kind):
    """QuantSpec's draft: the target (draft weights) reading its KV cache at 4 bits, the upper planes of the
    hierarchical INT8 layout (caches/quantized.py), with the newest tokens in full precision
    (config.draft_kv_dtype for its buffer). Over an int8 target: the target's own planes, shared (no second
    cache). Over a float target: a cache of its own holding the upper plane only, started as the quantization
    of the target's prompt cache (no prefill of its own). Either way the level's buffer is kept in step by
    feeding the level's tokens, as any level's cache is."""

    name = "kv4"

    def state(self, build, spec, name):
        cfg, m = build.config, drafting_model(build.model, build.config)
        shared = build.full_cache if isinstance(build.full_cache, QuantizedCache) else None
        cache = drafting_cache(m, cfg, lambda n_layers, **kw: QuantizedCache(
            n_layers, capacity=build.capacity, bits=4, max_rollback=build.max_rollback, shared=shared, **kw))
        return ModelState(name, m, cache, build.params, build.runner)

    def prefill(self, state, head, full, config):
        cache: Buildable = state.cache  # a 4-bit reading of the full cache
        cache.build(full.cache)
        state.fed, state.stable = list(full.fed), len(full.fed)


class Head(Kind):
    """A trained draft head (drafthead/: EAGLE's design) reading the features of the levels above: --head DIR,
    or the head that ships for the embedded model. Model-less from the stack's view (no ModelState)."""

    name = "head"

    def state(self, build, spec, name):
        return None

    def drafter(self, build, spec):
        head = head_for(build.model, build.config.head)
        return HeadDrafter(head, build.model, build.params, build.generator, build.max_rollback,
                           kv_dtype(build.config.draft_kv_dtype))

    def connect_drafter(self, drafter, above):
        """The head drafts from the features the levels above compute: each records them from now on."""
        drafter.read_features_of(above)


def drafting_cache(model: Transformer, config: SpecConfig, make) -> KVCache:
    """A drafting level's cache (config.draft_kv_dtype): make(n_layers, n_kv_heads=, head_dim=, dtype=,
    device=) over every layer, or, for a model with sliding-window layers (Gemma 3), over its global
    layers only, inside a SlidingWindowCache whose ring gives the sliding-window layers exactly the
    target's window (the long-range context, which the drafting caches cut, lives in the global layers)."""
    c, dtype = model.cfg, kv_dtype(config.draft_kv_dtype)
    kw = dict(n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype=dtype, device=model.device)
    if model.windows is None:
        return make(c.n_layers, **kw)
    n_global = sum(w is None for w in model.windows)
    return SlidingWindowCache(model.windows, c.n_kv_heads, c.head_dim, global_cache=make(n_global, **kw),
                              dtype=dtype, device=model.device)


def rebuild(state: ModelState, full: ModelState) -> None:
    """(Re)build a retrieval or H2O level's cache from the full level's cache and its recorded queries."""
    cache: Rebuildable = state.cache
    state.runner.exclusive(lambda: cache.build(full.cache))
    state.fed = list(full.fed)
    state.stable = len(full.fed)


KIND_CLASSES: dict[str, Kind] = {k.name: k for k in (Full(), NGram(), Draft(), Streaming(), Retrieval(), H2O(), KV4(),
                                                     Head())}
if set(KIND_CLASSES) != set(KIND_GRAMMAR):  # a kind the grammar accepts and nothing builds, or the reverse
    raise ImportError(f"speculation kinds out of step: classes for {sorted(KIND_CLASSES)}, grammar for "
                      f"{sorted(KIND_GRAMMAR)}")
