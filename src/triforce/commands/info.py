"""`triforce info`: what a model holds and the memory a context will take; nothing is loaded."""
from __future__ import annotations

import argparse

from ..config import DEFAULT_KV_DTYPE, KV_DTYPES, WEIGHTS, WEIGHTS_HELP
from ..loading.inventory import inventory, report
from .common import positive_int

NAME = "info"
HELP = "what a model holds and the memory a context will take (nothing is loaded)"
DESCRIPTION = ("Print a model's shape, its weights by format with their bytes, the memory "
               "each --weights choice holds, KV cache bytes per 1K tokens in each --kv-dtype, "
               "and the total a context will need against the memory available. Reads the "
               "GGUF header (or safetensors headers) only.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="a .gguf file or Hugging Face directory (default: the embedded model)")
    parser.add_argument("--context-length", type=positive_int, metavar="N",
                     help="tokens of context to size the KV cache for (default: the model's context)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help=f"KV cache dtype (default {DEFAULT_KV_DTYPE}; bf16 on a CPU with AMX tiles or an AMD one with AVX512-BF16)")
    parser.add_argument("--weights", choices=WEIGHTS, default="native", help=WEIGHTS_HELP)
    parser.add_argument("--rope-theta", type=float, metavar="BASE", help=argparse.SUPPRESS)
    parser.add_argument("--max-context", type=positive_int, metavar="N", help="override the maximum context in tokens")


def run(args: argparse.Namespace) -> int:
    print(report(inventory(args.model, args.rope_theta, args.max_context), args.weights, args.kv_dtype,
                 args.context_length))
    return 0
