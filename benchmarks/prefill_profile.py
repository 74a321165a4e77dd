"""Where a prefill's time goes: the embedded model's prefill of N demo tokens, timed by part against its FLOPs and
this build's measured vector peak.

    python benchmarks/prefill_profile.py 8000            # 512-token chunks, as `triforce generate` feeds them
    python benchmarks/prefill_profile.py 32000 --chunk 512 --json out.json

Parts: attention (execution.attention.attention, the whole call: the kernel or PyTorch's path), the linear layers
(QKV, O, gate/up, down; each layer's forward), and the rest (norms, RoPE, SiLU, the cache's writes, Python), the
rest being the whole prefill less the two. Each part's FLOPs: attention 4 D per (query head, visible key); a linear
layer 2 per weight and row. Each part is set against the peak of the arithmetic it runs on, measured in the same run:
attention over a bf16 cache on AVX512-BF16 dot products against vdpbf16ps's (vector_peak_flops(True)), the packed
integer linear layers against half of vpdpbusd's (integer_peak_ops: two byte products per weight and row, x's two
planes), anything else against the FMAs' (vector_peak_flops(False)); the whole against the FMAs'.
A lab instrument: it wraps the model's functions to time them, which adds a few microseconds per call.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from triforce import kernels, model as model_module
from triforce.caches import new_cache
from triforce.corpus import demo_tokens
from triforce.execution import linear as linear_module
from triforce.kernels.capabilities import capabilities
from triforce.loading import load_model
from triforce.speculation.state import prefill


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokens", type=int, help="prompt tokens to prefill")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512, the default settings')")
    ap.add_argument("--kv-dtype", default=None, help="the cache's dtype (default: the model's default here)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: PyTorch's, all cores)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(progress=False, kv_dtype=args.kv_dtype)
    model, cfg = loaded.model, loaded.model.cfg
    ops = kernels.cpu()
    def probe(f):  # the best of three (each about 10 ms: one can catch the host's other work)
        return max(f() for _ in range(3))
    peak = probe(lambda: ops.vector_peak_flops(False)) if ops is not None else float("nan")
    peaks = {"attention": ("FMA", peak), "linear": ("FMA", peak)}
    if ops is not None and model.kv_dtype == torch.bfloat16 and capabilities(ops).bf16_dot_attention:
        peaks["attention"] = ("vdpbf16ps", probe(lambda: ops.vector_peak_flops(True)))
    if ops is not None and getattr(ops, "PACKED_PREFILL", False) and getattr(ops, "integer_peak_ops", None):
        peaks["linear"] = ("vpdpbusd / 2", probe(ops.integer_peak_ops) / 2)
    seconds: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)

    attention = model_module.attention

    def timed_attention(q, kv, scale=None, ops=None):
        t = time.perf_counter()
        out = attention(q, kv, scale, ops)
        seconds["attention"] += time.perf_counter() - t
        B, Hq, T, D = q.shape
        S = kv.keys.shape[-2] if hasattr(kv, "keys") else T
        flops["attention"] += 4.0 * D * Hq * (T * (S - T) + T * (T + 1) / 2)  # every past key, then causal
        return out

    def timing(cls):
        forward = cls.forward

        def timed(self, x):
            t = time.perf_counter()
            out = forward(self, x)
            seconds["linear"] += time.perf_counter() - t
            flops["linear"] += 2.0 * x[..., 0].numel() * out.shape[-1] * x.shape[-1]
            return out
        cls.forward = timed

    model_module.attention = timed_attention
    for cls in (linear_module.Linear, linear_module.QuantLinear):
        timing(cls)
    ids = torch.tensor([demo_tokens(loaded.tokenizer, args.tokens)])
    cache = new_cache(model, args.tokens + 1)
    t = time.perf_counter()
    prefill(model, cache, ids, args.chunk)
    total = time.perf_counter() - t
    seconds["rest"] = total - seconds["attention"] - seconds["linear"]
    print(f"{args.tokens}-token prefill, {args.chunk}-token chunks, KV {model.kv_dtype}, "
          f"{getattr(ops, 'ISA', 'no kernels')} build, FMA peak {peak / 1e9:.0f} GFLOP/s: {total:.2f} s")
    rows = {}
    for part in ("attention", "linear", "rest"):
        s, f = seconds[part], flops.get(part, 0.0)
        rate = f / s if s > 0 else 0.0
        name, p = peaks.get(part, ("FMA", peak))
        rows[part] = {"seconds": s, "gflop": f / 1e9, "gflops_per_s": rate / 1e9, "peak": name,
                      "peak_gflops": p / 1e9, "of_peak": rate / p}
        note = f"{rate / p:5.1%} of the {name} peak {p / 1e9:4.0f}  (at peak: {f / p:.2f} s)" if f else ""
        print(f"  {part:9s} {s:7.2f} s ({s / total:5.1%})  {f / 1e9:8.0f} GFLOP  {rate / 1e9:6.0f} GFLOP/s  {note}")
    flop = flops["attention"] + flops["linear"]
    print(f"  whole     {flop / 1e9:.0f} GFLOP in {total:.2f} s: {flop / total / 1e9:.0f} GFLOP/s, "
          f"{flop / total / peak:.1%} of the FMA peak; each part at its own peak: "
          f"{sum(flops[k] / peaks[k][1] for k in ('attention', 'linear')):.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "chunk": args.chunk, "kv_dtype": str(model.kv_dtype),
                       "isa": getattr(ops, "ISA", None), "peak_gflops": peak / 1e9, "seconds": total,
                       "parts": rows}, f, indent=1)


if __name__ == "__main__":
    main()
