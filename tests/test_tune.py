"""The acceptance model behind `triforce tune`."""
from __future__ import annotations

import pytest

from triforce.speculation.cost_model import expected_tokens, per_token_acceptance, predict_ms, predict_two_level_ms
from triforce.tuning.tune import chosen_flags, pooled_mean_accepted, probe_seeds


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_per_token_acceptance_inverts_the_mean(a, gamma):
    mean_accepted = expected_tokens(a, gamma) - 1.0
    assert per_token_acceptance(mean_accepted, gamma) == pytest.approx(a, abs=1e-6)


def test_expected_tokens_limits():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    # simulated rounds agree with the closed form
    import random

    rng, a, g, n = random.Random(0), 0.6, 4, 20000
    total = 0
    for _ in range(n):
        k = 0
        while k < g and rng.random() < a:
            k += 1
        total += k + 1
    assert total / n == pytest.approx(expected_tokens(a, g), rel=0.02)


def test_predict_prefers_cheap_drafts_when_acceptance_is_high():
    cost_full = {k: 100.0 + 5 * k for k in range(1, 12)}
    cost_retr = {k: 20.0 + 2 * k for k in range(1, 8)}
    good = predict_ms(cost_full, cost_retr, 0.9, 0.8, 8, 3)
    bad = predict_ms(cost_full, cost_retr, 0.2, 0.8, 8, 3)
    assert good < cost_full[1] < bad


def test_tree_value_matches_simulated_rounds():
    """tree_value (expected tokens per round of a tree under the positional acceptance model) against a
    simulation of Sequoia's walk: at each slot children are tried in rank order, rank r accepted with
    probability a[r] given the earlier ones rejected; the walk goes on from an accepted child."""
    import random

    from triforce.speculation.tree import DraftTree, fixed_tree, tree_value

    a = [0.6, 0.4, 0.3]
    parents = fixed_tree((3, 2, 1))
    kids = DraftTree(tuple(range(len(parents))), parents).children
    rng, n, total = random.Random(0), 40000, 0
    for _ in range(n):
        slot, tokens = 0, 1
        while True:
            nxt = next((c for r, c in enumerate(kids[slot]) if rng.random() < (a[r] if r < len(a) else 0)), None)
            if nxt is None:
                break
            tokens += 1
            slot = nxt + 1
        total += tokens
    assert total / n == pytest.approx(tree_value(parents, a), abs=0.02)


def test_width_trees_enumerates_bounded_shapes():
    from triforce.tuning.tune import width_trees

    trees = dict(width_trees(10, 3, max_width=3))
    assert (2, 2, 1) in trees and len(trees[(2, 2, 1)]) == 10 and (3, 3) not in trees  # 3 + 9 > 10
    assert all(len(p) <= 10 and len(w) <= 3 and list(w) == sorted(w, reverse=True) for w, p in trees.items())


def test_two_level_prediction():
    """quantspec's model: a draft step per drafted token, one verification per round."""
    cost_full = {k: 100.0 + 5 * k for k in range(1, 12)}
    assert predict_two_level_ms(cost_full, 50.0, 0.0, 3) == pytest.approx(105 + 15 + 150)  # one token per round
    assert predict_two_level_ms(cost_full, 50.0, 1.0, 3) == pytest.approx((120 + 150) / 4)
    # a draft step as dear as the target's never pays; a cheap one with high acceptance does
    assert predict_two_level_ms(cost_full, 105.0, 0.9, 4) > cost_full[1]
    assert predict_two_level_ms(cost_full, 20.0, 0.9, 4) < cost_full[1]


def test_interleaved_forward_timing_takes_turns_and_leaves_the_cache_as_found(monkeypatch):
    """The decode-step benchmark's step / verification ratio (benchmarks/decode_step.py): the two sizes alternate on
    one cache (k1, k2, k1, k2, ...), each
    forward after a rollback to the context, and the cache ends at that length."""
    from conftest import hf_tiny, ours_from_hf
    from triforce.caches import new_cache
    from triforce.caches.synthetic import fill_random
    from triforce.tuning import measure

    model = ours_from_hf(hf_tiny("llama", seed=1))
    cache = new_cache(model, 40 + 5)  # 40 tokens of random K/V, room for 5 more
    fill_random(cache, 40)
    seen = []
    forward = type(model).forward

    def spy(self, tokens, c, *a, **k):
        seen.append((tokens.shape[1], c.length))
        return forward(self, tokens, c, *a, **k)

    monkeypatch.setattr(type(model), "forward", spy)
    times = measure.time_forwards_interleaved(model, cache, 40, (1, 5), repeats=3, warmup=1)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert seen == [(1, 40), (5, 40)] * 4 and cache.length == 40


def test_tune_records_the_fastest_checked_setting_or_the_defaults():
    from triforce.speculation.settings import SpecConfig

    best = {"budget": 2048, "gamma": 4, "gamma_draft": 3, "predicted_ms_per_token": 7.3}
    config = SpecConfig(budget=4096, gamma=4, gamma_draft=3)

    def check(tuned, default, flags):
        return {"tuned": {"flags": flags, "triforce_ms_per_token": tuned}, "default": {"triforce_ms_per_token": default}}

    assert chosen_flags(best, config, None) == ({"budget": 2048, "gamma": 4, "gamma_draft": 3}, False)  # --no-check
    # the check ran another predicted setting fastest (budget 1024): that one, not the prediction's best
    one = {"budget": 1024, "gamma": 4, "gamma_draft": 3}
    assert chosen_flags(best, config, check(7.8, 8.3, one)) == (one, False)
    assert chosen_flags(best, config, check(8.4, 8.3, one)) == ({"budget": 4096, "gamma": 4, "gamma_draft": 3}, True)


def test_tune_trees_records_a_tree_only_if_it_beat_the_chain_defaults():
    from triforce.tuning.tune import tree_to_record

    def check(tuned, default):
        return {"tuned_ms_per_token": tuned, "default_ms_per_token": default, "ar_ms_per_token": 20.0}

    assert tree_to_record("2,2,1", None) == {"tree": "2,2,1"}  # --no-check: the prediction
    assert tree_to_record("2,2,1", check(7.9, 8.3)) == {"tree": "2,2,1"}
    assert tree_to_record("2,2,1", check(8.4, 8.3)) is None  # slower than the chain defaults: nothing recorded
    assert tree_to_record("2,2,1", check(8.3, 8.3)) is None  # not faster


def test_sampled_probes_pool_several_seeds():
    assert probe_seeds(0.0, 7) == [7] and probe_seeds(0.6, 7) == [7, 8, 9, 10]
    run = lambda full, retr: [{"level": "ngram", "role": "draft"},  # noqa: E731
                              {"level": "retrieval", "role": "verify", "accepted": retr[0], "rounds": retr[1]},
                              {"level": "full", "role": "verify", "accepted": full[0], "rounds": full[1]}]
    pooled = pooled_mean_accepted([run((30, 10), (5, 10)), run((10, 10), (0, 0)), run((20, 5), (15, 10))])
    assert pooled == {"full": 60 / 25, "retrieval": 20 / 20}  # accepted over rounds, not a mean of means
