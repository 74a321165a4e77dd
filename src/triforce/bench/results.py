"""`triforce bench`'s results: the rows summarized per method and context, as Markdown tables and a plot, and
written to the output folder (results.json, results.md, speedup.png)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..errors import TriforceError
from ..storage import atomic_file, atomic_write, remove_stale_temporaries


def summarize(rows: list[dict]) -> list[dict]:
    """Median over prompts per (context, temperature, method). Every ratio (the speedups over ar and over the
    reference, the peers' ar ratio) is the median of the per-prompt ratios, each against its own prompt's
    baseline, not a ratio of the medians: with several prompts the two differ, and only the first says how a
    method did against the baseline it ran beside."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["context_length"], r["temperature"], r["method"]), []).append(r)

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    def cell(r) -> tuple:
        return r["context_length"], r.get("prompt"), r["temperature"]

    reference_ms = {cell(r): r["ms_per_token"] for r in rows if r.get("reference")}  # the reference ar, if run
    ar_ms = {cell(r): r["ms_per_token"] for r in rows if r["method"] == "ar" and not r.get("reference")}

    def ratios(rs, num: dict | None = None, den: dict | None = None, digits: int = 3):
        """The median over rs of num / den, per prompt; a dict stands for that prompt's baseline's ms/token."""
        values = [(num[cell(r)] if num else r["ms_per_token"]) / (den[cell(r)] if den else r["ms_per_token"])
                  for r in rs if r["ms_per_token"] and (num or den).get(cell(r))]
        return round(statistics.median(values), digits) if values else None

    out = []
    for (n, temp, method), rs in groups.items():
        names = [lvl["level"] for lvl in rs[0]["levels"] if "ms_per_forward" in lvl]
        ms = med(r["ms_per_token"] for r in rs)
        vs_reference = {} if not any(k[0] == n and k[2] == temp for k in reference_ms) else {
            "speedup_vs_reference": ratios(rs, num=reference_ms), "reference": bool(rs[0].get("reference"))}
        level_cost = {name: {"ms_per_forward": med(lvl.get("ms_per_forward") for r in rs for lvl in r["levels"]
                                                   if lvl["level"] == name),
                             "floor_ms": next(lvl.get("floor_ms") for lvl in rs[0]["levels"] if lvl["level"] == name)}
                      for name in names}
        peer = {}
        if any("prefill_tokens_per_s" in r for r in rs):  # the llama.cpp peers
            peer = {"prefill_tokens_per_s": med(r.get("prefill_tokens_per_s") for r in rs),
                    "ar_faster_by": ratios(rs, den=ar_ms, digits=2),
                    "ours_prefill_tokens_per_s": med(r.get("ours_prefill_tokens_per_s") for r in rs),
                    "notes": list(dict.fromkeys(note for r in rs for note in r["notes"]))}
        out.append({"method": method, "context_length": n, "temperature": temp,
                    "ms_per_token": ms,
                    "speedup_vs_ar": med(r["speedup_vs_ar"] for r in rs), **vs_reference,
                    "lossless": None if any(r["lossless"] is None for r in rs) else all(r["lossless"] for r in rs),
                    "agree_with_ar": med(r.get("agree_with_ar") for r in rs),
                    "acceptance": {k: med(r["acceptance"].get(k) for r in rs) for k in rs[0]["acceptance"]},
                    "tokens_per_round": {k: med((r.get("tokens_per_round") or {}).get(k) for r in rs)
                                         for k in rs[0].get("tokens_per_round") or {}},
                    "shortcut": ({k: med(r["shortcut"][k] for r in rs) for k in ("rounds_direct", "rounds")}
                                 if all(r.get("shortcut") for r in rs) else None),
                    "level_cost": level_cost, "floor_ms": rs[0].get("floor_ms"), "prompts": len(rs),
                    "notes": list(dict.fromkeys(note for r in rs for note in r["notes"])),
                    "tuned": rs[0].get("tuned"), **peer})
    return out


def _of_prompts(summary: list[dict]) -> tuple[str, str]:
    """What a summary's ms/token and ratio columns are, said in their headers where several prompts make a cell."""
    n = max((r.get("prompts") or 1 for r in summary), default=1)
    return ((f" (median of {n} prompts)", " (median of per-prompt ratios)") if n > 1 else ("", ""))


def markdown(summary: list[dict]) -> str:
    reference = next((r["method"] for r in summary if r.get("reference")), None)
    of_ms, of_ratios = _of_prompts(summary)
    lines = [f"| context | T | method | ms/token{of_ms} | speedup vs ar{of_ratios} | "
             + (f"speedup vs {reference}{of_ratios} | " if reference else "")
             + "lossless | acceptance (per level) | tokens per round (per level) | ms per forward / floor (per level) "
             "| floor ms |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if reference else "")]
    for r in summary:
        acc = ", ".join(f"{k} {v}" for k, v in r["acceptance"].items()) or "-"
        tpr = ", ".join(f"{k} {v}" for k, v in (r.get("tokens_per_round") or {}).items()) or "-"
        if r.get("shortcut"):
            tpr += f" ({r['shortcut']['rounds_direct']:g} of {r['shortcut']['rounds']:g} rounds direct)"
        cost = ", ".join(f"{k} {c['ms_per_forward']}/{c['floor_ms'] or '-'}" for k, c in r.get("level_cost", {}).items()) or "-"
        if r["lossless"] is not None:
            lossless = "yes" if r["lossless"] else "**NO**"
        elif r.get("agree_with_ar") is not None:
            lossless = f"n/a ({int(r['agree_with_ar'])} tokens agree)"
        else:
            lossless = "-"
        speed = f"{r['speedup_vs_ar']}x" if r["speedup_vs_ar"] is not None else "-"
        method = r["method"] + (f" (tuned: {r['tuned']})" if r.get("tuned") else "")
        vs_ref = ""
        if reference:
            vs_ref = f"{r['speedup_vs_reference']}x | " if r.get("speedup_vs_reference") is not None else "- | "
        lines.append(f"| {r['context_length']} | {r['temperature']} | {method} | {_dash(r['ms_per_token'])} | "
                     f"{speed} | {vs_ref}{lossless} | {acc} | {tpr} | {cost} | {r.get('floor_ms') or '-'} |")
    return "\n".join(lines) + "\n" + peers_markdown(summary)


def cells_markdown(rows: list[dict]) -> str:
    """Per (context, prompt, temperature) cell: every method's speedup over the cell's bracketed `ar`, and the
    adaptive stack's ms/token against the cell's best fixed stack (every other row of ours, `ar` included)."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("ms_per_token") and not r.get("reference") and "prefill_tokens_per_s" not in r:
            cells.setdefault((r["context_length"], r.get("prompt_name", r["prompt"]), r["temperature"]), []).append(r)
    if not any("adaptive" in r for rs in cells.values() for r in rs):
        return ""
    lines = ["", "Per prompt (speedups over the bracketed `ar` of the same cell; the adaptive stack against the "
             "fastest fixed stack of the cell, `ar` included):", "",
             "| context | prompt | T | speedup per method | adaptive: x ar | best fixed | adaptive / best fixed | routes run "
             "(rounds) |", "|---|---|---|---|---|---|---|---|"]
    for (n, name, temp), rs in cells.items():
        adaptive = [r for r in rs if "adaptive" in r]
        fixed = [r for r in rs if "adaptive" not in r]
        each = ", ".join(f"{r['method']} {r['speedup_vs_ar']}x" for r in rs)
        for a in adaptive:
            best = min(fixed, key=lambda r: r["ms_per_token"]) if fixed else None
            vs = f"{round(best['ms_per_token'] / a['ms_per_token'], 3)}" if best else "-"
            routes = ", ".join(f"{k} ({v})" for k, v in a["adaptive"]["routes"].items())
            lines.append(f"| {n} | {name} | {temp} | {each} | {a['speedup_vs_ar']}x | "
                         f"{best['method'] if best else '-'} | {vs} | {routes} |")
    return "\n".join(lines) + "\n"


def _dash(value) -> str:
    return "-" if value is None else str(value)


def peers_markdown(summary: list[dict]) -> str:
    """The llama.cpp peers' prefill and decode beside ours ('' without llama.cpp rows)."""
    rows = [r for r in summary if "prefill_tokens_per_s" in r]
    if not rows:
        return ""
    ar = {(r["context_length"], r["temperature"]): r["ms_per_token"] for r in summary if r["method"] == "ar"}
    of_ms, of_ratios = _of_prompts(summary)
    lines = ["", "llama.cpp on the same GGUF file and prompts (prefill: the prompt but its last token; decode: "
             "ms per generated token after the prefill):", "",
             f"| context | T | peer | prefill tokens/s | our prefill tokens/s | decode ms/token{of_ms} | our ar "
             f"ms/token{of_ms} | our ar faster by{of_ratios} | greedy agreement with ar | notes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ar_ms = ar.get((r["context_length"], r["temperature"]))
        ratio = f"{r['ar_faster_by']}x" if r.get("ar_faster_by") is not None else "-"
        agree = f"{int(r['agree_with_ar'])} tokens" if r.get("agree_with_ar") is not None else "-"
        lines.append(f"| {r['context_length']} | {r['temperature']} | {r['method']} | "
                     f"{_dash(r['prefill_tokens_per_s'])} | {_dash(r['ours_prefill_tokens_per_s'])} | "
                     f"{_dash(r['ms_per_token'])} | {_dash(ar_ms)} | {ratio} | {agree} | "
                     f"{r['notes'][-1] if r.get('notes') else '-'} |")  # the check, or why it did not run
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> bool:
    """speedup.png: speedup over ar by context length, one panel per temperature. False if
    matplotlib is missing."""
    try:
        import matplotlib  # start-up: matplotlib is 0.5 s to import, only the plot needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # start-up: as above
    except ImportError:
        return False
    temps = sorted({r["temperature"] for r in summary})
    prefill = _prefill_points(summary)
    fig, axes = plt.subplots(1, len(temps) + bool(prefill), figsize=(5.5 * (len(temps) + bool(prefill)), 4),
                             squeeze=False)
    for ax in axes[0][1:len(temps)]:
        ax.sharey(axes[0][0])
    colors = {}  # method -> its line colour, for the prefill panel
    for ax, temp in zip(axes[0], temps):
        rs = [r for r in summary if r["temperature"] == temp and r["speedup_vs_ar"] is not None]
        for method in dict.fromkeys(r["method"] for r in rs):
            pts = sorted((r["context_length"], r["speedup_vs_ar"]) for r in rs if r["method"] == method)
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method,
                              linestyle="--" if method.startswith(("transformers", "llama.cpp")) else "-")
            colors.setdefault(method, line.get_color())
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["context_length"] for r in rs}))
        ax.set_xticklabels([f"{n / 1000:.0f}K" for n in sorted({r["context_length"] for r in rs})])
        ax.set_title(f"temperature {temp}")
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over our ar (ms/token ratio)")
    axes[0][len(temps) - 1].legend(fontsize=8)
    if prefill:
        ax = axes[0][-1]
        for name, pts in prefill.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors.get("ar" if name == "ours" else name),
                    label="ours (shared by every method)" if name == "ours" else name,
                    linestyle="-" if name == "ours" else "--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p[0] for pts in prefill.values() for p in pts}))
        ax.set_xticklabels([f"{n / 1000:.0f}K" for n in sorted({p[0] for pts in prefill.values() for p in pts})])
        ax.set_title("prefill (the same prompts)")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("prefill tokens/s")
        ax.set_ylim(bottom=0, top=1.3 * max(p[1] for pts in prefill.values() for p in pts))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _prefill_points(summary: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Prefill tokens/s by context, per llama.cpp peer and ours ("ours": the shared prefill of the
    same prompts), medians over temperatures (each prefill serves them all)."""
    by: dict[str, dict[int, list[float]]] = {}
    for r in summary:
        if "prefill_tokens_per_s" not in r:
            continue
        for name, value in ((r["method"], r["prefill_tokens_per_s"]), ("ours", r.get("ours_prefill_tokens_per_s"))):
            if value is not None:
                by.setdefault(name, {}).setdefault(r["context_length"], []).append(value)
    return {name: sorted((n, statistics.median(v)) for n, v in ctx.items()) for name, ctx in by.items()}


def prefill_markdown(meta: dict) -> str:
    """Each prompt's prefill (the time to its first token, less that token's forward): seconds, its FLOPs
    (bench.hardware.prefill_flops) and their rate against the build's measured vector peaks; "" without prefills."""
    prefills = meta.get("prefills") or []
    if not prefills:
        return ""
    peaks = meta.get("vector_peak_gflop_s") or {}
    names = {"fma": "of the FMA peak", "bf16_dot": "of the vdpbf16ps peak"}
    cols = [k for k in ("fma", "bf16_dot") if peaks.get(k)]
    head = "| context | prompt | prefill s | GFLOP | GFLOP/s |" + "".join(f" {names[k]} ({peaks[k]:.0f}) |" for k in cols)
    lines = ["", "Prefill per prompt (every method's run starts from it):", "", head,
             "|" + "---|" * (5 + len(cols))]
    for p in prefills:
        lines.append(f"| {p['context_length']} | {p['prompt_name']} | {p['seconds']:.2f} | {p['gflop']:.0f} | "
                     f"{p['gflop_per_s']:.0f} |" + "".join(f" {p['gflop_per_s'] / peaks[k]:.0%} |" for k in cols))
    return "\n".join(lines) + "\n"


