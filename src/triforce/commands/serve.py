"""`triforce serve`: an OpenAI-compatible HTTP server running any stack."""
from __future__ import annotations

import argparse
import os

from ..errors import TriforceError
from ..serving.server import main as serve_main, require_ray
from .common import add_model_args, add_spec_args, add_stack_args, byte_size, planned_stack, positive_int

NAME = "serve"
HELP = "an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)"
DESCRIPTION = ("Serve the model over HTTP with the OpenAI API (POST /v1/completions and "
               "/v1/chat/completions, streamed or not; GET /v1/models, /health and /metrics) "
               "with any speculation stack: the output equals `triforce generate`'s for the "
               "same prompt, stack, settings and seed. Up to --max-batch requests run at once, "
               "their decode steps and verifications batched into shared forwards (each keeps its own stack, "
               "caches and acceptance; its output is what it gets alone); more wait in arrival order. A request sharing a prompt prefix with an earlier one reuses its K/V "
               "(the prefix cache) and skips that part of the prefill. Needs the serve extra. "
               "With --replicas N, N engines run on Ray Serve (a local Ray instance, or the cluster "
               "of --ray-address) behind this one endpoint, each request routed to the replica "
               "that holds its prefix (needs the ray extra). Guides: docs/serving.md, "
               "docs/multi_host.md.")
# uvicorn handles SIGINT/SIGTERM itself (a graceful shutdown), which the CLI's interrupt watcher would cut short
HANDLES_SIGNALS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    n = parser.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                                                       "0.0.0.0 for every interface: there is no authentication)")
    n.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    n.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                   help="requests generated at once, their forwards batched (continuous batching: a request joins "
                        "when a place and its KV memory are free, and leaves when done); 1: one at a time "
                        "(default 8)")
    n.add_argument("--max-queue", type=positive_int, default=16, metavar="N",
                   help="requests that may wait for a place; more get 429 with Retry-After (default 16)")
    n.add_argument("--kv-memory", type=byte_size, default=None, metavar="BYTES",
                   help="memory the running requests' KV caches may take together; a request waits until its "
                        "caches fit, and one that could never fit gets a 400; suffixes K, M, G (default: 90%% of "
                        "the memory available once the model is loaded, less --prefix-cache-bytes)")
    n.add_argument("--prefill-budget", type=positive_int, default=None, metavar="N",
                   help="prompt tokens prefilled per batched decode forward while others decode: a long new prompt "
                        "is prefilled in --prefill-chunk chunks between the running requests' steps; more prefills "
                        "sooner, fewer makes the others' tokens come sooner (default: one chunk, --prefill-chunk)")
    n.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="a request still unfinished this many seconds after it arrived (queue time included) "
                        "is stopped with a 504 (default 600)")
    n.add_argument("--default-max-tokens", type=positive_int, default=256, metavar="N",
                   help="max_tokens of a request that gives none (default 256; never past the context)")
    n.add_argument("--served-model-name", metavar="NAME",
                   help="the model id in /v1/models and responses (default: the model's file or folder name)")
    n.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGINT/SIGTERM, how long running responses may finish before they are cut (default 30)")
    n.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    n.add_argument("--access-log", action="store_true", help="log every HTTP request")
    c = parser.add_argument_group("prefix cache")
    c.add_argument("--prefix-cache-bytes", type=byte_size, default=2 << 30, metavar="BYTES",
                   help="memory for cached prompt-prefix K/V, least recently used out first; suffixes K, M, G "
                        "(default 2G; 0 turns the cache off)")
    c.add_argument("--kv-cache-dir", metavar="DIR",
                   help="also keep the prefix cache in DIR, so that it survives a restart (files of another model "
                        "or setting, or damaged ones, are refused with a log line)")
    c.add_argument("--prefill-chunk", type=positive_int, default=512, metavar="N",
                   help="prompt tokens per prefill forward, and the prefix cache's block size (default 512)")
    r = parser.add_argument_group("replicas (Ray Serve; needs `pip install 'triforce[ray]'`)")
    r.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                   help="run N engines as a Ray Serve deployment behind this endpoint; a replica that dies is "
                        "replaced, and a request it had not started answering is sent to another (default 1: "
                        "one engine in this process, no Ray)")
    r.add_argument("--ray-address", metavar="ADDR",
                   help="join the Ray cluster at ADDR (host:port of `ray start --head`, or 'auto') instead of "
                        "starting a local Ray instance; the replicas spread over its nodes")
    r.add_argument("--routing", choices=("prefix", "round-robin"), default="prefix",
                   help="prefix: each request to the replica whose prefix cache holds the most of its prompt's "
                        "leading blocks, the least loaded one when the load is uneven; round-robin: in turn "
                        "(default prefix)")
    r.add_argument("--cpus-per-replica", type=float, default=None, metavar="C",
                   help="CPUs Ray reserves for each replica (default: this machine's cores / N, at least 1); "
                        "--threads sets each replica's threads (default: C rounded down, at least 1)")
    add_model_args(parser)
    add_stack_args(parser)
    add_spec_args(parser, tuned=False)


def run(args: argparse.Namespace) -> int:
    if args.replicas > 1:
        require_ray()  # before the stack is planned: the missing extra is said first
        if args.cpus_per_replica is None:
            args.cpus_per_replica = float(max(1, (os.cpu_count() or 1) // args.replicas))
        if args.cpus_per_replica <= 0:
            raise TriforceError(f"--cpus-per-replica must be positive, got {args.cpus_per_replica:g}")
        args.threads = args.threads or max(1, int(args.cpus_per_replica))
    elif args.ray_address or args.routing != "prefix" or args.cpus_per_replica is not None:
        raise TriforceError("--ray-address, --routing and --cpus-per-replica apply to --replicas N (N > 1) only")
    if (planned := planned_stack(args)) is None:
        return 0
    config, draft_path, stack, name = planned

    return serve_main(args, stack, name, config, draft_path)
