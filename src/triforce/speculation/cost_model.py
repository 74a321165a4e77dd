"""The cost model of a speculation stack: predicted ms per generated token from each level's forward cost and
each boundary's acceptance. `triforce tune` prices its grid with it before a run; the adaptive planner
(routes.py) re-prices its candidate routes with it while a run goes on. One model, two users.

Terms:
- a *round* at level i: the level below drafts gamma tokens, level i scores them in one forward of
  1 + drafted tokens (the context's last token, then the drafts), accepts a prefix and adds one token of its
  own (the residual sample or the bonus token);
- *tokens per round*: accepted + 1; with each draft accepted with probability a, independently (the i.i.d.
  model of speculative decoding), (1 - a^(gamma + 1)) / (1 - a);
- a level's *ms per token*: what one of its output tokens costs, drafting below included. The bottom level
  drafts autoregressively (one forward per token) or, for n-gram lookup, for free.

Worked example (the default stack, ngram -> retrieval -> full, gammas 3, 4): a retrieval forward of 4 tokens
costs 6 ms and its rounds yield 1.5 tokens (n-gram drafts mostly rejected): 4 ms per retrieval token. A full
verification of 5 tokens costs 25 ms; the full level accepts 0.8 per draft: 3.36 tokens per round. One round
costs 25 + 4 x 4 = 41 ms: 12.2 ms per token, against an `ar` step of 20 ms: 1.64x.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Callable, Mapping, Sequence, Union

# A level's forward cost in ms by tokens fed: a table {k: ms} (tune's measurements) or a function of k, which
# may be fractional (a mean number of drafted tokens: the planner's interpolated costs)
Costs = Union[Mapping[int, float], Callable[[float], float]]


def expected_tokens(a: float, gamma: int) -> float:
    """Tokens per verification of `gamma` drafts when each is accepted with probability a (i.i.d.)."""
    if a >= 1.0:
        return gamma + 1.0
    return (1.0 - a ** (gamma + 1)) / (1.0 - a)


def per_token_acceptance(mean_accepted: float, gamma: int) -> float:
    """Invert mean accepted drafts per round, a (1 - a^gamma) / (1 - a), for a (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, gamma) - 1.0 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return lo


def cost_at(costs: Costs, k: float) -> float:
    return costs(k) if callable(costs) else costs[int(k)]


@dataclass(frozen=True)
class Boundary:
    """What one level's verification of the level below yields at a given gamma.

    tokens(gamma): expected tokens per round (accepted + 1);
    drafted(gamma): expected drafted tokens per round: gamma for a model below, fewer for n-gram lookup,
    whose proposals stop where its match does (and are empty without one)."""

    tokens: Callable[[int], float]
    drafted: Callable[[int], float]

    @classmethod
    def iid(cls, a: float) -> Boundary:
        """Each of gamma drafts accepted with probability a, independently; always gamma drafted."""
        return cls(lambda g: expected_tokens(a, g), float)


@dataclass(frozen=True)
class Step:
    """One verifying level of a route: its forward costs, its boundary with the level below, its gamma."""

    costs: Costs
    boundary: Boundary
    gamma: int


def ms_per_token(bottom_ms: float, steps: Sequence[Step]) -> float:
    """Predicted ms per token at the top of a stack: `bottom_ms` is what one drafted token of the bottom level
    costs (a model: one forward of 1 token; n-gram lookup: 0), `steps` the verifying levels, bottom first. Each
    round of a level costs its forward of 1 + drafted tokens plus gamma tokens of the level below, and yields
    tokens(gamma) tokens."""
    return chain_ms(bottom_ms, [round_terms(lambda k, c=s.costs: cost_at(c, k), s.boundary, s.gamma) for s in steps])


# One verifying level's round as chain_ms takes it: (gamma, ms of the verifying forward, tokens per round)
RoundTerms = tuple[int, float, float]


def round_terms(cost: Callable[[float], float], boundary: Boundary, gamma: int) -> RoundTerms:
    """A level's round at `gamma` over `boundary`, its forward of 1 + drafted tokens priced by `cost`."""
    return gamma, cost(1 + boundary.drafted(gamma)), boundary.tokens(gamma)


def chain_ms(bottom_ms: float, rounds: Sequence[RoundTerms]) -> float:
    """ms_per_token's arithmetic, from each level's round_terms, bottom first."""
    ms = bottom_ms
    for gamma, forward_ms, tokens in rounds:
        ms = (forward_ms + gamma * ms) / tokens
    return ms


def cheapest_chain(bottom_ms: float, tables: Sequence[Sequence[RoundTerms]], extra_ms: float = 0.0
                   ) -> tuple[float, tuple[RoundTerms, ...]]:
    """The cheapest combination of one round per level (`tables`: each level's candidate gammas' round_terms,
    bottom first) -> (its ms per token, counting `extra_ms` more per round at the top; the combination)."""
    best = None
    for combo in product(*tables):
        ms = chain_ms(bottom_ms, combo) + extra_ms / combo[-1][2]
        if best is None or ms < best[0]:
            best = (ms, combo)
    return best


def interpolate(costs: Mapping[int, float], k: int) -> float:
    """A forward's cost at k tokens from a table measured at some counts: linear between the counts around k (k
    within the table's range)."""
    lo = max(s for s in costs if s <= k)
    hi = min((s for s in costs if s >= k), default=lo)
    return costs[lo] if hi == lo else costs[lo] + (costs[hi] - costs[lo]) * (k - lo) / (hi - lo)


def tree_ms_per_token(draft_costs: Mapping[int, float], verify_costs: Mapping[int, float], widths: Sequence[int],
                      nodes: int, tokens: float) -> float:
    """Predicted ms per token of a widths-per-depth draft tree of `nodes` nodes (Sequoia) yielding `tokens` per
    round: the drafter's forwards, one per depth but the last, each feeding the tree so far (after the root's row),
    and the verification of every node, over the tokens a round yields."""
    fed, drafting = 0, interpolate(draft_costs, 1)
    width = 1
    for w in widths[:-1]:
        width *= w
        fed += width
        drafting += interpolate(draft_costs, fed + 1)
    verify = interpolate(verify_costs, nodes + 1)
    return (drafting + verify) / tokens


def predict_ms(cost_full: Costs, cost_retr: Costs, a_full: float, a_retr: float, gamma: int, gamma_draft: int) -> float:
    """ms/token of triforce (ngram -> retrieval -> full) under the i.i.d. model, n-gram proposals always full."""
    return ms_per_token(0.0, [Step(cost_retr, Boundary.iid(a_retr), gamma_draft),
                              Step(cost_full, Boundary.iid(a_full), gamma)])


def predict_two_level_ms(cost_full: Costs, cost_draft_step: float, a: float, gamma: int) -> float:
    """ms/token of a two-level stack whose bottom model drafts one forward (cost_draft_step) per token."""
    return ms_per_token(cost_draft_step, [Step(cost_full, Boundary.iid(a), gamma)])
