"""Every method on the same long prompts, in one process: ms/token, speedup over `ar`, acceptance.

    triforce bench --context-lengths 16384 --methods ar,triforce,retrieval,ngram --temperatures 0,0.6

The prompt's prefill is done once per prompt and shared by all methods (each run rolls the full
cache back to it). At temperature 0 each method's tokens are compared with `ar`'s (`lossless`).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch


def run_bench(loaded, context_lengths, methods, temperatures, n_prompts, max_new_tokens, config, seed=0,
              progress=True, draft_model=None, log=print, bandwidth=None, peers=()) -> list[dict]:
    from tqdm.auto import tqdm

    from ..corpus import demo_tokens
    from ..generate import generate
    from ..sampling import SamplingParams
    from ..spec.methods import SharedPrefill

    from .hardware import floor_seconds

    model, tok = loaded.model, loaded.tokenizer
    rows = []
    if "ar" not in methods:
        methods = ["ar"] + list(methods)
    for n_ctx in context_lengths:
        if n_ctx + max_new_tokens + config.gamma + 2 > model.cfg.max_context:
            log(f"skip context {n_ctx}: with {max_new_tokens} new tokens it exceeds the model's context")
            continue
        floor_ms = round(floor_seconds(model, n_ctx, bandwidth) * 1e3, 1) if bandwidth else None
        for pi in range(n_prompts):
            prompt = demo_tokens(tok, n_ctx, offset_chars=pi * 200_000)
            t = time.perf_counter()
            shared = SharedPrefill(model, prompt, n_ctx + max_new_tokens + config.gamma + 2, config.prefill_chunk,
                                   progress)
            log(f"context {n_ctx}, prompt {pi}: prefill {time.perf_counter() - t:.1f} s")
            for temp in temperatures:
                params = SamplingParams(temperature=temp, top_p=0.9 if temp > 0 else 1.0)
                ar_tokens, ar_ms = None, None
                for method in tqdm(methods, desc=f"{n_ctx} T={temp}", leave=False, disable=not progress):
                    res = generate(model, prompt, max_new_tokens, params, method=method, config=config,
                                   draft_model=draft_model, seed=seed + pi, shared_prefill=shared)
                    ms = res.decode_seconds / len(res.tokens) * 1e3
                    if method == "ar":
                        ar_tokens, ar_ms = res.tokens, ms
                    levels = {lvl["level"]: lvl.get("acceptance_rate") for lvl in res.stats["levels"]
                              if lvl.get("role") == "verify"}
                    tpr = {lvl["level"]: lvl.get("tokens_per_round") for lvl in res.stats["levels"]
                           if lvl.get("role") == "verify"}
                    row = {"method": method, "context_length": n_ctx, "prompt": pi, "temperature": temp,
                           "ms_per_token": round(ms, 2), "speedup_vs_ar": round(ar_ms / ms, 3),
                           "ar_floor_ms": floor_ms,
                           "lossless": (res.tokens == ar_tokens) if temp == 0 else None,
                           "acceptance": levels, "tokens_per_round": tpr, "tokens": len(res.tokens),
                           "notes": res.stats.get("notes", []), "levels": res.stats["levels"]}
                    rows.append(row)
                    log(f"  T={temp} {method:10s} {ms:8.1f} ms/token  x{ar_ms / ms:.2f}  accept {levels}"
                        + (f"  lossless={row['lossless']}" if temp == 0 else ""))
            del shared
        if "transformers" in peers:
            from .decode_step import time_transformers

            hf_ms = time_transformers(loaded.hf_dir, model.cfg.rope.theta, n_ctx, 8) * 1e3
            ar_rows = [r for r in rows if r["method"] == "ar" and r["context_length"] == n_ctx]
            for temp in temperatures:
                ar_ms = statistics.median(r["ms_per_token"] for r in ar_rows if r["temperature"] == temp)
                rows.append({"method": "transformers", "context_length": n_ctx, "prompt": 0, "temperature": temp,
                             "ms_per_token": round(hf_ms, 2), "speedup_vs_ar": round(ar_ms / hf_ms, 3),
                             "ar_floor_ms": floor_ms, "lossless": None, "acceptance": {},
                             "tokens_per_round": {}, "tokens": 0, "levels": [],
                             "notes": ["transformers generate, greedy decode steps over a KV cache of this length "
                                       "(random contents), prefill excluded; the same figure for every temperature"]})
            log(f"  transformers generate {hf_ms:8.1f} ms/token")
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Median over prompts per (context, temperature, method)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["context_length"], r["temperature"], r["method"]), []).append(r)
    out = []
    for (n, temp, method), rs in groups.items():
        out.append({"method": method, "context_length": n, "temperature": temp,
                    "ms_per_token": round(statistics.median(r["ms_per_token"] for r in rs), 2),
                    "speedup_vs_ar": round(statistics.median(r["speedup_vs_ar"] for r in rs), 3),
                    "lossless": None if any(r["lossless"] is None for r in rs) else all(r["lossless"] for r in rs),
                    "acceptance": rs[0]["acceptance"] if len(rs) == 1 else
                    {k: round(statistics.median(r["acceptance"][k] for r in rs if r["acceptance"].get(k) is not None), 3)
                     for k in rs[0]["acceptance"] if any(r["acceptance"].get(k) is not None for r in rs)},
                    "ar_floor_ms": rs[0].get("ar_floor_ms"), "prompts": len(rs)})
    return out


def markdown(summary: list[dict]) -> str:
    lines = ["| context | T | method | ms/token | speedup vs ar | lossless | acceptance (per level) | ar floor ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary:
        acc = ", ".join(f"{k} {v}" for k, v in r["acceptance"].items()) or "-"
        lossless = "-" if r["lossless"] is None else ("yes" if r["lossless"] else "**NO**")
        lines.append(f"| {r['context_length']} | {r['temperature']} | {r['method']} | {r['ms_per_token']} | "
                     f"{r['speedup_vs_ar']}x | {lossless} | {acc} | {r.get('ar_floor_ms') or '-'} |")
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, rows: list[dict], summary: list[dict], meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "rows": summary, "runs": rows}, indent=1))
    (out_dir / "results.md").write_text(markdown(summary))


def main(args) -> int:
    from ..loading import load_model
    from .hardware import measure_bandwidth

    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, rope_theta=args.rope_theta, max_context=args.max_context, dtype=dtype,
                        device=args.device, cache_dir=args.cache_dir, progress=not args.quiet)
    from ..cli import spec_config_from_args

    config, draft_path = spec_config_from_args(args)
    draft_model = load_model(draft_path, dtype=dtype, device=args.device, cache_dir=args.cache_dir,
                             max_context=loaded.config.max_context, progress=False).model if draft_path else None
    bandwidth = measure_bandwidth()
    meta = {"model": loaded.source, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "bandwidth_gb_s": round(bandwidth / 1e9, 1), "config": config.__dict__,
            "max_new_tokens": args.max_new_tokens, "command": " ".join(sys.argv)}
    log = (lambda *a, **k: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    rows = run_bench(loaded, [int(x) for x in args.context_lengths.split(",")], args.methods.split(","),
                     [float(x) for x in args.temperatures.split(",")], args.prompts, args.max_new_tokens, config,
                     seed=args.seed, progress=not args.quiet, draft_model=draft_model, log=log, bandwidth=bandwidth,
                     peers=[p for p in args.peers.split(",") if p])
    summary = summarize(rows)
    write_outputs(Path(args.out), rows, summary, meta)
    print(markdown(summary))
    return 0
