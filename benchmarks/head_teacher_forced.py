"""A draft head's agreement with its target, teacher-forced (every position reads the target's real features):
on held-out text (the bench's genres, which training never reads) and on the target's own greedy continuation
of it. It separates the head's quality from its use in a stack: the in-stack acceptance of `head,full` at T = 0
should match the continuation's top-1 agreement here.

    PYTHONPATH=src python benchmarks/head_teacher_forced.py [--head DIR] [--json OUT]

Per genre: top-1 agreement and sum(min(p, q)) at T = 0.6 at the first drafted position, and at the second (fed
the head's own prediction), over 1,000 tokens of text; top-1 agreement over 96 greedy tokens after 512.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from triforce.caches import new_cache
from triforce.corpus import genre_tokens
from triforce.drafthead.head import embed_tokens
from triforce.drafthead.loading import EMBEDDED_HEAD, load_head
from triforce.drafthead.train import _logits, dense_lm_head
from triforce.generate import generate
from triforce.loading import load_model
from triforce.sampling import SamplingParams
from triforce.storage import atomic_write


def features(model, ids: list[int]) -> torch.Tensor:
    """The target's features (final norm's output) of every token of ids -> [1, n, hidden] fp32."""
    cache = new_cache(model, len(ids) + 1, dtype="fp32")
    with torch.inference_mode():
        _, f = model(torch.tensor([ids]), cache, last=1, hidden=True)
    return f.float().clone()


def agreement(head, model, W, ids: list[int], lo: int = 0) -> dict:
    """Teacher-forced: position i reads (f[i-1], x[i]) and predicts f[i]; compared with the target from row lo."""
    f, t = features(model, ids), torch.tensor([ids])
    with torch.no_grad():
        emb = embed_tokens(model, t[:, 1:])
        pos = torch.arange(1, len(ids))
        pred = head(f[:, :-1], emb, pos)
        pred2 = head(torch.cat([f[:, :1], pred[:, :-1]], 1), emb, pos)  # the second drafted position
        lp = _logits(f[:, 1:], W, None)[:, lo:]
        lq, lq2 = _logits(pred, W, None)[:, lo:], _logits(pred2, W, None)[:, lo:]
        p6 = torch.softmax(lp / 0.6, -1)
        return {"top1": round(float((lp.argmax(-1) == lq.argmax(-1)).float().mean()), 4),
                "acc_t0.6": round(float(torch.minimum(p6, torch.softmax(lq / 0.6, -1)).sum(-1).mean()), 4),
                "top1_second": round(float((lp.argmax(-1) == lq2.argmax(-1)).float()[:, 1:].mean()), 4),
                "acc_t0.6_second": round(float(torch.minimum(p6, torch.softmax(lq2 / 0.6, -1)).sum(-1)[:, 1:].mean()), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default="", help="a head directory (default: the shipped one)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    head = load_head(args.head or EMBEDDED_HEAD, model).float()
    W = dense_lm_head(model)
    rows = []
    for genre in ("prose", "code", "dialogue"):
        text = agreement(head, model, W, genre_tokens(tok, genre, 1000))
        prompt = genre_tokens(tok, genre, 512)
        out = generate(model, prompt, 96, SamplingParams(temperature=0.0), stack="full", seed=0).tokens[:96]
        cont = agreement(head, model, W, prompt + list(out), lo=len(prompt) - 1)
        rows.append({"genre": genre, "text_1000": text, "greedy_continuation_top1": cont["top1"]})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        atomic_write(Path(args.json), json.dumps({"head": args.head or "shipped", "command": " ".join(sys.argv),
                                            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
