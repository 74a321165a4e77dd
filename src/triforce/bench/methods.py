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

from ..errors import TriforceError
from ..storage import atomic_file, atomic_write


def sampling_params(temperature: float):
    """The benchmarks' sampling: greedy at T = 0, else temperature T with top-p 0.9."""
    from ..sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_p=0.9 if temperature > 0 else 1.0)


def level_floor_ms(model, n_ctx: int, config, bandwidth: float | None, level: str) -> float | None:
    """Physical floor of one forward of a level's verifier (named as in the stats: kind[:budget]):
    (weights + the KV it reads) / bandwidth. The drafting levels read the bf16 draft weights where
    the run uses them. None without a bandwidth or for a level without a model of the target."""
    from ..speculation.kinds import drafting_model
    from ..speculation.stack import LevelSpec
    from .hardware import floor_seconds

    spec = LevelSpec.parse(level)
    if not bandwidth or spec.kind not in ("full", "retrieval", "streaming"):
        return None
    if spec.kind == "full":
        m, n = model, n_ctx
    elif spec.kind == "retrieval":
        m, n = drafting_model(model, config), min(n_ctx, (spec.budget or config.budget) + config.recent)
    else:
        m, n = drafting_model(model, config), min(n_ctx, spec.budget or config.streaming_budget)
    return round(floor_seconds(m, n, bandwidth) * 1e3, 1)


def _agreement(tokens: list[int], ref: list[int] | None) -> int | None:
    """Leading tokens equal to the reference."""
    if ref is None:
        return None
    n = 0
    for a, b in zip(tokens, ref):
        if a != b:
            break
        n += 1
    return n


def _row(method, n_ctx, pi, temp, ms, ar_ms, floor_ms, tokens, ar_tokens, *, levels=(), notes=()):
    acc = {lvl["level"]: lvl.get("acceptance_rate") for lvl in levels if lvl.get("role") == "verify"}
    tpr = {lvl["level"]: lvl.get("tokens_per_round") for lvl in levels if lvl.get("role") == "verify"}
    return {"method": method, "context_length": n_ctx, "prompt": pi, "temperature": temp,
            "ms_per_token": round(ms, 2), "speedup_vs_ar": round(ar_ms / ms, 3) if ar_ms else None,
            "floor_ms": floor_ms, "ar_floor_ms": floor_ms,
            # At T=0 an exact engine reproduces ar's tokens; agree_with_ar says where one stops doing so.
            "lossless": (tokens == ar_tokens) if (temp == 0 and tokens is not None) else None,
            "agree_with_ar": _agreement(tokens, ar_tokens) if (temp == 0 and tokens is not None) else None,
            "acceptance": acc, "tokens_per_round": tpr, "tokens": len(tokens) if tokens else 0,
            "notes": list(notes), "levels": list(levels)}


