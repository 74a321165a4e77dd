"""Provenance (speculation/provenance.py): each round's tokens with the level that drafted them, the cut draft tail,
the round's verifications. Its tokens are the generation's, its texts the stream's text, its counts the stats'; and
the output is the one every stack gives (greedy: ar's)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from triforce.generate import generate_ar, generate_stream
from triforce.speculation.provenance import level_counts
from test_generate_stream import ByteTokenizer
from test_speculation_greedy import TINY_SPEC, small_draft, target  # noqa: F401 (the same tiny pair, as fixtures)


def _prompt(n, seed):
    base = torch.randint(0, 96, (n // 4,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (base * 4)[:n]  # repeated: the n-gram drafter finds matches


def _verify_levels(stats: dict) -> dict:
    return {lvl["level"]: {k: lvl[k] for k in ("rounds", "proposed", "accepted")}
            for lvl in stats["levels"] if lvl["role"] == "verify"}


CASES = [("ar", {}), ("ngram", {}), ("retrieval", {}), ("streaming", {}), ("draft", {}), ("sequoia", {}),
         ("triforce", {"adapt": False}), ("triforce", {"adapt": False, "ngram_shortcut": 0.3}), ("triforce", {}),
         ("triforce", {"draft": "streaming", "adapt": False})]


@pytest.mark.parametrize("method,overrides", CASES, ids=[f"{m}-{'-'.join(o) or 'default'}" for m, o in CASES])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_provenance_tokens_texts_and_counts(target, small_draft, method, overrides, temperature):
    from triforce.sampling import SamplingParams

    tok = ByteTokenizer()
    prompt = _prompt(240, 3)
    params = SamplingParams(temperature)
    config = replace(TINY_SPEC, **overrides)
    stream = generate_stream(target, prompt, 60, params, method=method, config=config, draft_model=small_draft,
                             tokenizer=tok, seed=5)
    chunks = list(stream)
    res = stream.result
    if temperature == 0:  # lossless: the provenance changes no token
        assert res.tokens == generate_ar(target, prompt, 60).tokens
    rounds = [c.provenance.as_dict(tok.decode) for c in chunks]
    assert [t["id"] for r in rounds for t in r["tokens"]] == res.tokens
    for c, r in zip(chunks, rounds):
        assert [t["id"] for t in r["tokens"]] == c.tokens
        assert "".join(t["text"] for t in r["tokens"]) == c.text  # each token's text: together the chunk's
    assert "".join(t["text"] for r in rounds for t in r["tokens"]) == res.text
    # every verification of every round, summed per level: the stats' counts
    assert level_counts(rounds) == _verify_levels(res.stats)
    names = {lvl["level"] for lvl in res.stats["levels"]}
    top = res.stats["levels"][0]["level"]
    for r in rounds:
        assert {t["level"] for t in r["tokens"]} <= names
        ids = [t["id"] for t in r["tokens"]]
        if r["bonus"] is not None:  # the top verifier's own token ends the round
            assert r["tokens"][-1]["level"] == top and r["bonus"] == ids[-1]
        tops = [d for d in r["drafts"] if d["verifier"] == top]
        if tops:  # the top's verification is the round's last; its accepted drafts open the round
            last = r["drafts"][-1]
            assert last["verifier"] == top and len(tops) == 1
            if method != "sequoia":  # a chain: its accepted prefix opens the round, the cut tail is its rest
                assert ids[:last["accepted"]] == last["drafted"][:last["accepted"]][:len(ids)]
                assert r["rejected"] == last["drafted"][last["accepted"]:]
            a = min(last["accepted"], len(ids))  # (a round cut short at EOS, a stop string or the length)
            levels = [t["level"] for t in r["tokens"]]
            assert top not in levels[:a] and levels[a:] == [top] * (len(ids) - a) and len(ids) - a <= 1
        else:  # a plain step (ar, or an adaptive stack's plain route): the full model's own token
            assert r["rejected"] == [] and [t["level"] for t in r["tokens"]] == [top] * len(ids)
    if method == "ngram" or overrides.get("adapt") is False:  # (the repeated prompt's n-gram drafts are accepted)
        assert any(t["level"] != top for r in rounds for t in r["tokens"]), "no drafted token was accepted"


def test_a_stop_string_cuts_the_texts_as_the_stream(target):
    tok = ByteTokenizer()
    prompt = _prompt(240, 3)
    free = generate_ar(target, prompt, 80, tokenizer=tok)
    stop = free.text[30:33]
    stream = generate_stream(target, prompt, 80, method="triforce", config=TINY_SPEC, tokenizer=tok, stop=[stop])
    chunks = list(stream)
    assert stream.result.finish_reason == "stop"
    for c in chunks:
        assert "".join(c.provenance.texts) == c.text and c.provenance.tokens == c.tokens
    assert "".join("".join(c.provenance.texts) for c in chunks) == stream.result.text == free.text[:free.text.find(stop)]


def test_without_a_tokenizer_no_texts(target):
    stream = generate_stream(target, _prompt(120, 1), 20, method="triforce", config=TINY_SPEC)
    chunks = list(stream)
    assert all(c.provenance.texts is None and "text" not in c.provenance.as_dict()["tokens"][0] for c in chunks)
    assert sum((c.provenance.tokens for c in chunks), []) == stream.result.tokens
