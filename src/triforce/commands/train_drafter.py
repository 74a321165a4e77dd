"""`triforce train-drafter`: train a draft head for a model on this CPU."""
from __future__ import annotations

import argparse
import errno
import json
import shlex
import sys
from pathlib import Path

import torch

from ..drafthead.evaluate import acceptance, table
from ..drafthead.train import TrainSettings, Trainer, check_trainable
from ..errors import TriforceError
from ..loading import load_model
from .common import positive_int

NAME = "train-drafter"
HELP = "train a draft head (EAGLE's design) for a model, on this CPU"
DESCRIPTION = ("Train a draft head for a model: the model writes its own training text (continuations of prompts "
               "from the Python standard library, chat requests and random tokens; nothing is downloaded), then a "
               "one-layer head learns to predict its next features and tokens. The head drafts at the bottom of a "
               "stack (--levels head,...,full --head OUT); the output stays exactly the model's. Interrupted runs "
               "(Ctrl-C, kill -9) resume from OUT/work when run again with the same arguments. At the end it reports "
               "the head's acceptance on held-out text (the bench's prose, code and dialogue).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainSettings()
    p.add_argument("--model", metavar="PATH",
                   help="a .gguf file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", metavar="DIR", required=True,
                   help="where the head is written (config.json, head.safetensors) and its work files kept "
                        "(DIR/work: the generated data and the checkpoint; delete it when done)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the data, the weights and the batch order "
                                                             f"(default {d.seed})")
    p.add_argument("--tokens", type=positive_int, default=d.tokens,
                   help=f"tokens of training text the model writes (default {d.tokens}; about 300-600 per second "
                        f"for a 135M model on 2 cores)")
    p.add_argument("--epochs", type=positive_int, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    p.add_argument("--batch", type=positive_int, default=d.batch, help=f"sequences per step (default {d.batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--unroll", type=positive_int, default=d.unroll,
                   help=f"steps the head is trained to draft in sequence, fed its own predictions (default "
                        f"{d.unroll}; 1: teacher forcing only)")
    p.add_argument("--window", type=positive_int, default=d.window,
                   help=f"positions the head attends to when it drafts (default {d.window})")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: one per core)")
    p.add_argument("--no-eval", dest="evaluate", action="store_false",
                   help="skip the acceptance report on held-out text at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    settings = TrainSettings(tokens=args.tokens, epochs=args.epochs, batch=args.batch, lr=args.lr,
                             unroll=args.unroll, window=args.window, seed=args.seed)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise TriforceError(f"--out {out} is a file: give a directory")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, progress=not args.quiet)
    check_trainable(loaded.model)
    command = "triforce train-drafter " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == [NAME] \
        else f"triforce train-drafter --out {shlex.quote(str(out))} --seed {args.seed}"
    trainer = Trainer(loaded.model, loaded.tokenizer, out, settings, progress=not args.quiet, command=command)
    try:
        head = trainer.run()
        if args.evaluate:
            rows = acceptance(loaded.model, loaded.tokenizer, out, progress=not args.quiet)
            head.cfg.trained["held_out_acceptance"] = rows
            head.save(out)
            print(table(rows))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise TriforceError(f"no space left to write under {out}: free some, then run the same command "
                                f"again to resume") from None
        raise TriforceError(f"cannot write under {out}: {e.strerror or e}") from None
    t = head.cfg.trained
    print(json.dumps({"out": str(out), "data_seconds": t["data_seconds"], "train_seconds": t["train_seconds"],
                      "final": t["final"]}))
    return 0
