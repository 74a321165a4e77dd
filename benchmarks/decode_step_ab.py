"""The lab's A/B comparisons on the decode step (not user commands: `python benchmarks/decode_step.py` times
the step itself). Each mode alternates its two sides in one process, so both see the same minutes of a host whose
speed drifts; results and the commands that made them: docs/journal.md and the reference docs.

    python benchmarks/decode_step_ab.py kernels --contexts 8192,32768   # compiled kernels vs PyTorch
    python benchmarks/decode_step_ab.py draft-weights --contexts 32768  # fp32 vs bf16 draft weights, retrieval level
    python benchmarks/decode_step_ab.py kv --contexts 32768             # fp16 vs int8 cache and kv4 draft
    python benchmarks/decode_step_ab.py quant-attention --contexts 32768  # the int8 cache's attention kernel alone
    python benchmarks/decode_step_ab.py linear-formats                  # each weight format's linear kernels, from DRAM
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode_step import time_kv4, time_ours
from triforce.tuning.measure import time_forwards


def time_attention(n_ctx: int, T: int, cfg, repeats: int = 5, kv_dtype: torch.dtype = torch.float32) -> float:
    """Seconds of execution.attention over `cfg.n_layers` layers of an n_ctx-token cache (T query tokens,
    a causal chain), cold caches as in a real step: every layer has its own K/V. Runs the
    compiled kernel of kernels.cpu() (as overridden) where the model would, else PyTorch's."""
    from triforce import kernels
    from triforce.caches.base import SlotKV
    from triforce.execution import attention

    L, Hkv, Hq, D = cfg.n_layers, cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    K = torch.randn(L, 1, Hkv, n_ctx + 64, D).to(kv_dtype)
    V = torch.randn(L, 1, Hkv, n_ctx + 64, D).to(kv_dtype)
    q = torch.randn(1, Hq, T, D)
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        for layer in range(L):
            attention(q, SlotKV(K[layer, :, :, :n_ctx], V[layer, :, :, :n_ctx]), ops=kernels.cpu())
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def linear_formats(kern, bandwidth: float, rounds: int = 4, n: int = 4096, k: int = 8192, count: int = 6) -> None:
    """Each weight format through the block kernel (linear_quant, fp32 arithmetic) and, where it applies, the
    integer kernel (linear_packed, 16 rows interleaved): `count` random n x k matrices in turn (more bytes
    than any cache holds, so read from DRAM), 1 and 5 rows of x, best of `rounds`."""
    import numpy as np

    from triforce.ggml_blocks import FORMATS, pack_rows, packable, random_blocks

    rng = np.random.default_rng(0)
    print(f"| format | kernel | rows of x | ms per {n} x {k} | G weights/s | GB/s (of {bandwidth / 1e9:.0f}) |")
    print("|---|---|---|---|---|---|")
    for qtype, (name, _, _) in FORMATS.items():
        mats = [random_blocks(qtype, n, k, rng) for _ in range(count)]
        packed = [pack_rows(m) for m in mats] if packable(mats[0]) else None
        for rows in (1, 5):
            x = torch.randn(rows, k)
            runs = [("block", lambda m, i: kern.linear_quant(x, [m.raw], [qtype]))]
            if packed is not None:
                runs.append(("integer", lambda m, i: kern.linear_packed(x, [packed[i]], [qtype], [n])))
            for label, fn in runs:
                best = float("inf")
                for _ in range(rounds):
                    t = time.perf_counter()
                    for i, m in enumerate(mats):
                        fn(m, i)
                    best = min(best, (time.perf_counter() - t) / count)
                nbytes = mats[0].nbytes
                print(f"| {name} | {label} | {rows} | {best * 1e3:.2f} | {n * k / best / 1e9:.1f} | "
                      f"{nbytes / best / 1e9:.1f} ({nbytes / best / bandwidth:.0%}) |", flush=True)


