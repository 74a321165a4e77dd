"""Prefill and verification cost of this checkout against an earlier commit, on this machine, alternated.

    python benchmarks/prefill_verify_ab.py 3c3c5a8                      # 8K prefill, 32K step and 5-token verification
    python benchmarks/prefill_verify_ab.py 3c3c5a8 --prefill 8000,32000 --context 32768 --rounds 3 --out ab.json

Each measurement is a fresh process (a process keeps the first kernel build it loads) running one side's source
(`PYTHONPATH=<side>/src`): the base commit is checked out once into a temporary git worktree, and its kernels are
built on its first run (minutes, cached like any build). Sides alternate, base first, `--rounds` times, so that the
machine's drift falls on both. Per run:
  * prefill: the embedded model's `--prefill` tokens of the demo text, fed as `triforce generate` feeds them
    (512-token chunks), in seconds, and the fraction of this build's measured vector peak its FLOPs (linear layers
    and causal attention) ran at;
  * step / verify: a decode step and a `--verify`-token forward over `--context` random cached tokens (the default
    KV dtype), median ms, and the verification in decode steps.
Prints a table and the new / base ratio of each figure's median over the rounds; writes every run to --out.
A benchmark, not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs in the measured side's source tree; prints one JSON line.
PROBE = r"""
import json, sys, time, torch
from triforce import kernels
from triforce.corpus import demo_tokens
from triforce.loading import load_model
from triforce.caches import new_cache
from triforce.speculation.state import prefill
try:  # a side from before the lab left the package (2026-11-29) times itself with its own copy
    from triforce.bench.decode_step import time_ours, attention_flops
except ImportError:
    from decode_step import time_ours, attention_flops
prefill_sizes, context, verify, steps, threads = json.loads(sys.argv[1])
if threads:
    torch.set_num_threads(threads)
loaded = load_model(progress=False)
model, cfg = loaded.model, loaded.model.cfg
ops = kernels.cpu()
peak = ops.vector_peak_flops(False) if ops is not None else float("nan")
out = {"isa": getattr(ops, "ISA", "none"), "peak_gflops": peak / 1e9, "prefill": {}}
h, hd = cfg.hidden_size, cfg.head_dim
per_token = cfg.n_layers * (2 * h * hd * (cfg.n_heads + cfg.n_kv_heads) + 3 * h * cfg.intermediate_size)  # q k v o, mlp
for n in prefill_sizes:
    ids = torch.tensor([demo_tokens(loaded.tokenizer, n)])
    cache = new_cache(model, n + 1)
    t, c = time.perf_counter(), time.process_time()
    prefill(model, cache, ids, 512)
    s, cpu = time.perf_counter() - t, time.process_time() - c
    # causal attention: sum over tokens of its keys, 4 D flops per (query head, key); linear: 2 flops per weight
    att = 4.0 * cfg.head_dim * cfg.n_heads * cfg.n_layers * n * (n + 1) / 2
    lin = 2.0 * n * per_token  # (the LM head runs for the last token only)
    out["prefill"][str(n)] = {"seconds": s, "cpu_seconds": cpu, "attention_gflop": att / 1e9, "linear_gflop": lin / 1e9}
step = time_ours(model, context, steps, 1)
ver = time_ours(model, context, steps, verify)
out.update(step_ms=step * 1e3, verify_ms=ver * 1e3, verify_steps=ver / step,
           verify_attention_gflop=attention_flops(cfg, context, verify) / 1e9)
print("RESULT " + json.dumps(out))
"""


def worktree(commit: str) -> Path:
    """A detached checkout of `commit` in a temporary folder (removed at exit by the caller)."""
    path = Path(tempfile.mkdtemp(prefix="triforce-base-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), commit], check=True)
    return path


def remove_worktree(path: Path) -> None:
    """worktree()'s checkout gone again (whatever state it is in)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def run_side(src: Path, args) -> dict:
    # the side's package, and this checkout's lab instruments (decode_step.py) that time it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "src"), str(ROOT / "benchmarks")]))
    cmd = [sys.executable, "-c", PROBE, json.dumps([args.prefill, args.context, args.verify, args.steps, args.threads])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=src)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"the run in {src} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def figures(run: dict) -> dict:
    f = {f"prefill {n} s": p["seconds"] for n, p in run["prefill"].items()}
    f.update({f"prefill {n} cpu s": p["cpu_seconds"] for n, p in run["prefill"].items()})
    f.update({"step ms": run["step_ms"], "verify ms": run["verify_ms"], "verify / step": run["verify_steps"]})
    return f


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("base", help="the commit to compare with (any git revision)")
    ap.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",")], default=[8000],
                    help="prompt lengths to prefill, comma-separated (default 8000)")
    ap.add_argument("--context", type=int, default=32768, help="cached tokens of the step and the verification")
    ap.add_argument("--verify", type=int, default=5, help="tokens of the verification forward (default 5)")
    ap.add_argument("--steps", type=int, default=7, help="timed forwards per figure (median)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: PyTorch's, all cores); 1 with other work on the machine: the "
                         "prefill's CPU seconds are then a steadier figure than its wall time")
    ap.add_argument("--rounds", type=int, default=2, help="base / new alternations (default 2)")
    ap.add_argument("--out", type=Path, help="write every run as JSON here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped"))  # (the worktree is removed below)
    base = worktree(args.base)
    runs = {"base": [], "new": []}
    try:
        for r in range(args.rounds):
            for side, src in (("base", base), ("new", ROOT)):
                run = run_side(src, args)
                runs[side].append(run)
                shown = ", ".join(f"{k} {v:.2f}" for k, v in figures(run).items())
                print(f"round {r + 1} {side:4s} ({run['isa']}, peak {run['peak_gflops']:.0f} GFLOP/s): {shown}",
                      flush=True)
    finally:
        remove_worktree(base)
    print(f"\n{'figure':18s} {'base':>9s} {'new':>9s} {'new/base':>9s}   (medians over {args.rounds} rounds)")
    for key in figures(runs["new"][0]):
        b = statistics.median(figures(x)[key] for x in runs["base"])
        n = statistics.median(figures(x)[key] for x in runs["new"])
        print(f"{key:18s} {b:9.2f} {n:9.2f} {n / b:9.3f}")
    for n, p in runs["new"][0]["prefill"].items():
        flop = p["attention_gflop"] + p["linear_gflop"]
        for side in ("base", "new"):
            s = statistics.median(x["prefill"][n]["seconds"] for x in runs[side])
            s = min(s, statistics.median(x["prefill"][n]["cpu_seconds"] for x in runs[side])) if args.threads == 1 else s
            peak = statistics.median(x["peak_gflops"] for x in runs[side])
            print(f"prefill {n} ({side}): {flop:.0f} GFLOP in {s:.1f} s = {flop / s:.0f} GFLOP/s, "
                  f"{flop / s / peak:.0%} of the {peak:.0f} GFLOP/s vector peak")
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps({"base": args.base, "args": {k: str(v) for k, v in vars(args).items()},
                                   "runs": runs}, indent=1))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
