"""A/B of the draft head's loss weighting: heads trained on the same generated data with different weights of the
cross-entropy term (train.CLS_WEIGHT; EAGLE-1 uses 0.1, EAGLE-3 drops the feature regression), each compared with
the target teacher-forced on held-out text (head_teacher_forced.agreement).

    PYTHONPATH=src python benchmarks/head_loss_ab.py --tokens 73728 --weights 0.1,1.0 --out /tmp/ab [--json OUT]

One epoch over --tokens generated tokens (train-drafter's data, seed 0) per weight; the data is made once.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import triforce.drafthead.train as train
from triforce.corpus import genre_tokens
from triforce.loading import load_model
from triforce.storage import atomic_write

sys.path.insert(0, str(Path(__file__).parent))
from head_teacher_forced import agreement  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=73728)
    ap.add_argument("--weights", default="0.1,1.0")
    ap.add_argument("--out", type=Path, required=True, help="work directory (the generated data, checkpoints)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    W = train.dense_lm_head(model)
    held_out = {g: genre_tokens(tok, g, 1000) for g in ("prose", "code", "dialogue")}
    trainer = train.Trainer(model, tok, args.out, train.TrainSettings(tokens=args.tokens, epochs=1, seed=0),
                            progress=False)
    t0 = time.perf_counter()
    trainer.make_data()
    rows = {"command": " ".join(sys.argv), "data_seconds": round(time.perf_counter() - t0, 1), "runs": []}
    for w in (float(x) for x in args.weights.split(",")):
        train.CLS_WEIGHT = w
        (args.out / "work" / "checkpoint.pt").unlink(missing_ok=True)
        t0 = time.perf_counter()
        head = trainer.train()
        run = {"cls_weight": w, "train_seconds": round(time.perf_counter() - t0, 1),
               "held_out": {g: agreement(head, model, W, ids) for g, ids in held_out.items()}}
        rows["runs"].append(run)
        print(json.dumps(run), flush=True)
    if args.json:
        atomic_write(Path(args.json), json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
