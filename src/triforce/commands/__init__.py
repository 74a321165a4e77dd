"""The subcommands of `triforce`, one module each.

A command module has NAME, HELP and DESCRIPTION (its line in `triforce --help` and its own help's first
paragraph), `add_arguments(parser)` and `run(args) -> int` (the exit code); HANDLES_SIGNALS = True where the
command handles SIGINT/SIGTERM itself. `cli.py` registers them in COMMANDS' order, the order `--help` lists them.
Options shared by several commands (model, speculation, stack) are in common.py."""
from __future__ import annotations

from . import bench, generate, info, perplexity, quantize, serve, train_drafter, tune

COMMANDS = (generate, bench, tune, train_drafter, info, perplexity, quantize, serve)
