"""When a built stack's retrieval and H2O levels are rebuilt from the full cache.

Such a level's cache is a selection from the full cache made with one token's query (caches/retrieval.py,
caches/h2o.py); the tokens generated since are appended to it. It is made again:
- after `rebuild_every` new tokens, so the selection follows what the text now attends to;
- when its cache runs out of room for another round's rollback;
- when the top level's recent acceptance falls below `rebuild_below` (0: never);
- in an adaptive stack, before a level runs for the first time (it is not built at the prefill), and before a
  level that sat out CATCH_UP or more committed tokens runs again: re-feeding it everything it missed would cost a
  long forward (catch_up; catch_up_ms is what that would cost, for the planner).
"""
from __future__ import annotations

from ..caches.base import Rebuildable
from .kinds import rebuild
from .level import Level
from .settings import SpecConfig
from .stack import REBUILT, StackSpec
from .state import ModelState

CATCH_UP = 32  # an adaptive stack's level that sat out this many committed tokens is rebuilt, not re-fed


class RebuildPolicy:
    def __init__(self, stack: StackSpec, states: list[ModelState | None], config: SpecConfig, max_rollback: int):
        self.stack, self.states, self.config = stack, states, config
        self.full = states[-1]
        self.room_needed = 2 * max_rollback  # a cache with less room left is rebuilt
        self.rebuilds = 0
        self.seconds = 0.0

    def count(self, seconds: float) -> None:
        """A build made outside the policy (a level's prefill builds its cache the same way)."""
        self.rebuilds += 1
        self.seconds += seconds

    def after_commit(self, seq: list[int], committed: int, in_use, top) -> None:
        """Between rounds: rebuild the levels in `in_use` (indices) that are due. `top`: the stack's top (a Level
        has the recent acceptance that rebuild_below reads)."""
        for i, (lvl, state) in enumerate(zip(self.stack.levels, self.states)):
            if lvl.kind not in REBUILT or i not in in_use:  # a level sitting out is caught up when it runs again
                continue
            cache: Rebuildable = state.cache
            since = committed - cache.built_at
            low = (self.config.rebuild_below > 0 and isinstance(top, Level) and len(top.recent) >= 4
                   and sum(top.recent[-4:]) / 4 < self.config.rebuild_below and since >= 32)
            if since >= self.config.rebuild_every or cache.room(committed) < self.room_needed or low:
                self.rebuild(state, seq, committed)

    def catch_up(self, i: int, seq: list[int], committed: int) -> None:
        """Before level i of an adaptive stack runs again: rebuilt if it is a retrieval or H2O level that sat out
        CATCH_UP or more committed tokens, or whose cache has too little room left."""
        if self._behind(i, committed):
            self.rebuild(self.states[i], seq, committed)

    def catch_up_ms(self, i: int, committed: int) -> float:
        """What catch_up(i, ..., committed) would cost now: the mean of this run's rebuilds (its first, at the
        prefill, included), or 0 when level i needs none."""
        if not self._behind(i, committed) or self.rebuilds == 0:
            return 0.0
        return 1e3 * self.seconds / self.rebuilds

    def _behind(self, i: int, committed: int) -> bool:
        state = self.states[i]
        if self.stack.levels[i].kind not in REBUILT:
            return False
        cache: Rebuildable = state.cache
        return (not state.fed or committed - state.stable >= CATCH_UP  # (never built: BuiltStack.prefill)
                or cache.room(committed) < self.room_needed)

    def rebuild(self, state: ModelState, seq: list[int], committed: int) -> None:
        """Rebuild a retrieval or H2O level's cache from the full cache, counted in the stats."""
        clock = state.runner.own_clock  # (its own time, not a wait for other requests' forwards)
        t = clock()
        self.full._sync(seq, committed)  # drop rejected drafts (a no-op when synced already); keeps all but the newest
        rebuild(state, self.full)
        self.count(clock() - t)

    def stats(self) -> dict:
        if not any(lvl.kind in REBUILT for lvl in self.stack.levels):
            return {}
        return {"retrieval_rebuilds": self.rebuilds, "retrieval_rebuild_seconds": round(self.seconds, 4)}
