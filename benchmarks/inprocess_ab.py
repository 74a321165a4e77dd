"""A/B of compiled kernel builds alternated inside one process, the order rotated every repetition: the decode
attention alone over random K/V (`attention`), or the embedded model's decode step and k-token verification over a
random cache (`model`). kernel_ab.py runs one process per measurement; on a host whose memory changes speed from
one minute to the next (docs/performance.md), builds measured a minute apart differ by more than the change under
test, and a build always timed first gains from it (2-5% here). Here every repetition times each build once, in
turn, in the same minute.

Python keeps an extension module by its name, so each build must have a name of its own: build it from a worktree
with TRIFORCE_KERNEL_NAME_SUFFIX set (a commit older than that setting: add the suffix to the name in
kernels/__init__.py's `variant` by hand), and copy the file out.

    git worktree add /tmp/base <commit>
    cd /tmp/base && TRIFORCE_KERNEL_NAME_SUFFIX=_base PYTHONPATH=src \\
        python -c "from triforce import kernels; print(kernels.variant('avx512').__file__)"   # copy it to base.so
    (the same in this checkout with _new, copied to new.so; 'avx2' for the AVX2 build)
    python benchmarks/inprocess_ab.py attention base.so new.so --tokens 1 --reps 10
    python benchmarks/inprocess_ab.py model base.so new.so --verify-tokens 5 --reps 8 --kv fp16

Each line: a build's median, and the median and range of its time over the first build's in the same repetition.
The memory's read rate (a sum over 1 GiB, PyTorch's) is printed before and after: a ratio holds for that mode.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kernel_ab import load_build
from triforce.bench.hardware import measure_bandwidth


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def rotated(n_builds: int, reps: int):
    """Each repetition's build order, rotated by one every repetition."""
    for rep in range(reps):
        yield [(rep + i) % n_builds for i in range(n_builds)]


def attention_runs(mods, args) -> dict:
    """Seconds of one decode_attention call per layer over --layers layers of random K/V (3 KV heads, head dim 64,
    3 query rows per KV head and token), per build and repetition."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.kv]
    heads, dim, T = 3, 64, args.tokens
    ks = [torch.randn(heads, args.context, dim).to(dtype) for _ in range(args.layers)]
    vs = [torch.randn(heads, args.context, dim).to(dtype) for _ in range(args.layers)]
    q = torch.randn(heads, 3 * T, dim)
    outs = [m.decode_attention(q, ks[0], vs[0], T, T > 1, dim ** -0.5, 0) for m in mods]
    for i, out in enumerate(outs[1:], 1):
        if not torch.equal(out, outs[0]):
            print(f"build {i} differs from build 0 (max {(out - outs[0]).abs().max().item():.3g})")
    times = {f"{T}-token attention": [[] for _ in mods]}
    for order in rotated(len(mods), args.reps):
        for i in order:
            times[f"{T}-token attention"][i].append(_timed(
                lambda: [mods[i].decode_attention(q, k, v, T, T > 1, dim ** -0.5, 0) for k, v in zip(ks, vs)]))
    return times


def model_runs(mods, args) -> dict:
    """Seconds of the embedded model's 1-token and --verify-tokens forwards over a random cache, per build and
    repetition (kernels.override)."""
    from decode_step import random_cache

    from triforce import kernels
    from triforce.loading import load_model
    from triforce.tuning.measure import time_forwards

    torch.manual_seed(0)
    model = load_model(None, progress=False, kv_dtype=args.kv).model
    ks = (1, args.verify_tokens)
    caches = {k: random_cache(model, args.context, k) for k in ks}
    times = {f"{k}-token forward": [[] for _ in mods] for k in ks}
    for order in rotated(len(mods), args.reps):
        for i in order:
            with kernels.override(mods[i]):
                for k in ks:
                    times[f"{k}-token forward"][i].append(time_forwards(model, caches[k], args.context, k, 3))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["attention", "model"])
    p.add_argument("builds", nargs="+", type=Path, help="kernel .so files, each under its own module name; the first "
                                                        "the reference")
    p.add_argument("--context", type=int, default=32768, help="cached tokens (default 32768)")
    p.add_argument("--tokens", type=int, default=1, help="attention: query tokens (1: a decode step; 5: a verification)")
    p.add_argument("--layers", type=int, default=30, help="attention: layers of K/V, each its own (default 30)")
    p.add_argument("--verify-tokens", type=int, default=5, help="model: the verification's tokens (default 5)")
    p.add_argument("--kv", choices=["bf16", "fp16"], default="bf16", help="the K/V dtype (default bf16)")
    p.add_argument("--reps", type=int, default=10, help="repetitions, each timing every build once (default 10)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: PyTorch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mods = [load_build(str(path)) for path in args.builds]
    before = measure_bandwidth(repeats=3) / 1e9
    times = (attention_runs if args.what == "attention" else model_runs)(mods, args)
    after = measure_bandwidth(repeats=3) / 1e9
    print(f"memory read rate {before:.1f} GB/s before, {after:.1f} after; {args.reps} repetitions, "
          f"{torch.get_num_threads()} threads, context {args.context}, {args.kv} K/V")
    for figure, per_build in times.items():
        for path, t in zip(args.builds, per_build):
            ratios = [a / b for a, b in zip(t, per_build[0])]
            print(f"{figure:20s} {path.name:24s} median {statistics.median(t) * 1e3:8.2f} ms   x{statistics.median(ratios):.3f}"
                  f" ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