ANSWER_TOKENS = 256  # the answer length of answer_markdown's time to an answer


def answer_markdown(rows: list[dict], meta: dict, tokens: int = ANSWER_TOKENS) -> str:
    """Per (context, prompt, temperature): each method's time to a `tokens`-token answer, its prompt's prefill (ours:
    the shared prefill every method starts from; a peer: its own) plus `tokens` times its measured ms per token. With
    --max-new-tokens equal to `tokens` that is the run's own time; otherwise the decode is scaled from the run's
    rate (said in the heading). "" without prefill times."""
    ours = {(p["context_length"], p["prompt"]): p for p in meta.get("prefills") or []}
    cells: dict[tuple, list[tuple[str, float]]] = {}
    for r in rows:
        if not r.get("ms_per_token") or r.get("reference"):
            continue
        own = ours.get((r["context_length"], r["prompt"]))  # (a peer's rows carry its own prefill, but no prompt name)
        prefill = r.get("prefill_seconds", own and own["seconds"])
        if prefill is None:
            continue
        key = (r["context_length"], own["prompt_name"] if own else r["prompt"], r["temperature"])
        cells.setdefault(key, []).append((r["method"], prefill + tokens * r["ms_per_token"] / 1e3))
    if not cells:
        return ""
    new = meta.get("max_new_tokens")
    how = ("the run's own decode" if new == tokens else
           f"decode at the rate measured over {new} tokens" if new else "decode at the measured rate")
    lines = ["", f"Time to a {tokens}-token answer (the prompt's prefill, then {tokens} tokens; {how}), seconds:", "",
             "| context | prompt | T | per method |", "|---|---|---|---|"]
    for (n, name, temp), ms in cells.items():
        lines.append(f"| {n} | {name} | {temp} | " + ", ".join(f"{m} {s:.1f}" for m, s in ms) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, rows: list[dict], summary: list[dict], meta: dict) -> None:
    """results.json, results.md and speedup.png, each written atomically (a reader never sees a
    half-written file; an interrupted run leaves the previous complete version, and a run killed in
    the middle of a write its temporary, which the next write here removes)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out_dir)
        atomic_write(out_dir / "results.json", json.dumps({"meta": meta, "rows": summary, "runs": rows}, indent=1))
        atomic_write(out_dir / "results.md",
                     markdown(summary) + cells_markdown(rows) + prefill_markdown(meta) + answer_markdown(rows, meta))
        with atomic_file(out_dir / "speedup.png") as tmp:
            plot(summary, tmp)
    except OSError as e:
        raise TriforceError(f"cannot write the results in {out_dir}: {e.strerror or e} (choose another --out)") from e
