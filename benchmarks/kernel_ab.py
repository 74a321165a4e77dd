"""A/B builds of the compiled CPU kernels, one process per measurement.

Python keeps an extension module by its name: a second build of `triforce_cpu_avx512` loaded into a process that
already holds one (importlib's ExtensionFileLoader, then `kernels.override`) comes back as the FIRST module object,
so an A/B inside one process times one build twice and finds its outputs "bit-identical" (see
docs/journal.md). This script runs every measurement in a fresh process that loads exactly one build, the
builds in turn (A B A B ...), and reports per build the median and spread of the rounds and whether each build's
output equals the first build's bit for bit (same random inputs: seeded).

Builds are the `.so` files the kernel cache holds (~/.cache/triforce/kernels/triforce_cpu_<isa>-<key>/); copy the
one you want to keep before changing the source.

    python benchmarks/kernel_ab.py OLD.so NEW.so                       # quant_attention, 3 and 15 rows, int8, 32K
    python benchmarks/kernel_ab.py OLD.so NEW.so --what step --kv int8   # embedded model: decode step, 5-token verification
    python benchmarks/kernel_ab.py OLD.so NEW.so --bits 4 --rows 3 --rounds 8
    python benchmarks/kernel_ab.py OLD.so NEW.so --what linear --format Q6_K --shapes 3072x512 --rows 5,64
        # linear_packed's GMAC/s on one thread (higher is faster here)
    python benchmarks/kernel_ab.py OLD.so NEW.so --what layers --rows 1,5,8,16,48
        # the embedded model's 121 linear layers, all threads, ms: in turn (weights from DRAM) and each in cache
    python benchmarks/kernel_ab.py OLD.so NEW.so --what chain --context 32768,8192
        # chain_attention: one layer of a 512-token prefill chunk over that many bf16 keys, ms
    python benchmarks/kernel_ab.py OLD.so NEW.so --what batch --kv bf16 --context 2176 --requests 8
        # a serving batch's forward: the embedded model over that many one-row requests, each with its own cache, ms
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path


def load_build(path: str):
    """The kernel module in `path` (this process must not hold another build of the same name)."""
    import torch  # noqa: F401  (the build links against libtorch's libraries, which torch loads)

    # the module's own name, from its PyInit_<name> export (a copied file may be called anything)
    found = re.search(rb"PyInit_([A-Za-z0-9_]+)", Path(path).read_bytes())
    if found is None:
        raise SystemExit(f"kernel_ab: {path} is not a Python extension module")
    name = found.group(1).decode()
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if Path(module.__file__).resolve() != Path(path).resolve():
        raise SystemExit(f"kernel_ab: {path} came back as {module.__file__}: one build of a module name per "
                         "process (a lab build takes a name of its own with TRIFORCE_KERNEL_NAME_SUFFIX)")
    return module


def digest(t) -> str:
    return hashlib.sha256(t.contiguous().view(-1).numpy().tobytes()).hexdigest()[:16]


def quant_attention_child(ops, args) -> dict:
    """ms per layer of quant_attention over `layers` layers of random planes (more than a cache holds) per row count."""
    import torch

    from decode_step_ab import random_quant_layers
    from triforce.caches.quant_codes import GROUP_K

    torch.manual_seed(0)
    H, D, g, S, L = args.heads, args.head_dim, args.group, args.context // GROUP_K * GROUP_K, args.layers
    data = random_quant_layers(H, S, D, L)
    if args.bits == 4:  # the 4-bit reading: no lower planes
        none = torch.empty(0, dtype=torch.uint8)
        data = [(k_hi, none, ks, kz, v_hi, none, vs, vz) for k_hi, _, ks, kz, v_hi, _, vs, vz in data]
    fk, fv = torch.randn(H, 100, D).half(), torch.randn(H, 100, D).half()
    out = {}
    for rows in args.rows:
        T = rows // g
        q, lim = torch.randn(H, rows, D), torch.full((rows,), S, dtype=torch.long)
        fmask = torch.ones(T, 100, dtype=torch.bool)
        times = []
        for _ in range(args.loops):
            t = time.perf_counter()
            for k_hi, k_lo, ks, kz, v_hi, v_lo, vs, vz in data:
                o = ops.quant_attention(q, k_hi, k_lo, ks, kz, v_hi, v_lo, vs, vz, lim, fk, fv, fmask, T, D ** -0.5)
            times.append((time.perf_counter() - t) / L * 1e3)
        out[f"{rows} rows ms/layer"] = (statistics.median(times), digest(o))
    return out


def step_child(ops, args) -> dict:
    """The embedded model's decode step and k-token verification over a random cache, kernels from `ops`."""
    import torch

    from triforce import kernels
    from decode_step import random_cache, time_forwards
    from triforce.loading import load_model

    with kernels.override(ops):
        torch.manual_seed(0)
        model = load_model(None, progress=False, kv_dtype=args.kv).model
        out = {}
        for k in (1, args.verify_tokens):
            cache = random_cache(model, args.context, k)
            ms = time_forwards(model, cache, args.context, k, 10, warmup=2) * 1e3
            with torch.inference_mode():
                cache.rollback(args.context)
                logits = model(torch.full((1, k), 42), cache)
            out[f"{k}-token forward ms"] = (ms, digest(logits.float()))
            del cache
    return out