def run_bench(loaded, context_lengths, methods, temperatures, n_prompts, max_new_tokens, config, seed=0,
              progress=True, draft_model=None, log=print, bandwidth=None, peers=(), draft_dir=None,
              prompt_files=(), on_row=None) -> list[dict]:
    """-> one row per (context, prompt, temperature, method); `methods` are method names or StackSpecs
    (a row's method is then the stack's text). `on_row(rows)` is called after each new row (the CLI
    writes the results so far, so an interrupted run keeps its finished rows)."""
    from tqdm.auto import tqdm

    from ..corpus import demo_tokens
    from ..generate import generate
    from ..speculation.decoder import full_capacity
    from ..speculation.stack import StackSpec, method_stack
    from ..speculation.state import PrefilledPrompt
    from . import peers as peer_mod

    model, tok = loaded.model, loaded.tokenizer
    rows = []

    def add(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(rows)

    if "ar" not in methods:
        methods = ["ar"] + list(methods)
    runs = {str(m) if isinstance(m, StackSpec) else m:
            m if isinstance(m, StackSpec) else method_stack(m, config.gamma, config.gamma_draft, config.draft)
            for m in methods}  # name -> stack
    stacks = list(runs.values())
    fitting = []
    for n in context_lengths:
        capacity = max(full_capacity(n, max_new_tokens, st) for st in stacks)
        if capacity <= model.cfg.max_context:
            fitting.append(n)
        else:
            log(f"skip context {n}: with {max_new_tokens} new tokens it exceeds the model's context")
    tf_peer = None
    if peers:
        tf_peer = peer_mod.TransformersPeer(loaded.hf_dir, model.cfg.rope.theta, draft_dir)
    file_tokens = [(str(f), tok(Path(f).read_text(encoding="utf-8"))["input_ids"]) for f in prompt_files]
    warmed = False
    for n_ctx in fitting:
        floor_ms = level_floor_ms(model, n_ctx, config, bandwidth, "full")
        if not file_tokens:  # verse and prose from the plays, a different stretch per prompt
            prompts = [demo_tokens(tok, n_ctx, offset_chars=pi * 200_000) for pi in range(n_prompts)]
        else:
            prompts = []
            for name, ids in file_tokens:
                if len(ids) >= n_ctx:
                    prompts.append(ids[:n_ctx])
                else:
                    log(f"skip {name} at context {n_ctx}: it has only {len(ids)} tokens")
        for pi, prompt in enumerate(prompts):
            t = time.perf_counter()
            shared = PrefilledPrompt(model, prompt, max(full_capacity(n_ctx, max_new_tokens, st) for st in stacks),
                                     config.prefill_chunk, progress)
            log(f"context {n_ctx}, prompt {pi}: prefill {time.perf_counter() - t:.1f} s")
            if not warmed:  # first calls of every code path (kernels, oneDNN, allocator) stay untimed
                for stack in stacks:
                    generate(model, prompt, 4, sampling_params(0.0), stack=stack, config=config,
                             draft_model=draft_model, prefilled=shared)
                warmed = True
            for temp in temperatures:
                params = sampling_params(temp)
                ar_tokens, ar_ms = None, None
                for method, stack in tqdm(runs.items(), desc=f"{n_ctx} T={temp}", leave=False, disable=not progress):
                    res = generate(model, prompt, max_new_tokens, params, stack=stack, config=config,
                                   draft_model=draft_model, seed=seed + pi, prefilled=shared)
                    ms = res.decode_seconds / len(res.tokens) * 1e3
                    if method == "ar":
                        ar_tokens, ar_ms = res.tokens, ms
                    levels = [dict(lvl) for lvl in res.stats["levels"]]
                    for lvl in levels:  # per-level cost of one verification forward beside its floor
                        if lvl.get("role") == "verify" and lvl.get("forwards"):
                            lvl["ms_per_forward"] = round(lvl["seconds"] / lvl["forwards"] * 1e3, 2)
                            lvl["floor_ms"] = level_floor_ms(model, n_ctx, config, bandwidth, lvl["level"])
                    row = _row(method, n_ctx, pi, temp, ms, ar_ms, floor_ms, res.tokens, ar_tokens, levels=levels,
                               notes=res.stats.get("notes", []))
                    add(row)
                    log(f"  T={temp} {method:10s} {ms:8.1f} ms/token  x{ar_ms / ms:.2f}  accept {row['acceptance']}"
                        + (f"  lossless={row['lossless']}" if temp == 0 else ""))
                for peer in peers:
                    if peer == "transformers":
                        continue  # decode steps only, below
                    ms, toks = tf_peer.continue_prompt(prompt, max_new_tokens, temp, seed + pi, peer.split("-")[1])
                    row = _row(peer, n_ctx, pi, temp, ms, ar_ms, floor_ms, toks, ar_tokens,
                               notes=["transformers generate with its own prefill, timed as "
                                      "(t(max_new tokens) - t(1 token)) / (max_new - 1)"])
                    add(row)
                    log(f"  T={temp} {peer:10s} {ms:8.1f} ms/token  x{ar_ms / ms:.2f}"
                        + (f"  lossless={row['lossless']} agree={row['agree_with_ar']}" if temp == 0 else ""))
            del shared
        if "transformers" in peers:
            hf_ms = tf_peer.decode_ms(n_ctx)
            ar_rows = [r for r in rows if r["method"] == "ar" and r["context_length"] == n_ctx]
            for temp in temperatures:
                ar_ms = statistics.median(r["ms_per_token"] for r in ar_rows if r["temperature"] == temp)
                add(_row("transformers", n_ctx, 0, temp, hf_ms, ar_ms, floor_ms, None, None, notes=[
                    "transformers generate, greedy decode steps over a KV cache of this length (random contents), "
                    "prefill excluded; the same figure for every temperature"]))
            log(f"  transformers generate {hf_ms:8.1f} ms/token")
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Median over prompts per (context, temperature, method)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["context_length"], r["temperature"], r["method"]), []).append(r)

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    out = []
    for (n, temp, method), rs in groups.items():
        names = [lvl["level"] for lvl in rs[0]["levels"] if "ms_per_forward" in lvl]
        level_cost = {name: {"ms_per_forward": med(lvl.get("ms_per_forward") for r in rs for lvl in r["levels"]
                                                   if lvl["level"] == name),
                             "floor_ms": next(lvl.get("floor_ms") for lvl in rs[0]["levels"] if lvl["level"] == name)}
                      for name in names}
        out.append({"method": method, "context_length": n, "temperature": temp,
                    "ms_per_token": med(r["ms_per_token"] for r in rs),
                    "speedup_vs_ar": med(r["speedup_vs_ar"] for r in rs),
                    "lossless": None if any(r["lossless"] is None for r in rs) else all(r["lossless"] for r in rs),
                    "agree_with_ar": med(r.get("agree_with_ar") for r in rs),
                    "acceptance": {k: med(r["acceptance"].get(k) for r in rs) for k in rs[0]["acceptance"]},
                    "level_cost": level_cost, "floor_ms": rs[0].get("floor_ms"), "prompts": len(rs)})
    return out


