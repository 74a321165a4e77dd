"""Time one decode step at long context: ours vs transformers' generate vs the physical floor.

    python benchmarks/decode_step.py --contexts 8192,32768 [--no-transformers]
    python benchmarks/decode_step.py --kv-dtype int8 # the quantized cache, and a kv4 draft step over it

(The lab's A/B comparisons of kernels, draft weights and KV dtypes: benchmarks/decode_step_ab.py.)

Decode time does not depend on the cache's contents, so both engines get a KV cache of N tokens
filled with random values instead of a multi-minute prefill: the work per step is exactly that of
a real step at context N (same shapes, same bytes read).
"""
from __future__ import annotations

import argparse
import time

import torch

from triforce.caches import new_cache
from triforce.bench.peers import load_transformers, time_transformers
from triforce.caches.synthetic import fill_random
from triforce.tuning.measure import time_forwards, time_forwards_interleaved


def random_cache(model, n_ctx: int, tokens: int):
    """The model's cache holding n_ctx tokens of random keys and values, with room for `tokens` more
    (caches/synthetic.py)."""
    cache = new_cache(model, n_ctx + tokens)
    fill_random(cache, n_ctx)
    return cache


def time_ours(model, n_ctx: int, steps: int, tokens: int = 1) -> float:
    """Median seconds of a `tokens`-token forward (1: a decode step; k: the verification of k - 1
    drafts plus the bonus position) over a cache of n_ctx random keys and values."""
    return time_forwards(model, random_cache(model, n_ctx, tokens), n_ctx, tokens, steps, warmup=2)


def time_kv4(model, n_ctx: int, steps: int) -> float:
    """Median seconds of a kv4 level's draft step at n_ctx over an int8 target: the bf16 draft weights reading
    the upper planes of the target's (random) cache."""
    from triforce.caches import new_plane_view
    from triforce.speculation.kinds import draft_weights_model

    target = random_cache(model, n_ctx, 1)
    view = new_plane_view(target, max_rollback=64)
    view.build(target)
    return time_forwards(draft_weights_model(model), view, n_ctx, 1, steps, warmup=2)


def attention_flops(cfg, n_ctx: int, tokens: int) -> float:
    """FLOPs of attention in one forward of `tokens` tokens over n_ctx keys: q k^T and p v, 2 D
    each per (query head, key), every layer."""
    return 4.0 * cfg.head_dim * cfg.n_heads * tokens * n_ctx * cfg.n_layers


