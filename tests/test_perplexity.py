"""`triforce perplexity` (commands/perplexity.py: add_arguments + run): the text tokenized as the model wants it
(BOS first where its tokenizer adds one), perplexity equal to transformers' on the same tokens, JSON and
table output."""
from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from conftest import hf_tiny
from triforce.cli import main as cli_main
from triforce.commands.perplexity import add_arguments, model_tokens, run
from triforce.errors import TriforceError

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune must be " \
       "in want of a wife. However little known the feelings or views of such a man may be on his first " \
       "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families."


def char_tokenizer(bos: bool):
    """A 96-token character tokenizer (no hub): <pad> <eos> <bos> <unk> and 92 printable characters; it
    adds <bos> to every text iff `bos`."""
    import transformers
    from tokenizers import Tokenizer, models, processors

    chars = [chr(c) for c in range(32, 32 + 92)]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>",
                                                unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Gemma 3 (window 16, so the 150 tokens cross many windows) with a BOS-adding tokenizer."""
    d = tmp_path_factory.mktemp("gemma3-ppl")
    hf_tiny("gemma3", num_key_value_heads=1, head_dim=32, sliding_window=16, num_hidden_layers=3,
            sliding_window_pattern=3, tie_word_embeddings=True).save_pretrained(str(d))
    char_tokenizer(bos=True).save_pretrained(str(d))
    return d


def parse(argv):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(argv)


def test_bos_only_where_the_tokenizer_adds_one():
    with_bos, without = char_tokenizer(bos=True), char_tokenizer(bos=False)
    assert model_tokens(with_bos, "Hi")[0] == 2 and model_tokens(with_bos, "Hi")[1:] == model_tokens(without, "Hi")
    assert 2 not in model_tokens(without, "Hi")


@torch.no_grad()
def test_json_equals_transformers(model_dir, tmp_path, capsys):
    import transformers

    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    args = parse(["--model", str(model_dir), "--text-file", str(tmp_path / "text.txt"), "--tokens", "150",
                  "--chunk", "32", "--json", "--cache-dir", str(tmp_path / "cache"),
                  "--kv-dtype", "fp32"])  # transformers' cache is fp32
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 150 and out["scored"] == 149 and out["rope_theta"] is None and out["kv_dtype"] == "fp32"
    assert out["bands"] == [{"from": 0, "to": 149, "perplexity": out["perplexity"]}]
    ids = [2] + [ord(c) - 28 for c in TEXT[:149]]  # <bos>, then one token per character
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    logits = ref(torch.tensor([ids])).logits[0]
    want = math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    assert out["perplexity"] == pytest.approx(want, rel=1e-5)


def test_table_and_errors(model_dir, tmp_path, capsys):
    (tmp_path / "text.txt").write_text(TEXT[:60], encoding="utf-8")
    argv = ["--model", str(model_dir), "--text-file", str(tmp_path / "text.txt"), "--tokens", "100",
            "--rope-theta", "1e6,1e3"]
    assert cli_main(["perplexity", *argv]) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("| 1")]
    assert [r.split(" | ")[0] for r in rows] == ["| 1e+06", "| 1000"] and rows[0] != rows[1]
    assert "holds 61 tokens, fewer than --tokens 100" in captured.err
    (tmp_path / "short.txt").write_text("", encoding="utf-8")
    with pytest.raises(TriforceError, match="too short"):
        run(parse(["--model", str(model_dir), "--text-file", str(tmp_path / "short.txt"), "--tokens", "10"]))
    assert cli_main(["perplexity", "--model", str(model_dir), "--tokens", "1"]) == 2