def markdown(summary: list[dict]) -> str:
    lines = ["| context | T | method | ms/token | speedup vs ar | lossless | acceptance (per level) | "
             "ms per forward / floor (per level) | floor ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        acc = ", ".join(f"{k} {v}" for k, v in r["acceptance"].items()) or "-"
        cost = ", ".join(f"{k} {c['ms_per_forward']}/{c['floor_ms'] or '-'}" for k, c in r.get("level_cost", {}).items()) or "-"
        if r["lossless"] is not None:
            lossless = "yes" if r["lossless"] else "**NO**"
        elif r.get("agree_with_ar") is not None:
            lossless = f"n/a ({int(r['agree_with_ar'])} tokens agree)"
        else:
            lossless = "-"
        speed = f"{r['speedup_vs_ar']}x" if r["speedup_vs_ar"] is not None else "-"
        lines.append(f"| {r['context_length']} | {r['temperature']} | {r['method']} | {r['ms_per_token']} | "
                     f"{speed} | {lossless} | {acc} | {cost} | {r.get('floor_ms') or '-'} |")
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> bool:
    """speedup.png: speedup over ar by context length, one panel per temperature. False if
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    temps = sorted({r["temperature"] for r in summary})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False, sharey=True)
    for ax, temp in zip(axes[0], temps):
        rs = [r for r in summary if r["temperature"] == temp and r["speedup_vs_ar"] is not None]
        for method in dict.fromkeys(r["method"] for r in rs):
            pts = sorted((r["context_length"], r["speedup_vs_ar"]) for r in rs if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method,
                    linestyle="--" if method.startswith("transformers") else "-")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["context_length"] for r in rs}))
        ax.set_xticklabels([f"{n / 1000:.0f}K" for n in sorted({r["context_length"] for r in rs})])
        ax.set_title(f"temperature {temp}")
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over our ar (ms/token ratio)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(out_dir: Path, rows: list[dict], summary: list[dict], meta: dict) -> None:
    """results.json, results.md and speedup.png, each written atomically (a reader never sees a
    half-written file; an interrupted run leaves the previous complete version)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(out_dir / "results.json", json.dumps({"meta": meta, "rows": summary, "runs": rows}, indent=1))
        atomic_write(out_dir / "results.md", markdown(summary))
        with atomic_file(out_dir / "speedup.png") as tmp:
            plot(summary, tmp)
    except OSError as e:
        raise TriforceError(f"cannot write the results in {out_dir}: {e.strerror or e} (choose another --out)") from e


def main(args, config, draft_path: str | None, stacks=()) -> int:
    """`triforce bench` (the CLI has parsed and checked the speculation options into config, and
    --stacks into StackSpecs)."""
    from ..loading import load_model
    from . import peers as peer_mod
    from .hardware import measure_bandwidth

    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(peer_mod.PEERS)
    if unknown:
        raise TriforceError(f"unknown peer(s) {', '.join(sorted(unknown))}: choose from {', '.join(peer_mod.PEERS)}")
    for f in args.prompt_file or ():
        if not Path(f).is_file():
            raise TriforceError(f"prompt file not found: {f}")
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, rope_theta=args.rope_theta, max_context=args.max_context, dtype=dtype,
                        device=args.device, cache_dir=args.cache_dir, progress=not args.quiet)
    draft_model = load_model(draft_path, dtype=dtype, device=args.device, cache_dir=args.cache_dir,
                             max_context=loaded.config.max_context, progress=False) if draft_path else None
    log = (lambda *a, **k: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    if "transformers-assisted" in peers and draft_model is None:
        raise TriforceError("--peers transformers-assisted needs --draft PATH: a small model sharing the target's "
                            "tokenizer (no such model for SmolLM2 ships on PyPI)")
    bandwidth = measure_bandwidth()
    meta = {"model": loaded.source, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "bandwidth_gb_s": round(bandwidth / 1e9, 1), "config": config.__dict__,
            "max_new_tokens": args.max_new_tokens, "command": " ".join(sys.argv)}
    out_dir = Path(args.out)
    rows = run_bench(loaded, [int(x) for x in args.context_lengths.split(",")], args.methods.split(",") + list(stacks),
                     [float(x) for x in args.temperatures.split(",")], args.prompts, args.max_new_tokens, config,
                     seed=args.seed, progress=not args.quiet, draft_model=draft_model.model if draft_model else None,
                     log=log, bandwidth=bandwidth, peers=peers, prompt_files=args.prompt_file or (),
                     draft_dir=draft_model.hf_dir if draft_model else None,
                     on_row=lambda rs: write_outputs(out_dir, rs, summarize(rs), meta))
    summary = summarize(rows)
    write_outputs(out_dir, rows, summary, meta)
    print(markdown(summary))
    return 0
