"""A draft head's acceptance against the full target on held-out text, by draft position, and the time of one drafted
token against its memory floor and against an `ar` step.

    PYTHONPATH=src python benchmarks/head_acceptance.py [--head DIR] [--contexts 8192,32000] [--genres prose,code]
                                                        [--temperatures 0,0.6] [--new-tokens 128] [--json OUT]

The head drafts gamma tokens per round for the full target (stack head,full, no n-gram shortcut: the head's drafts
alone); the bench's prose and code are text training never reads (drafthead/data.py).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from triforce.drafthead.evaluate import acceptance, table
from triforce.drafthead.loading import EMBEDDED_HEAD, head_for
from triforce.generate import generate
from triforce.loading import load_model
from triforce.sampling import SamplingParams
from triforce.speculation.state import PrefilledPrompt
from triforce.corpus import genre_tokens

BANDWIDTH_GBS = 46.0  # measured read rate of this 2-core Zen 5 (docs/performance.md); pass --bandwidth for another


def head_bytes(model, head) -> int:
    """Bytes one drafted token reads: the head's layer and mixing weights (bf16 panels), the LM head as its forward
    reads it."""
    layer = sum(p.numel() for n, p in head.named_parameters() if p.dim() == 2) * 2
    return layer + model.lm_head.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default=str(EMBEDDED_HEAD))
    ap.add_argument("--contexts", default="8192,32000")
    ap.add_argument("--genres", default="prose,code")
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--bandwidth", type=float, default=BANDWIDTH_GBS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = load_model(progress=False)
    model = m.model
    rows = acceptance(model, m.tokenizer, args.head, contexts=[int(c) for c in args.contexts.split(",")],
                      temperatures=[float(t) for t in args.temperatures.split(",")], genres=args.genres.split(","),
                      new_tokens=args.new_tokens, gamma=args.gamma, progress=True)
    head = head_for(model, args.head)
    floor_ms = head_bytes(model, head) / (args.bandwidth * 1e9) * 1e3
    ar = {}
    for c in sorted({r["context"] for r in rows}):
        prompt = genre_tokens(m.tokenizer, args.genres.split(",")[-1], c)  # an ar step over the same kind of text
        res = generate(model, prompt, 32, SamplingParams(), method="ar", prefilled=PrefilledPrompt(model, prompt, c + 64))
        step = res.stats["levels"][0]  # ar: the full level decoding alone
        ar[c] = 1e3 * step["seconds"] / step["tokens"]
    print(table(rows))
    print(f"\none drafted token reads {head_bytes(model, head) / 1e6:.1f} MB: floor {floor_ms:.3f} ms at "
          f"{args.bandwidth} GB/s")
    for r in rows:
        r["ar_step_ms"] = round(ar[r["context"]], 3)
        r["draft_share_of_ar_step"] = round(r["ms_per_drafted_token"] / ar[r["context"]], 4)
        r["draft_floor_ms"] = round(floor_ms, 4)
    print("| genre | context | T | ms per drafted token | floor ms | ar step ms | share of an ar step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['genre']} | {r['context']} | {r['temperature']} | {r['ms_per_drafted_token']} | "
              f"{r['draft_floor_ms']} | {r['ar_step_ms']} | {r['draft_share_of_ar_step']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "head": args.head, "torch": torch.__version__, "time": time.time()}, f, indent=1)


if __name__ == "__main__":
    main()
