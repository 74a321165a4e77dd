"""The acceptance model behind `triforce tune`."""
from __future__ import annotations

import pytest

from triforce.bench.tune import expected_tokens, per_token_acceptance, predict_ms, predict_two_level_ms


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


def test_two_level_prediction():
    """quantspec's model: a draft step per drafted token, one verification per round."""
    cost_full = {k: 100.0 + 5 * k for k in range(1, 12)}
    assert predict_two_level_ms(cost_full, 50.0, 0.0, 3) == pytest.approx(105 + 15 + 150)  # one token per round
    assert predict_two_level_ms(cost_full, 50.0, 1.0, 3) == pytest.approx((120 + 150) / 4)
    # a draft step as dear as the target's never pays; a cheap one with high acceptance does
    assert predict_two_level_ms(cost_full, 105.0, 0.9, 4) > cost_full[1]
    assert predict_two_level_ms(cost_full, 20.0, 0.9, 4) < cost_full[1]