def batch_child(ops, args) -> dict:
    """The embedded model's batched forward (runner.forward_batch) of --requests one-row requests, each over its own
    random cache of --context tokens, kernels from `ops`."""
    import torch

    from triforce import kernels
    from decode_step import random_cache
    from triforce.execution.runner import forward_batch
    from triforce.loading import load_model

    with kernels.override(ops), torch.inference_mode():
        torch.manual_seed(0)
        model = load_model(None, progress=False, kv_dtype=args.kv).model
        caches = [random_cache(model, args.context, 1) for _ in range(args.requests)]
        calls = [(torch.full((1, 1), 42 + i), c, 1) for i, c in enumerate(caches)]
        times = []
        for rep in range(17):  # (2 untimed)
            t = time.perf_counter()
            logits = forward_batch(model, calls)
            times.append(time.perf_counter() - t)
            for c in caches:
                c.rollback(args.context)
        ms = statistics.median(times[2:]) * 1e3
    return {f"{args.requests} x 1-row batched forward ms": (ms, digest(torch.cat(logits, dim=1).float()))}


def linear_child(ops, args) -> dict:
    """ms of linear_packed per row count over random blocks of `--format` (gguf's quantization of N(0, 0.02) values,
    random K-quant blocks), one matrix per `--shapes` entry, one thread (a kernel's rate, not the machine's)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as Q

    from triforce.ggml_blocks import QuantTensor, pack_rows, random_blocks

    torch.set_num_threads(1)
    qtype = Q[args.format]
    rng = np.random.default_rng(0)
    out = {}
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            w = random_blocks(int(qtype), n, k, rng)
        else:
            import gguf
            w = QuantTensor.from_numpy(gguf.quants.quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32),
                                                            qtype), int(qtype), k)
        parts = [pack_rows(w)]
        for rows in args.rows:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            reps = max(3, int(2e8 / (rows * n * k)))
            y = ops.linear_packed(x, parts, [int(qtype)], [n])
            best = float("inf")
            for _ in range(args.loops):
                t = time.perf_counter()
                for _ in range(reps):
                    ops.linear_packed(x, parts, [int(qtype)], [n])
                best = min(best, (time.perf_counter() - t) / reps)
            out[f"{args.format} {n}x{k}, {rows} rows: GMAC/s"] = (rows * n * k / best / 1e9, digest(y))
    return out


def layers_child(ops, args) -> dict:
    """ms of the embedded model's 121 linear layers (linear_packed, one call each, all threads) at each `--rows`:
    "from DRAM", every layer in turn as a forward runs them (92 MB of weights: they come from memory), the median of 30
    passes; "in cache", each layer repeated, the sum of their medians (the arithmetic alone)."""
    import torch

    from triforce import kernels
    from triforce.execution.linear import QuantLinear
    from triforce.loading import load_model

    out = {}
    with kernels.override(ops), torch.inference_mode():
        model = load_model(None, progress=False).model
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        weights = [([m._buffers[n] for n in m._names], m.types, m.rows) for m in layers]
        for rows in args.rows:
            torch.manual_seed(rows)
            xs = [torch.randn(rows, m.in_features) for m in layers]

            def run(i):
                return ops.linear_packed(xs[i], *weights[i])
            for _ in range(3):
                ys = [run(i) for i in range(len(layers))]
            passes = []
            for _ in range(30):
                t = time.perf_counter()
                for i in range(len(layers)):
                    run(i)
                passes.append(time.perf_counter() - t)
            hot = 0.0
            for i in range(len(layers)):
                run(i)
                times = []
                for _ in range(7):
                    t = time.perf_counter()
                    run(i)
                    times.append(time.perf_counter() - t)
                hot += statistics.median(times)
            d = digest(torch.cat([y.flatten() for y in ys]))
            out[f"{rows} rows, from DRAM: ms"] = (statistics.median(passes) * 1e3, d)
            out[f"{rows} rows, in cache: ms"] = (hot * 1e3, d)
    return out


def chain_child(ops, args) -> dict:
    """ms of chain_attention for one layer of a `--chunk`-token prefill chunk (the embedded model's 9 query heads over 3
    KV heads of 64) whose last token is key `--context`, over random bf16 K/V, in the calls the model makes
    (attention_chain_rows), best of `--loops` x 5 calls."""
    import torch

    out = {}
    for context in args.contexts:
        torch.manual_seed(0)
        Hkv, D, T = args.heads, args.head_dim, args.chunk
        q = torch.randn(Hkv * args.group, T, D)
        k = (torch.randn(Hkv, context, D) * 2).to(torch.bfloat16)
        v = torch.randn(Hkv, context, D).to(torch.bfloat16)
        rows = ops.attention_chain_rows()
        o = ops.chain_attention(q, k, v, D ** -0.5, rows)
        best = float("inf")
        for _ in range(args.loops):
            t = time.perf_counter()
            for _ in range(5):
                ops.chain_attention(q, k, v, D ** -0.5, rows)
            best = min(best, (time.perf_counter() - t) / 5)
        out[f"{T}-token chain over {context} keys ms"] = (best * 1e3, digest(o))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("builds", nargs="+", help="kernel .so files, the first the reference")
    ap.add_argument("--what", choices=("quant-attention", "step", "linear", "layers", "chain", "batch"),
                    default="quant-attention")
    ap.add_argument("--rounds", type=int, default=6, help="processes per build (default 6)")
    ap.add_argument("--rows", default="3,15", help="quant-attention: row counts (3: a decode step of 3 query heads per "
                                                 "KV head; 15: a 5-token verification); linear, layers: x rows")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=8, help="quant-attention: the int8 or the 4-bit reading")
    ap.add_argument("--context", default="32768", help="the cached keys (chain: a list, the chunk's last key)")
    ap.add_argument("--chunk", type=int, default=512, help="chain: the prefill chunk's tokens")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--loops", type=int, default=5, help="quant-attention: passes over the layers per process (median)")
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--kv", default="int8", help="step: the KV dtype")
    ap.add_argument("--verify-tokens", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8, help="batch: one-row requests in the batched forward")
    ap.add_argument("--format", default="Q4_1", help="linear: the GGML type (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K)")
    ap.add_argument("--shapes", default="3072x576,576x1536",
                    help="linear: N x K matrices (the embedded model's gate/up and down; K-quants need K %% 256 == 0)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rows = [int(r) for r in str(args.rows).split(",")]
    args.contexts = [int(c) for c in str(args.context).split(",")]
    args.context = args.contexts[0]
    if args.child:
        ops = load_build(args.builds[0])
        run = {"quant-attention": quant_attention_child, "step": step_child, "linear": linear_child,
               "layers": layers_child, "chain": chain_child, "batch": batch_child}[args.what]
        print(json.dumps(run(ops, args)))
        return
    if missing := [b for b in args.builds if not Path(b).is_file()]:
        ap.error(f"no such build: {', '.join(missing)}")
    child = [sys.executable, __file__, "--child", "--what", args.what, "--rows", ",".join(map(str, args.rows)),
             "--bits", str(args.bits), "--context", ",".join(map(str, args.contexts)), "--chunk", str(args.chunk),
             "--layers", str(args.layers), "--loops",
             str(args.loops), "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--group", str(args.group),
             "--kv", args.kv, "--verify-tokens", str(args.verify_tokens), "--requests", str(args.requests),
             "--format", args.format, "--shapes",
             args.shapes]
    results: dict[str, list[dict]] = {b: [] for b in args.builds}
    for r in range(args.rounds):
        for b in args.builds:
            p = subprocess.run([*child[:2], b, *child[2:]], capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"kernel_ab: {b} failed:\n{p.stderr[-2000:]}")
            results[b].append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    ref = args.builds[0]
    for key in results[ref][0]:
        base = statistics.median(x[key][0] for x in results[ref])
        where = {"linear": "one thread", "chain": "all threads", "layers": "all threads"}.get(args.what,
                                                                                          f"{args.context} context")
        print(f"\n{key} ({args.what}, {where}; median, min-max of {args.rounds} processes)")
        for b in args.builds:
            v = [x[key][0] for x in results[b]]
            same = all(x[key][1] == results[ref][0][key][1] for x in results[b])
            print(f"  {Path(b).name:28s} {statistics.median(v):8.3f}  ({min(v):.3f}-{max(v):.3f})  "
                  f"x{statistics.median(v) / base:.3f}  {'bit-identical' if same else 'OUTPUT DIFFERS'}")


if __name__ == "__main__":
    main()
