"""tuning/bound.py (`python -m triforce.tuning.bound`): what a drafter gives, and what it would need, under tune's acceptance model."""
from __future__ import annotations

import json

import pytest

from triforce.tuning import bound as sb

AR = 20.0
VERIFY = {1: 20.0, 2: 23.0, 3: 26.0, 4: 28.0, 5: 28.0, 6: 40.0}


def test_free_perfect_drafts_are_bounded_by_the_verification_alone():
    flat = {k: AR for k in range(1, 7)}
    assert sb.best(AR, flat, 0.0, 1.0) == (pytest.approx(6.0), 5)  # 5 drafts + the bonus token per step
    s, g = sb.best(AR, VERIFY, 0.0, 1.0)
    assert s == pytest.approx(5 * AR / 28.0) and g == 4


@pytest.mark.parametrize("cost,target", [(2.0, 2.0), (5.0, 1.5), (0.5, 3.0)])
def test_needed_acceptance_is_the_threshold(cost, target):
    a = sb.needed_acceptance(AR, VERIFY, cost, target)
    assert a is not None
    assert sb.best(AR, VERIFY, cost, a)[0] >= target > sb.best(AR, VERIFY, cost, a - 1e-3)[0]


@pytest.mark.parametrize("a,target", [(0.9, 2.0), (0.8, 1.5)])
def test_needed_cost_is_the_threshold(a, target):
    ms = sb.needed_cost(AR, VERIFY, a, target)
    assert ms is not None and ms > 0
    assert sb.best(AR, VERIFY, ms, a)[0] >= target > sb.best(AR, VERIFY, ms + 1e-2, a)[0]


def test_never_where_even_a_free_or_perfect_draft_falls_short():
    assert sb.needed_cost(AR, VERIFY, 0.5, 2.0) is None  # free drafts at 0.5 give under 2 tokens per 1.15 steps
    assert sb.needed_acceptance(AR, VERIFY, 30.0, 2.0) is None  # a draft dearer than a step


def test_reads_tune_json_and_refuses_bad_input(tmp_path, capsys):
    tune = {"context_length": 32000, "temperature": 0.6, "cost_full_ms": {str(k): v for k, v in VERIFY.items()},
            "cost_retrieval_ms": {"4096": {"1": 6.0}}, "acceptance": {"4096": {"full": 0.8, "retrieval": 0.3}},
            "quantspec": {"cost_kv4_ms": 13.0, "acceptance": 0.95},
            "best": {"budget": 4096, "gamma": 4, "gamma_draft": 1, "predicted_ms_per_token": 14.0}}
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(tune))
    assert sb.main([str(path), "--drafter", "ngram:0:0.2"]) == 0
    out = capsys.readouterr().out
    assert "| retrieval:4096 | 6.00 (0.30) | 0.800 |" in out and "| kv4 |" in out and "| ngram |" in out
    for bad in ([str(path), "--drafter", "ngram"], [str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as e:
            sb.main(bad)
        assert e.value.code == 2