def measure_fma_peak(n: int = 1536, repeats: int = 5) -> float:
    """fp32 FLOP/s of a large square matmul (MKL's sgemm on all threads): the arithmetic peak that
    compute-bound kernels (attention when verifying many rows) are compared with."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def arithmetic_peaks(kern) -> dict:
    """The arithmetic peaks the attention's rate is compared with, FLOP/s on all threads: the kernels' own
    register-resident loops (FMAs; AVX512-BF16 dot products, what a bf16 cache's verification runs on, 0 where the
    build has none), or without kernels MKL's sgemm (on AMD's AVX-512 CPUs it runs AVX2 code: half the FMA peak)."""
    if kern is None:
        fma = measure_fma_peak()
        return {"fma": fma, "dot": 0.0, "words": f"{fma / 1e9:.0f} GFLOP/s (MKL sgemm)"}
    fma = max(kern.vector_peak_flops(False) for _ in range(3))
    dot = max(kern.vector_peak_flops(True) for _ in range(3))
    words = f"{fma / 1e9:.0f} GFLOP/s ({kern.LANES}-lane FMAs)" + (
        f", {dot / 1e9:.0f} GFLOP/s (vdpbf16ps; a bf16 cache's column is of this)" if dot else "")
    return {"fma": fma, "dot": dot, "words": words}


def _bf16_dot_words(kern) -> str:
    """What the header says of a bf16 cache's multi-token attention: on AMX tiles, on AVX512-BF16 dot products, or
    nothing (FMAs)."""
    if kern and getattr(kern, "amx_attention", lambda: False)():
        return ", AMX tiles for a bf16 cache"
    if kern and getattr(kern, "bf16_dot_attention", lambda: False)():
        return ", AVX512-BF16 dot products for a bf16 cache"
    return ""


def main(argv=None) -> None:
    from triforce.config import KV_DTYPES, WEIGHTS
    from triforce.loading import load_model
    from triforce.bench.hardware import (
        floor_seconds,
        kv_bytes_per_token,
        measure_bandwidth,
        weight_bytes,
    )

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768", help="comma-separated context lengths")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per context (median)")
    ap.add_argument("--model", default=None, help="model (default: embedded SmolLM2-135M, long-context profile)")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    ap.add_argument("--verify-tokens", type=int, default=5,
                    help="tokens of the verification forward compared with a decode step (default 5: 4 drafts "
                         "and the bonus position)")
    ap.add_argument("--kv-dtype", default=None,
                    help=f"KV cache dtype of the timed caches, or several comma-separated, timed one after another in "
                         f"this process (from {', '.join(KV_DTYPES)}; default: the model's, docs/kv_dtype.md)")
    ap.add_argument("--weights", default="native",
                    help="comma-separated ways of holding the weights to time, from native, bf16, fp32 "
                         "(default native: a GGUF file's quantized blocks as stored)")
    ap.add_argument("--synthetic-1b", type=int, metavar="LAYERS", default=None,
                    help="instead of --model: Llama 3.2 1B's shapes with LAYERS of its 16 layers, random weights "
                         "in the Q4_K_M layout (step time against its own floor; no transformers)")
    args = ap.parse_args(argv)
    kvs = [None] if args.kv_dtype is None else [x.strip() for x in args.kv_dtype.split(",") if x.strip()]
    if bad := [x for x in kvs if x is not None and x not in KV_DTYPES]:
        ap.error(f"--kv-dtype: unknown {', '.join(bad)} (choose from {', '.join(KV_DTYPES)})")
    modes = [w.strip() for w in args.weights.split(",") if w.strip()]
    if bad := [w for w in modes if w not in WEIGHTS]:
        ap.error(f"--weights: unknown {', '.join(bad)} (choose from {', '.join(WEIGHTS)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = measure_bandwidth()
    kern = None
    rows, hf_model, transformers_ms = [], None, {}
    k = args.verify_tokens
    for mode, kv in [(m, x) for m in (modes if args.synthetic_1b is None else ["native"]) for x in kvs]:
        if args.synthetic_1b is not None:
            from synthetic_models import q4_k_m_model

            model, loaded = q4_k_m_model(args.synthetic_1b, kv_dtype=kv or "fp16"), None
            name = f"Llama-3.2-1B shape, {args.synthetic_1b} layers, random Q4_K_M"
        else:
            loaded = load_model(args.model, progress=False, kv_dtype=kv, weights=mode)
            model, name = loaded.model, loaded.source
        if kern is None:
            kern = model.backend.ops
            peaks = arithmetic_peaks(kern)
            print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, read bandwidth {bw / 1e9:.1f} GB/s; "
                  f"kernels: {kern.ISA + ' (' + str(kern.LANES) + ' fp32 lanes)' if kern else 'off (PyTorch)'}"
                  f"{_bf16_dot_words(kern)}; arithmetic peak {peaks['words']}")
        print(f"{name}, --weights {mode}: weights {weight_bytes(model) / 1e6:.0f} MB read per step, KV "
              f"{kv_bytes_per_token(model) / 1e3:.1f} KB/token ({str(model.kv_dtype).removeprefix('torch.')})",
              flush=True)
        if not args.no_transformers and loaded is not None and hf_model is None:
            hf_model = load_transformers(loaded.hf_dir, model.cfg.rope.theta)
        for n in [int(x) for x in args.contexts.split(",")]:
            ours, verify = time_forwards_interleaved(model, random_cache(model, n, k), n, (1, k), args.steps)
            floor = floor_seconds(model, n, bw)
            # attention's FLOPs over the whole verification forward's time: a lower bound on the rate the
            # attention kernel reached (its FLOPs dominate the forward at long context)
            flops = attention_flops(model.cfg, n, k) / verify
            peak = peaks["dot"] if model.kv_dtype == torch.bfloat16 and peaks["dot"] else peaks["fma"]
            if hf_model is None:
                hf_s, ratio = "-", "-"
            else:
                if n not in transformers_ms:
                    transformers_ms[n] = time_transformers(hf_model, n, args.steps)
                hf = transformers_ms[n]
                hf_s, ratio = f"{hf * 1e3:.1f}", f"{hf / ours:.2f}x"
            kv4 = f"{time_kv4(model, n, args.steps) * 1e3:.1f}" if model.kv_dtype == torch.int8 else "-"
            kv_name = str(model.kv_dtype).removeprefix("torch.")
            rows.append(f"| {mode} | {kv_name} | {n} | {ours * 1e3:.1f} | {floor * 1e3:.1f} | {ours / floor:.2f}x | "
                        f"{verify * 1e3:.1f} | {verify / ours:.2f} | {flops / 1e9:.0f} ({flops / peak:.0%}) | {kv4} | "
                        f"{hf_s} | {ratio} |")
            print(rows[-1], flush=True)
        del model, loaded
    print()
    print(f"| weights | KV | context | ours ms/step | floor ms | ours / floor | {k}-token verification ms | "
          f"verification / step | attention GFLOP/s in it (of peak) | kv4 draft step ms (int8) | transformers ms/step | "
          f"transformers / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
