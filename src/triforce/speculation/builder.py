"""From a stack spec to running levels: the one builder, and the prefill of every level.

The stack is built bottom-up: the bottom level drafts (an n-gram drafter, or a model state drafting
autoregressively); every level above verifies the one below with its own model state and is, in
turn, the drafter of the next (level.Level). The top level is always `full`.
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from ..caches import new_cache
from ..caches.sliding import DEFAULT_EXTRA
from ..errors import TriforceError
from ..execution.runner import DIRECT, ModelRunner
from ..model import Transformer
from ..sampling import SamplingParams
from .adaptive import AdaptiveTop
from .drafters import Drafter, ModelDrafter
from .kinds import KIND_CLASSES, BuildContext
from .level import Level, chain_of
from .provenance import RoundLog, RoundProvenance, drafted_by
from .rebuild import RebuildPolicy
from .routes import Route
from .settings import SpecConfig
from .shortcut import NGramShortcut
from .stack import REBUILT, ROLLBACK_SLACK, StackSpec
from .state import ModelState, PrefilledPrompt
from .tree import fixed_tree

MIN_STREAMING_WINDOW = 1  # a streaming level's budget must hold the sinks and a window of at least this


def full_capacity(prompt_len: int, max_new_tokens: int, stack: StackSpec) -> int:
    """Tokens the full cache must hold for one generation with `stack`."""
    return prompt_len + max_new_tokens + stack.lookahead()


def max_rollback(stack: StackSpec) -> int:
    """Tokens past the committed sequence that a bounded cache (streaming, retrieval) may be asked
    to drop: a top round of gamma tokens, each made by rounds of the levels below."""
    below = max(stack.gammas[:-1], default=1)
    return max(stack.top_gamma * (below + 1), stack.tree_nodes + len(stack.tree)) + ROLLBACK_SLACK


class BuiltStack:
    """A stack spec's levels built for one generation: prefill() them, then each round `top.step()` makes the
    round's tokens and after_commit() runs the rebuild policy (rebuild.RebuildPolicy). `top` is the stack's top
    level, or for an adaptive stack (StackSpec.adaptive) an adaptive.AdaptiveTop choosing each round's route through
    the levels (`force_route`: a function of the round index giving the route to run, or None to let the planner
    choose; for tests). `runner`: how the levels' forwards run (execution/runner.py; a server's batches them)."""

    def __init__(self, stack: StackSpec, model: Transformer, params: SamplingParams, config: SpecConfig,
                 generator: torch.Generator, prompt_len: int, max_new_tokens: int,
                 draft_model: Transformer | None = None, prefilled: PrefilledPrompt | None = None,
                 force_route=None, runner: ModelRunner = DIRECT):
        self.model, self.params, self.config, self.generator = model, params, config, generator
        self.notes: list[str] = []
        self.round_log = RoundLog()  # every level's verifications of the round in progress (provenance)
        self.prefilled = prefilled
        self.stack = self._runnable(stack, prompt_len)
        build = self._build_context(full_capacity(prompt_len, max_new_tokens, self.stack), draft_model, runner)
        # level names in the stats: the kind, or kind:budget where the stack names a budget
        self.states: list[ModelState | None] = [KIND_CLASSES[lvl.kind].state(build, lvl, str(lvl))
                                                for lvl in self.stack.levels]
        self.full = self.states[-1]
        self.rebuild_policy = RebuildPolicy(self.stack, self.states, config, max_rollback(self.stack))
        bottom = self._bottom_drafter(build)
        self.adaptive = self._adaptive_top(bottom, force_route)
        self.top: Level | Drafter | AdaptiveTop = (self.adaptive if self.adaptive is not None
                                                   else self._fixed_stack(bottom, build))

    def _runnable(self, stack: StackSpec, prompt_len: int) -> StackSpec:
        """The stack checked against the settings and the model, without the levels that would equal the full
        model for this prompt (_useful)."""
        model, config = self.model, self.config
        config.validate()
        stack.check()
        stack.check_budgets(model.cfg.max_context, {"retrieval": config.budget, "h2o": config.budget,
                                                     "streaming": config.streaming_budget},
                            config.sink + MIN_STREAMING_WINDOW)
        stack = self._useful(stack, prompt_len)
        if model.windows is not None and stack.tree:
            raise TriforceError(f"draft trees (--tree, the sequoia method) are not supported yet for models with "
                                f"sliding-window layers such as this {model.cfg.arch} model: use chain stacks")
        if model.windows is not None and max_rollback(stack) > DEFAULT_EXTRA:
            raise TriforceError(f"the stack {stack.levels_text} with --gammas {','.join(map(str, stack.gammas))} "
                                f"may roll back {max_rollback(stack)} tokens, more than the sliding-window "
                                f"layers' ring of this {model.cfg.arch} model keeps ({DEFAULT_EXTRA}): use smaller "
                                f"gammas")
        return stack

    def _build_context(self, capacity: int, draft_model: Transformer | None, runner: ModelRunner) -> BuildContext:
        """What the kinds build the levels from, with the full level's cache: the prefilled prompt's, or a new one,
        made before the levels since a kv4 level reads an int8 target's planes."""
        model, prefilled = self.model, self.prefilled
        if prefilled is not None:
            if prefilled.model is not model:
                raise ValueError("the prefilled prompt was made with another model")
            full_cache = prefilled.cache
            if full_cache.capacity < capacity:
                raise ValueError(f"the prefilled prompt's cache holds {full_cache.capacity} tokens, {capacity} needed")
        else:
            full_cache = new_cache(model, capacity, record_queries=any(KIND_CLASSES[lvl.kind].needs_queries()
                                                                        for lvl in self.stack.levels))
        # the drafting caches take their buffers from where the full cache's came from (a server's pool)
        return BuildContext(model, self.params, self.config, capacity, max_rollback(self.stack), draft_model,
                            full_cache, self.generator, getattr(full_cache, "pool", None), runner)

    def _bottom_drafter(self, build: BuildContext) -> Drafter:
        """The bottom level as a drafter: its model state drafting autoregressively, or its kind's model-less
        drafter, connected to the states above it (a draft head reads their features)."""
        spec, state = self.stack.levels[0], self.states[0]
        if state is not None:
            return ModelDrafter(state, self.generator)
        kind = KIND_CLASSES[spec.kind]
        drafter = kind.drafter(build, spec)
        kind.connect_drafter(drafter, [s for s in self.states[1:] if s is not None])
        return drafter

    def _adaptive_top(self, bottom: Drafter, force_route) -> AdaptiveTop | None:
        """For an adaptive chain stack of two levels or more on the CPU, the planner's top; else None (noted where
        the device is the reason)."""
        if not (self.stack.adaptive and len(self.stack.levels) > 1 and not self.stack.tree):
            return None
        if self.model.device.type != "cpu":
            self.notes.append("the adaptive planner times forwards on the CPU only: the stack runs as given here")
            return None
        levels = self.stack.levels
        names = [s.name if s is not None else lvl.kind for s, lvl in zip(self.states, levels)]
        start = Route(tuple(range(len(levels))), self.stack.gammas)
        return AdaptiveTop([lvl.kind for lvl in levels], names, self.states,
                           bottom if self.states[0] is None else None, start, self.generator,
                           self.rebuild_policy.catch_up, self.rebuild_policy.catch_up_ms, force=force_route,
                           sampled=not self.params.greedy, log=self.round_log)

    def _fixed_stack(self, bottom: Drafter, build: BuildContext) -> Level | Drafter:
        """The levels as given, bottom-up, each verifying the one below: its top (the bottom drafter alone for
        `full` alone). A tree is drafted by the bottom level only. The top level's n-gram shortcut past the
        levels between (shortcut.NGramShortcut) uses the bottom n-gram drafter, or, below a draft head, one of its
        own: repeated text is then verified directly, new text drafted by the head."""
        config, bottom_kind = self.config, self.stack.levels[0].kind
        tree = fixed_tree(self.stack.tree) if self.stack.tree else None
        shortcut = None
        if config.ngram_shortcut > 0 and bottom_kind == "ngram" and len(self.stack.levels) > 2:
            shortcut = NGramShortcut(bottom, config.ngram_shortcut)
        elif config.ngram_shortcut > 0 and bottom_kind == "head":
            shortcut = NGramShortcut(KIND_CLASSES["ngram"].drafter(build, self.stack.levels[0]), config.ngram_shortcut)
        node = bottom
        for i, (state, gamma) in enumerate(zip(self.states[1:], self.stack.gammas), start=2):
            top = i == len(self.stack.levels)
            node = Level(state.name, node, state, gamma, self.generator, tree=tree,
                         shortcut=shortcut if top else None, log=self.round_log)
            tree = None
        return node

    def _useful(self, stack: StackSpec, prompt_len: int) -> StackSpec:
        """Drop retrieval and H2O levels whose budget holds the whole prompt: they would equal the full
        model at a retrieval level's overhead (noted in the stats)."""
        i = 0
        while i < len(stack.levels) - 1:
            lvl = stack.levels[i]
            budget = lvl.budget or self.config.budget
            if lvl.kind in REBUILT and prompt_len <= budget + self.config.chunk_size:
                self.notes.append(f"prompt ({prompt_len} tokens) fits in the {lvl.kind} budget ({budget}): "
                                  f"the {lvl} level would equal the full model, so it is skipped")
                stack = stack.without(i)
            else:
                i += 1
        return stack

    def prefill(self, prompt: list[int], progress: bool = False) -> None:
        """Every state reads the prompt but its last token (fed with the first draft); with a
        prefilled prompt, the full cache is just rolled back to it. In an adaptive stack a retrieval or H2O
        level is built when a route first runs it (RebuildPolicy.catch_up: a level never built is behind), not
        here: the first round is a plain step, so the first token does not wait for a build (the next rounds run
        the stack as given, and build it); requests arriving together would otherwise wait for each other's builds
        (docs/serving.md)."""
        head = prompt[:-1]
        if self.prefilled is not None:
            self.prefilled.restore(prompt)
            self.full.fed, self.full.stable = list(head), len(head)
            if (self.full.features is not None and self.prefilled.features is not None
                    and self.full.feature_layers is None):  # (a prefilled prompt keeps final-norm features only)
                self.full._store_features(len(head) - len(self.prefilled.features), self.prefilled.features)
        else:
            self.full.prefill(head, self.config.prefill_chunk, progress)
        for lvl, state in zip(self.stack.levels[:-1], self.states[:-1]):
            if state is None or (self.adaptive is not None and lvl.kind in REBUILT):
                continue
            t = state.runner.own_clock()  # (its own time, not a wait for others' forwards: RebuildPolicy.catch_up_ms)
            KIND_CLASSES[lvl.kind].prefill(state, head, self.full, self.config)
            if lvl.kind in REBUILT:
                self.rebuild_policy.count(state.runner.own_clock() - t)

    def release(self) -> None:
        """Done with the generation: every level's cache gives its buffers back to the pool they came from (a
        server's; KVCache.release). The levels are unusable after this."""
        for state in self.states:
            if state is not None:
                state.cache.release()

    def after_commit(self, seq: list[int], committed: int) -> None:
        """Between rounds: the rebuild policy over the levels in use."""
        in_use = self.adaptive.levels_in_use if self.adaptive is not None else range(len(self.states))
        self.rebuild_policy.after_commit(seq, committed, in_use, self.top)

    def provenance(self, tokens: list[int], texts: list[str] | None = None) -> RoundProvenance:
        """The last round's provenance (provenance.py), for the `tokens` the generation committed of it (the top's
        step may return tokens past an EOS or a stop string, which are dropped)."""
        top = self.top
        levels = drafted_by(top, len(tokens))
        bonus = tokens[-1] if tokens and levels[-1] == self.full.name else None
        rejected = top.rejected if isinstance(top, (Level, AdaptiveTop)) else []
        route = top.route_text if isinstance(top, AdaptiveTop) else None
        return RoundProvenance(tokens, levels, list(rejected), bonus, self.round_log.take(), route, texts)

    def stats(self) -> dict:
        if self.adaptive is not None:
            levels = self.adaptive.level_stats()
        else:
            levels = [node.stats() for node in chain_of(self.top)]
        out = {"stack": self.stack.levels_text, "gammas": list(self.stack.gammas), "levels": levels,
               "config": asdict(self.config)}
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.stats()
        out.update(self.rebuild_policy.stats())
        if self.notes:
            out["notes"] = self.notes
        return out