def random_quant_layers(H: int, S: int, D: int, layers: int) -> list[tuple[torch.Tensor, ...]]:
    """`layers` layers of random int8-cache planes as quant_attention takes them, S (a multiple of GROUP_K) tokens
    of H KV heads: (k_hi, k_lo, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero) each (the 4-bit reading passes
    empty lower planes instead)."""
    from triforce.caches.quant_codes import GROUP_K

    def planes():
        return torch.randint(0, 256, (H, S, D // 2), dtype=torch.uint8)

    return [(planes(), planes(), (torch.rand(H, S // GROUP_K, D) * 0.05).half(), torch.randn(H, S // GROUP_K, D).half(),
             planes(), planes(), (torch.rand(H, S, D // 32) * 0.05).half(), torch.randn(H, S, D // 32).half())
            for _ in range(layers)]


def quant_attention_alone(model, contexts: list[int], bandwidth: float, layers: int = 40, rounds: int = 4) -> None:
    """The compiled quant_attention alone, the model's KV heads and head dim, over `layers` layers' worth of
    random planes in turn (more than an L3 cache holds: the planes come from memory, as in a step), for a
    decode step (g rows) and a 5-token verification (5 g rows), 8-bit and 4-bit readings: ms per layer and the
    bandwidth reached (fastest of `rounds` passes)."""
    from triforce.caches.quant_codes import GROUP_K

    ops = model.backend.ops
    if ops is None or not hasattr(ops, "quant_attention"):
        print("quant_attention: no compiled kernels on this machine")
        return
    c = model.cfg
    H, D, g = c.n_kv_heads, c.head_dim, c.n_heads // c.n_kv_heads
    print("| context | rows | reading | ms per layer | GB/s | bytes per layer |")
    print("|---|---|---|---|---|---|")
    for S in contexts:
        S = S // GROUP_K * GROUP_K
        data = random_quant_layers(H, S, D, layers)
        fk, fv, none = torch.randn(H, 100, D).half(), torch.randn(H, 100, D).half(), torch.empty(0, dtype=torch.uint8)
        for T in (1, 5):
            q, lim = torch.randn(H, g * T, D), torch.full((g * T,), S, dtype=torch.long)
            fmask = torch.ones(T, 100, dtype=torch.bool)
            for bits in (8, 4):
                best = float("inf")
                for _ in range(rounds):
                    t = time.perf_counter()
                    for k_hi, k_lo, ks, kz, v_hi, v_lo, vs, vz in data:
                        lo = (k_lo, v_lo) if bits == 8 else (none, none)
                        ops.quant_attention(q, k_hi, lo[0], ks, kz, v_hi, lo[1], vs, vz, lim, fk, fv, fmask, T,
                                            D ** -0.5)
                    best = min(best, (time.perf_counter() - t) / layers)
                nbytes = H * S * D * bits // 4 + H * (S // GROUP_K) * D * 4 + H * S * (D // 32) * 4
                print(f"| {S} | {g * T} | int{bits} | {best * 1e3:.3f} | {nbytes / best / 1e9:.1f} "
                      f"({nbytes / best / bandwidth:.0%} of {bandwidth / 1e9:.0f}) | {nbytes / 1e6:.1f} MB |", flush=True)
        del data


def kernel_ab(model, contexts: list[int], bandwidth: float, steps: int) -> None:
    """The compiled CPU kernels against PyTorch's operations, alternating in one process: attention
    alone (decode_attention vs PyTorch's flash kernel), and whole steps (all kernels vs none)."""
    from triforce import kernels
    from triforce.bench.hardware import floor_seconds

    kern = kernels.cpu()
    if kern is None:
        print("the compiled CPU kernels are not available here")
        return
    print("| context | T | attention, kernel ms | attention, PyTorch ms | step, kernels ms | step, PyTorch ms | floor ms |")
    print("|---|---|---|---|---|---|---|")
    for n in contexts:
        for T in (1, 2, 3, 7):
            att, step = {}, {}
            for name, k in (("kernel", kern), ("torch", None), ("kernel2", kern), ("torch2", None)):
                with kernels.override(k):
                    att[name] = time_attention(n, T, model.cfg, kv_dtype=model.kv_dtype) * 1e3
                    if T == 1:
                        step[name] = time_ours(model, n, steps) * 1e3
            s = (f"{min(step['kernel'], step['kernel2']):.1f} | {min(step['torch'], step['torch2']):.1f} | "
                 f"{floor_seconds(model, n, bandwidth) * 1e3:.1f}") if T == 1 else "- | - | -"
            print(f"| {n} | {T} | {min(att['kernel'], att['kernel2']):.1f} | {min(att['torch'], att['torch2']):.1f} "
                  f"| {s} |", flush=True)


def draft_weights_ab(model, contexts: list[int], budget: int, steps: int) -> None:
    """Forwards of 1, 3, 5 tokens on a retrieval-sized cache (`budget` tokens kept of each context):
    the fp32 weights against the bf16 draft copy (`--draft-weights`), alternating in one process."""
    from triforce.caches import RetrievalCache
    from triforce.speculation.kinds import draft_weights_model

    draft = draft_weights_model(model)
    if draft is model:
        print("no bf16 draft copy for this model: its weights are kept quantized (fewer bytes than bf16 already; "
              "--weights fp32 has one), or the compiled CPU kernels are not available here")
        return
    c = model.cfg
    print("| context | budget | k | fp32 weights ms | bf16 draft weights ms | ratio |")
    print("|---|---|---|---|---|---|")
    for n in contexts:
        cache = RetrievalCache(c.n_layers, c.n_kv_heads, c.head_dim, budget=budget, max_new=64,
                               dtype=model.kv_dtype, device=model.device)
        cache.k.normal_()
        cache.v.normal_()
        cache.base, cache.built_at, cache.length = budget, n, n
        for k in (1, 3, 5):
            a = min(time_forwards(model, cache, n, k, steps), time_forwards(model, cache, n, k, steps))
            b = min(time_forwards(draft, cache, n, k, steps), time_forwards(draft, cache, n, k, steps))
            print(f"| {n} | {budget} | {k} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x |", flush=True)


def kv_ab(model, contexts: list[int], steps: int, rounds: int = 3) -> None:
    """The target's decode step and 5-token verification over an fp16 and an int8 cache, and a kv4 draft step
    over the int8 cache's upper planes, alternating in one process (`rounds` times; the fastest median of
    each is kept: on a shared machine the others' load only ever adds)."""
    from triforce.bench.hardware import kv_bytes_per_token

    print("| context | fp16 step ms | int8 step ms | fp16 5-token verify ms | int8 5-token verify ms | "
          "kv4 draft step ms | KV bytes/token fp16 / int8 |")
    print("|---|---|---|---|---|---|---|")
    for n in contexts:
        best: dict[str, float] = {}
        for _ in range(rounds):
            for kv in ("fp16", "int8"):
                model.kv_dtype = kv
                for name, t in ((f"{kv} step", time_ours(model, n, steps)), (f"{kv} verify", time_ours(model, n, steps, 5))):
                    best[name] = min(best.get(name, float("inf")), t)
            best["kv4"] = min(best.get("kv4", float("inf")), time_kv4(model, n, steps))
        model.kv_dtype = "fp16"
        b16 = kv_bytes_per_token(model)
        model.kv_dtype = "int8"
        b8 = kv_bytes_per_token(model)
        ms = {k: f"{v * 1e3:.1f}" for k, v in best.items()}
        print(f"| {n} | {ms['fp16 step']} | {ms['int8 step']} | {ms['fp16 verify']} | {ms['int8 verify']} | {ms['kv4']} "
              f"| {b16} / {b8} |", flush=True)


MODES = ("kernels", "draft-weights", "kv", "quant-attention", "linear-formats")


def main(argv=None) -> None:
    from triforce.bench.hardware import measure_bandwidth
    from triforce.loading import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--contexts", default="8192,32768", help="comma-separated context lengths")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per context (median)")
    ap.add_argument("--model", default=None, help="model (default: embedded SmolLM2-135M, long-context profile)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    ap.add_argument("--budget", type=int, default=1024, help="retrieval budget for draft-weights (default 1024)")
    ap.add_argument("--kv-dtype", default=None, help="KV cache dtype of the timed caches (default: the model's)")
    ap.add_argument("--weights", default="native", help="how the weights are held: native, bf16 or fp32")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    bw = measure_bandwidth()
    model = load_model(args.model, progress=False, kv_dtype=args.kv_dtype, weights=args.weights).model
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, read bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    if args.mode == "kernels":
        kernel_ab(model, contexts, bw, args.steps)
    elif args.mode == "kv":
        kv_ab(model, contexts, args.steps)
    elif args.mode == "quant-attention":
        quant_attention_alone(model, contexts, bw)
    elif args.mode == "linear-formats":
        if model.backend.ops is None:
            ap.error("linear-formats times the compiled kernels, and they are off here (TRIFORCE_ISA)")
        linear_formats(model.backend.ops, bw)
    else:
        draft_weights_ab(model, contexts, args.budget, args.steps)


if __name__ == "__main__":
    main()
