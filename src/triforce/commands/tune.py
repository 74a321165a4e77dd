"""`triforce tune`: measure this machine, pick the speculation flags and record them for generate and bench."""
from __future__ import annotations

import argparse

from ..tuning.tune import main as tune_main
from .common import add_model_args, add_spec_args, positive_int, spec_config_from_args

NAME = "tune"
HELP = "measure this machine and pick --gamma, --gamma-draft and --budget"
DESCRIPTION = ("Measure the cost of full-cache and retrieval-cache forwards of 1..k tokens "
               "and each level's acceptance on a real prompt, predict ms/token for every "
               "(budget, gamma, gamma-draft) and print the best as flags. They are recorded as "
               "this machine's default for --method triforce (with --trees: the tree of --method "
               "sequoia), with this model and KV dtype, for runs at contexts within 2x of "
               "--context-length and the same kind of temperature (greedy or sampled); generate "
               "and bench take them unless given --no-tuned or the flags themselves. The best few "
               "predicted settings are first run for real against the defaults (--check): the "
               "fastest is what is recorded.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context-length", type=positive_int, default=16384, metavar="N",
                   help="prompt length to tune for (default 16384)")
    parser.add_argument("--budgets", default="1024,2048,4096", metavar="N,N", help="retrieval budgets to try")
    parser.add_argument("--max-gamma", type=positive_int, default=10, metavar="N", help="largest --gamma considered")
    parser.add_argument("--max-gamma-draft", type=positive_int, default=6, metavar="N",
                   help="largest --gamma-draft considered")
    parser.add_argument("--tokens", type=positive_int, default=96, metavar="N",
                   help="tokens generated per acceptance measurement (default 96; sampled: each of 4 seeds)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="temperature to tune for (default 0: greedy; top-p 0.9 when T > 0). Acceptance, and so "
                        "the best flags, depend on it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="run the 4 best predicted settings and the defaults for real (and ar), alternating; "
                        "sampled: over 4 seeds; the fastest is recorded (default: on; --no-check records the "
                        "prediction unchecked)")
    parser.add_argument("--trees", action="store_true",
                   help="tune Sequoia trees instead (streaming,full --tree): measure the acceptance of each child "
                        "rank and the forward costs, predict every widths-per-depth tree, print the best; "
                        "with --check, it is recorded only if it ran faster than the chain defaults")
    parser.add_argument("--max-tree-nodes", type=positive_int, default=32, metavar="N",
                   help="--trees: largest tree considered (default 32)")
    parser.add_argument("--kv4", action="store_true",
                   help="also measure the kv4 level (the target reading its cache at 4 bits: over an int8 target, "
                        "--kv-dtype int8, its own upper planes) and predict the best --gamma of --method quantspec")
    parser.add_argument("--prefill-chunk", type=positive_int, default=512, metavar="N")
    parser.add_argument("--json", action="store_true", help="print the measurements and predictions as JSON")
    parser.add_argument("--quiet", action="store_true")
    parser.set_defaults(method="triforce")
    add_model_args(parser)
    add_spec_args(parser, tuned=False)


def run(args: argparse.Namespace) -> int:
    config, _ = spec_config_from_args(args)

    return tune_main(args, config)
