"""The `triforce` command line: registers the commands (triforce/commands/, one module each) and turns their
errors into one line and an exit code."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

from . import storage
from .commands import COMMANDS
from .errors import TriforceError
from .interrupts import EXIT_INTERRUPTED, prompt_interrupts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triforce",
        description="Fast, lossless long-context generation for Llama-family models (TriForce speculative decoding).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(p)
        p.set_defaults(run=command.run, handles_signals=getattr(command, "HANDLES_SIGNALS", False))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if getattr(args, "cache_dir", None):  # every cache (converted models, kernel builds) follows --cache-dir
        os.environ[storage.CACHE_ENV] = str(Path(args.cache_dir).expanduser().resolve())
    try:
        # a command that handles SIGINT/SIGTERM itself (serve: a graceful shutdown) runs without the watcher
        with contextlib.nullcontext() if args.handles_signals else prompt_interrupts():
            return args.run(args)
    except TriforceError as e:
        print(f"triforce: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ntriforce: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
