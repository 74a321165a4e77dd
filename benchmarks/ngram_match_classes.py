"""How often an n-gram lookup proposal is accepted, by the length of the n-gram it matched (its match class).

For each genre of the bench's prompts, `ar` generates at T=0 and at T=0.6 (two seeds); then at every position of
each generation the n-gram drafter looks up a proposal from the context so far, and the proposal is compared with
the tokens that followed. A one-hot draft x is accepted exactly when the verifier's token is x, and the committed
text is the verifier's output, so the match length is what a direct verification would accept (in distribution
when sampling). The adaptive planner plans a route per match class (speculation/planner.py) because these differ.

    PYTHONPATH=src python benchmarks/ngram_match_classes.py [CONTEXT] [NEW_TOKENS] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

from triforce.corpus import GENRES, genre_tokens
from triforce.generate import generate
from triforce.loading import load_model
from triforce.sampling import SamplingParams
from triforce.speculation.drafters import NGramDrafter


def match_lengths(prompt: list[int], generated: list[int], max_ngram: int, k: int) -> list[tuple[int, int, int]]:
    """(match class, proposal length, matched tokens) at each position of `generated`."""
    drafter = NGramDrafter(vocab_size=0, max_ngram=max_ngram)
    out = []
    for i in range(len(generated)):
        ctx = prompt + generated[:i]
        proposal, n = drafter.lookup(ctx, len(ctx), k)
        m = 0
        while m < len(proposal) and i + m < len(generated) and generated[i + m] == proposal[m]:
            m += 1
        out.append((n, len(proposal), m))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("context", nargs="?", type=int, default=4096)
    ap.add_argument("new_tokens", nargs="?", type=int, default=160)
    ap.add_argument("--ngram", type=int, default=3, help="longest n-gram looked up (the stack's --ngram)")
    ap.add_argument("--out", help="also write every position's (class, proposal length, matched) here")
    args = ap.parse_args()
    loaded = load_model()
    records = {}
    print(f"context {args.context}, {args.new_tokens} tokens per generation, proposals of up to 8 tokens")
    print("| genre | T | seed | class | positions | P(first accepted) | mean accepted |")
    print("|---|---|---|---|---|---|---|")
    for genre in GENRES:
        prompt = genre_tokens(loaded.tokenizer, genre, args.context)
        for temperature, seeds in ((0.0, (0,)), (0.6, (0, 1))):
            for seed in seeds:
                t = time.perf_counter()
                res = generate(loaded.model, prompt, args.new_tokens, SamplingParams(temperature=temperature),
                               method="ar", seed=seed)
                rec = match_lengths(prompt, res.tokens, args.ngram, 8)
                records[f"{genre} T={temperature} seed={seed}"] = rec
                by = defaultdict(list)
                for n, _, m in rec:
                    by[n].append(m)
                for n in sorted(by):
                    ms = by[n]
                    print(f"| {genre} | {temperature} | {seed} | {n} | {len(ms)} | "
                          f"{sum(m >= 1 for m in ms) / len(ms):.2f} | {sum(ms) / len(ms):.2f} |")
                print(f"  ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
