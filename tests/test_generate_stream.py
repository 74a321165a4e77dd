"""Streaming: chunks as rounds are accepted, text deltas across split UTF-8 characters, stop strings."""
from __future__ import annotations

import pytest
import torch

from conftest import embedded_available, hf_tiny, ours_from_hf
from triforce.detokenize import TextDeltas
from triforce.errors import TriforceError
from triforce.generate import generate, generate_ar, generate_stream
from triforce.speculation.settings import SpecConfig

TINY_SPEC = SpecConfig(gamma=4, gamma_draft=2, budget=48, chunk_size=8, recent=8, rebuild_every=16,
                       sink=4, window=16, ngram=3, prefill_chunk=64)


class ByteTokenizer:
    """Token t is one byte: ids 0-63 ASCII letters and punctuation, 64-95 the bytes of 'é' and '漢'
    and stray continuation bytes, so characters split across tokens (and invalid ones) occur."""

    TABLE = [ord(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'-\n()"][:64]
    TABLE += list("é".encode()) * 4 + list("漢".encode()) * 8
    TABLE = TABLE[:96]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(self.TABLE[i] for i in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def target():
    return ours_from_hf(hf_tiny("llama", seed=11, max_position_embeddings=1024))


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 96, (n // 4,), generator=g).tolist()
    return (base * 4)[:n]


def test_text_deltas_concatenate_to_the_decoding():
    tok = ByteTokenizer()
    for seed in range(20):
        ids = torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(seed)).tolist()
        d = TextDeltas(tok)
        parts = [d.push([t]) for t in ids]
        assert "".join(parts) + d.finish() == tok.decode(ids)


def test_text_deltas_decode_a_window_not_the_whole_text():
    """Each push decodes the tokens since the last complete delta (with those before them as context), so streaming n
    tokens decodes O(n) ids in all, not O(n^2)."""
    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            return super().decode(ids, skip_special_tokens)

    tok = Counting()
    ids = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(3)).tolist()  # ASCII: all complete
    d = TextDeltas(tok)
    assert "".join(d.push([t]) for t in ids) + d.finish() == ByteTokenizer().decode(ids)
    assert Counting.decoded <= 4 * len(ids)


class LeadingSpaceTokenizer:
    """SentencePiece's way: token t is a word "▁w" or a bare suffix; the decoding drops the text's leading space, so
    a token's text depends on whether it starts the decoded ids."""

    PIECES = ["\u2581the", "\u2581cat", "s", "\u2581sat", ".", "\u2581on", "ing"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids).replace("\u2581", " ").removeprefix(" ")


def test_text_deltas_keep_the_spaces_a_leading_space_decoder_drops():
    tok = LeadingSpaceTokenizer()
    for seed in range(20):
        ids = torch.randint(0, 7, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        d = TextDeltas(tok)
        assert "".join(d.push([t]) for t in ids) + d.finish() == tok.decode(ids)


def test_split_character_is_held_until_complete():
    tok = ByteTokenizer()
    e_lead, e_cont = tok.TABLE.index(0xC3), tok.TABLE.index(0xA9)  # 'é' = C3 A9
    d = TextDeltas(tok)
    assert d.push([0]) == "a"
    assert d.push([e_lead]) == ""  # half a character: nothing yet
    assert d.push([e_cont]) == "é"


@pytest.mark.parametrize("method", ["ar", "ngram", "triforce"])
def test_stream_chunks_text_and_stop_strings(target, method):
    tok = ByteTokenizer()
    prompt = _prompt(240, 3)
    free = generate_ar(target, prompt, 80, tokenizer=tok)
    assert free.text == tok.decode(free.tokens)
    stream = generate_stream(target, prompt, 80, method=method, config=TINY_SPEC, tokenizer=tok)
    chunks = list(stream)
    assert sum((c.tokens for c in chunks), []) == free.tokens
    assert "".join(c.text for c in chunks) == free.text
    # a stop string from the middle of the text: output ends right before its first occurrence
    stop = free.text[30:33]
    cut = free.text.find(stop)
    stream = generate_stream(target, prompt, 80, method=method, config=TINY_SPEC, tokenizer=tok, stop=[stop, "#"])
    text = "".join(c.text for c in stream)
    res = stream.result
    assert res.finish_reason == "stop" and res.text == text == free.text[:cut]
    n = len(res.tokens)  # the token that completed the stop string is the last one kept
    assert res.tokens == free.tokens[:n] and stop in tok.decode(res.tokens) and stop not in tok.decode(res.tokens[:-1])


def test_stop_needs_a_tokenizer(target):
    with pytest.raises(TriforceError, match="tokenizer"):
        generate(target, [1, 2, 3], 4, stop=["x"])


@pytest.mark.skipif(not embedded_available(), reason="embedded model not installed")
def test_text_deltas_on_a_real_tokenizer_with_multibyte_characters(smollm):
    tok = smollm.tokenizer
    text = "Caché, naïve café — 漢字かな 😀🎉 Ünïcödé ends here."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = TextDeltas(tok)
    parts = [d.push([t]) for t in ids]
    assert "".join(parts) + d.finish() == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in parts)
    assert any(p == "" for p in parts)  # some character did span several tokens and was held back


@pytest.mark.skipif(not embedded_available(), reason="embedded model not installed")
def test_text_deltas_equal_the_decoding_on_the_real_tokenizer_whatever_the_tokens(smollm):
    """Any ids of the real vocabulary (special tokens, characters split across tokens and bytes that never form one
    included), pushed a few at a time as speculation rounds push them: the deltas join to the whole decoding."""
    from hypothesis import given, strategies as st

    tok, vocab = smollm.tokenizer, smollm.model.cfg.vocab_size
    multibyte = tok("漢字 😀 é", add_special_tokens=False)["input_ids"]
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(multibyte), st.integers(0, 300))

    @given(st.lists(st.lists(token, min_size=1, max_size=4), max_size=30))
    def check(rounds):
        d = TextDeltas(tok)
        text = "".join(d.push(r) for r in rounds) + d.finish()
        assert text == tok.decode([t for r in rounds for t in r], skip_special_tokens=True)

    check()
