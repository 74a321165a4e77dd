"""The serve bench's load against two commits' servers at once: `triforce serve` of a base commit (a temporary git
worktree, as prefill_verify_ab.py) and of this checkout, both up, the same load sent to each in turn, the order
swapped every round, so that the host's minute-to-minute memory speed falls on both sides alike; both servers
started afresh every --restart-every rounds (default every round), because two server processes of the same code
differ by a few percent for as long as they run (an A/A run on one pair: 1.033x by the mean of 8 rounds, 7 of them
above 1; where their memory landed, huge pages or not), which one pair of servers would count as the change's.

    python benchmarks/serve_ab.py ee0cdfc --prompt-tokens 2048 --clients 8 --method ar --rounds 8

The load is benchmarks/serve.py's (its document of --prompt-tokens tokens, cached by a warm-up request on each
server, and N questions as concurrent streamed greedy requests); per round and side: the aggregate decode tokens/s
(tokens after each request's first over the time any request was decoding), the ITL p50 and the TTFT p50. Prints
each round, the new / base ratio of each round, their mean and median, and whether both sides' texts were the
same; writes every run to --out. A benchmark, not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from prefill_verify_ab import ROOT, remove_worktree, worktree
from serve import QUESTIONS, _load_once, _prompts, _side_stats, _single, wait_until_quiet

from triforce.serving.harness import ServerProcess
from triforce.storage import atomic_write


def summary(run: dict) -> dict:
    """serve.py's figures of the load (_side_stats), and its texts."""
    return {**_side_stats(run), "texts": [r["text"] for r in run["results"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("base", help="the commit to compare with (any git revision)")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="the shared document's tokens (default 2048)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent requests (default 8)")
    ap.add_argument("--max-tokens", type=int, default=192, help="tokens per request (default 192)")
    ap.add_argument("--method", default="ar", help="both servers' --method (default ar)")
    ap.add_argument("--genre", default="dialogue", choices=sorted(QUESTIONS), help="the document's genre")
    ap.add_argument("--rounds", type=int, default=8, help="alternations (default 8)")
    ap.add_argument("--restart-every", type=int, default=1,
                    help="start both servers afresh every this many rounds (default 1: a new pair each round)")
    ap.add_argument("--out", type=Path, help="write every run as JSON here")
    args = ap.parse_args(argv)
    args.batch_compare = args.clients  # (serve._prompts' count)
    from triforce.loading import load_model

    loaded = load_model(None, progress=False)
    doc, prompts = _prompts(args, loaded.tokenizer)
    del loaded
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped"))  # (the servers and the worktree go below)
    base = worktree(args.base)
    logs = Path(tempfile.mkdtemp(prefix="triforce-serve-ab-"))
    common = ["--method", args.method, "--max-batch", str(args.clients), "--prefix-cache-bytes", "2G"]
    servers, runs = {}, {"base": [], "new": []}
    trees = {"base": base, "new": ROOT}

    def start(side: str) -> ServerProcess:
        server = ServerProcess(common, logs / f"{side}.log", env=dict(os.environ, PYTHONPATH=str(trees[side] / "src")))
        asyncio.run(_single(server.url, doc + [doc[0]], 4, 600.0))  # (caches the document)
        asyncio.run(_load_once(server.url, prompts, 2, 600.0))  # (the load's buffers touched once, untimed)
        return server

    try:
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            if r % args.restart_every == 0:
                for side in list(servers):
                    servers.pop(side).stop()
                for side in order:
                    servers[side] = start(side)
            for side in order:
                wait_until_quiet()
                run = summary(asyncio.run(_load_once(servers[side].url, prompts, args.max_tokens, 600.0)))
                runs[side].append(run)
                print(f"round {r + 1} {side:4s}: {run['decode_tokens_per_s']:6.1f} tokens/s, ITL p50 "
                      f"{run['itl_p50_ms']:.2f} ms, TTFT p50 {run['ttft_p50_s']:.3f} s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        remove_worktree(base)
    ratios = [n["decode_tokens_per_s"] / b["decode_tokens_per_s"] for b, n in zip(runs["base"], runs["new"])]
    same = all(run["texts"] == runs["base"][0]["texts"] for side in runs.values() for run in side)
    errors = [e for side in runs.values() for run in side for e in run["errors"]]
    print(f"\nnew / base, aggregate decode tokens/s, per round: {' '.join(f'{x:.3f}' for x in ratios)}")
    print(f"mean {statistics.mean(ratios):.3f}, median {statistics.median(ratios):.3f} ({args.rounds} rounds); "
          f"base {statistics.median(r['decode_tokens_per_s'] for r in runs['base']):.1f}, new "
          f"{statistics.median(r['decode_tokens_per_s'] for r in runs['new']):.1f} tokens/s (medians)")
    print(f"every text the same on both sides and in every round: {same}; errors: {len(errors)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        kept = {side: [{k: v for k, v in run.items() if k != "texts"} for run in side_runs]
                for side, side_runs in runs.items()}
        atomic_write(args.out, json.dumps({"argv": sys.argv, "base": args.base, "runs": kept, "ratios": ratios,
                                           "texts_same": same}))
    return 0 if same and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
