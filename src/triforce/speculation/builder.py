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
from .drafters import ModelDrafter
from .kinds import KINDS, BuildContext
from .level import Level
from .planner import AdaptiveTop, Route
from .provenance import RoundLog, RoundProvenance, drafted_by
from .rebuild import RebuildPolicy
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
    level, or for an adaptive stack (StackSpec.adaptive) a planner.AdaptiveTop choosing each round's route through
    the levels (`force_route`: a function of the round index giving the route to run, or None to let the planner
    choose; for tests). `runner`: how the levels' forwards run (execution/runner.py; a server's batches them)."""

    def __init__(self, stack: StackSpec, model: Transformer, params: SamplingParams, config: SpecConfig,
                 generator: torch.Generator, prompt_len: int, max_new_tokens: int,
                 draft_model: Transformer | None = None, prefilled: PrefilledPrompt | None = None,
                 force_route=None, runner: ModelRunner = DIRECT):
        config.validate()
        stack.check()
        stack.check_budgets(model.cfg.max_context, {"retrieval": config.budget, "h2o": config.budget,
                                                     "streaming": config.streaming_budget},
                            config.sink + MIN_STREAMING_WINDOW)
        self.model, self.params, self.config, self.generator = model, params, config, generator
        self.notes: list[str] = []
        self.round_log = RoundLog()  # every level's verifications of the round in progress (provenance)
        self.stack = self._useful(stack, prompt_len)
        if model.windows is not None and self.stack.tree:
            raise TriforceError(f"draft trees (--tree, the sequoia method) are not supported yet for models with "
                                f"sliding-window layers such as this {model.cfg.arch} model: use chain stacks")
        if model.windows is not None and max_rollback(self.stack) > DEFAULT_EXTRA:
            raise TriforceError(f"the stack {self.stack.levels_text} with --gammas {','.join(map(str, self.stack.gammas))} "
                                f"may roll back {max_rollback(self.stack)} tokens, more than the sliding-window "
                                f"layers' ring of this {model.cfg.arch} model keeps ({DEFAULT_EXTRA}): use smaller gammas")
        capacity = full_capacity(prompt_len, max_new_tokens, self.stack)
        self.prefilled = prefilled
        full_cache = None
        if prefilled is not None:
            if prefilled.model is not model:
                raise ValueError("the prefilled prompt was made with another model")
            full_cache = prefilled.cache
            if full_cache.capacity < capacity:
                raise ValueError(f"the prefilled prompt's cache holds {full_cache.capacity} tokens, {capacity} needed")
        else:  # made here, before the levels: a kv4 level reads an int8 target's planes
            full_cache = new_cache(model, capacity, record_queries=any(KINDS[lvl.kind].needs_queries()
                                                                        for lvl in self.stack.levels))
        # the drafting caches take their buffers from where the full cache's came from (a server's pool)
        build = BuildContext(model, params, config, capacity, max_rollback(self.stack), draft_model, full_cache,
                             generator, getattr(full_cache, "pool", None), runner)

        # level names in the stats: the kind, or kind:budget where the stack names a budget
        self.states: list[ModelState | None] = [KINDS[lvl.kind].state(build, lvl, str(lvl)) for lvl in self.stack.levels]
        self.full = self.states[-1]
        self.rebuild_policy = RebuildPolicy(self.stack, self.states, config, max_rollback(self.stack))
        bottom_spec, bottom_state = self.stack.levels[0], self.states[0]
        proposer = (ModelDrafter(bottom_state, generator) if bottom_state is not None
                    else KINDS[bottom_spec.kind].drafter(build, bottom_spec))
        if hasattr(proposer, "sources"):  # a draft head reads the features of the levels above, nearest first
            proposer.sources = [s for s in self.states[1:] if s is not None]
            for s in proposer.sources:
                s.record_features(getattr(proposer, "feature_layers", None))
        self.adaptive = None
        if self.stack.adaptive and len(self.stack.levels) > 1 and not self.stack.tree:
            if model.device.type == "cpu":
                names = [s.name if s is not None else lvl.kind for s, lvl in zip(self.states, self.stack.levels)]
                kinds = [lvl.kind for lvl in self.stack.levels]
                n = len(kinds) - 1
                start = Route(tuple(range(n + 1)), self.stack.gammas)
                self.adaptive = AdaptiveTop(kinds, names, self.states,
                                            proposer if bottom_state is None else None, start, generator,
                                            self.rebuild_policy.catch_up, self.rebuild_policy.catch_up_ms,
                                            force=force_route, sampled=not params.greedy, log=self.round_log)
                self.top = self.adaptive
                return
            self.notes.append("the adaptive planner times forwards on the CPU only: the stack runs as given here")
        tree = fixed_tree(self.stack.tree) if self.stack.tree else None  # drafted by the bottom level only
        # the top level's n-gram shortcut past the levels between (shortcut.NGramShortcut); below a draft head, an
        # n-gram drafter of its own: repeated text is then verified directly, new text drafted by the head
        shortcut = None
        if config.ngram_shortcut > 0 and bottom_spec.kind == "ngram" and len(self.stack.levels) > 2:
            shortcut = NGramShortcut(proposer, config.ngram_shortcut)
        elif config.ngram_shortcut > 0 and bottom_spec.kind == "head":
            shortcut = NGramShortcut(KINDS["ngram"].drafter(build, bottom_spec), config.ngram_shortcut)
        for i, (state, gamma) in enumerate(zip(self.states[1:], self.stack.gammas), start=2):
            top = i == len(self.stack.levels)
            proposer = Level(state.name, proposer, state, gamma, generator, tree=tree,
                             shortcut=shortcut if top else None, log=self.round_log)
            tree = None
        self.top = proposer

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
        the stack as given, and build it). With 8 requests at 8K arriving together, the builds here put their
        first tokens 0.4-1.2 s later (docs/serving.md)."""
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
            KINDS[lvl.kind].prefill(state, head, self.full, self.config)
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
        return RoundProvenance(tokens, levels, list(getattr(top, "rejected", ())), bonus, self.round_log.take(),
                               getattr(top, "route_text", None), texts)

    def stats(self) -> dict:
        if self.adaptive is not None:
            levels = self.adaptive.level_stats()
        else:
            levels = []
            node = self.top
            while node is not None:
                levels.append(node.stats())
                node = getattr(node, "drafter", None)
        out = {"stack": self.stack.levels_text, "gammas": list(self.stack.gammas), "levels": levels,
               "config": asdict(self.config)}
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.stats()
        out.update(self.rebuild_policy.stats())
        if self.notes:
            out["notes"] = self.notes
        return out

