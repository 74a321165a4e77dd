"""Routes through an adaptive stack, and their prices from what the run has measured.

A stack's levels are built once (builder.BuiltStack). A route is the sub-stack one round runs: some of the levels
below the top, in order, and the top, with a gamma per boundary; a route *family* is its levels without the gammas.
For the default stack ngram -> retrieval -> full the families are

    full                       plain decoding (`ar`): one forward of one token
    ngram,full                 prompt lookup verified directly
    retrieval,full             the retrieval level drafting by itself
    ngram,retrieval,full       the whole stack

Any route gives exactly the target's output: the top level verifies whatever is drafted.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Callable

from .cost_model import Boundary, chain_ms, cheapest_chain, round_terms
from .measurements import MAX_GAMMA_NGRAM, Measurements

MAX_GAMMA_TOP = 6  # gammas considered at the top boundary (n-gram lookup: MAX_GAMMA_NGRAM)
MAX_GAMMA_BELOW = 4  # ... and at the boundaries below

Curves = dict[int, Callable[[float], float] | None]  # level index -> its forward cost curve (LevelCosts.curve)


@dataclass(frozen=True)
class Route:
    """levels: indices into the stack's levels, bottom to top, ending with the top; gammas: one per boundary."""

    levels: tuple[int, ...]
    gammas: tuple[int, ...]

    def text(self, names: list[str]) -> str:
        out = ",".join(names[i] for i in self.levels)
        return out + (f"@{','.join(map(str, self.gammas))}" if self.gammas else "")


def route_families(kinds: list[str]) -> list[tuple[int, ...]]:
    """Every sub-stack: any levels below the top, in order (n-gram lookup only at the bottom), then the top."""
    top = len(kinds) - 1
    below = range(top)
    out = []
    for r in range(len(below) + 1):
        for c in combinations(below, r):
            if all(kinds[i] != "ngram" or i == c[0] for i in c):
                out.append(c + (top,))
    return out


class RoutePricer:
    """Prices route families with cost_model's arithmetic, from a run's measurements: a round costs its forwards
    (each level's cost curve, each boundary's yield) plus what the family's rounds measured beyond them."""

    def __init__(self, kinds: list[str], measured: Measurements):
        self.kinds, self.measured = kinds, measured
        self.top = len(kinds) - 1

    def max_gamma(self, below: int, above: int) -> int:
        if above != self.top:
            return MAX_GAMMA_BELOW
        return MAX_GAMMA_NGRAM if self.kinds[below] == "ngram" else MAX_GAMMA_TOP

    def _gamma_grids(self, family: tuple[int, ...]) -> list[range]:
        """The gammas considered at each boundary of the family, bottom first."""
        return [range(1, self.max_gamma(below, above) + 1) for below, above in zip(family, family[1:])]

    def _steps(self, family: tuple[int, ...], curves: Curves, optimistic: bool, ngram: Boundary | None):
        """-> (ms of a bottom draft, [(cost curve of the level above, its boundary) per boundary, bottom first]),
        or None while something the family needs is unmeasured (see price)."""
        bottom = family[0]
        if self.kinds[bottom] == "ngram":
            bottom_ms = 0.0
        elif curves.get(bottom) is None:
            return None
        else:
            bottom_ms = curves[bottom](1)
        steps = []
        for below, above in zip(family, family[1:]):
            if optimistic and self.kinds[below] != "ngram":
                b = Boundary.iid(1.0)
            elif optimistic:  # a model level takes n-gram drafts about as the full level does
                b = ngram or Boundary.iid(1.0)
            else:
                b = self.measured.boundary(below, above, ngram)
            if b is None or curves.get(above) is None:
                return None
            steps.append((curves[above], b))
        return bottom_ms, steps

    def modelled(self, route: Route, curves: Curves, ngram: Boundary | None) -> tuple[float, float] | None:
        """The route's (ms/token by its forwards alone, tokens per round at the top), None while unpriceable."""
        found = self._steps(route.levels, curves, False, ngram)
        if found is None:
            return None
        bottom_ms, steps = found
        if not steps:
            return bottom_ms, 1.0
        rounds = [round_terms(cost, b, g) for (cost, b), g in zip(steps, route.gammas)]
        return chain_ms(bottom_ms, rounds), rounds[-1][2]

    def price(self, family: tuple[int, ...], curves: Curves, ngram: Boundary | None,
              optimistic: bool = False) -> tuple[float, Route] | None:
        """The family's cheapest gammas and their predicted ms/token; None while something it needs is unmeasured.
        `ngram`: the n-gram window's boundary the price is for (all rounds', or one match class's). `optimistic`: its
        best case, every draft of a model level accepted, n-gram drafts taken as the full level takes them, nothing
        beyond its forwards (a bound: whether a probe could win)."""
        found = self._steps(family, curves, optimistic, ngram)
        if found is None:
            return None
        bottom_ms, steps = found
        extra = self.measured.extra_ms(family, optimistic)
        if not steps:  # plain decoding
            return bottom_ms + extra, Route(family, ())
        tables = [[round_terms(cost, b, g) for g in grid] for (cost, b), grid in zip(steps, self._gamma_grids(family))]
        ms, combo = cheapest_chain(bottom_ms, tables, extra)
        return ms, Route(family, tuple(g for g, _, _ in combo))
