#!/usr/bin/env python
"""The TriForce paper's KV-policy ablation for the middle level, from `triforce bench` results: per policy
(retrieval, streaming, h2o), budget and chunk size, the full level's per-token acceptance and ms/token, as a
markdown table (stdout) and a plot (acceptance and speedup over ar against the budget, one panel pair per
temperature).

    triforce bench --context-lengths 32000 --methods ar --temperatures 0,0.6 --prompts 1 --max-new-tokens 64 \\
        --stacks 'retrieval:256,full@4;streaming:256,full@4;h2o:256,full@4;...' --out abl
    triforce bench ... --chunk-size 16 --stacks 'retrieval:1024,full@4;...' --out abl-c16
    python benchmarks/kv_policy_ablation.py abl/results.json abl-c16/results.json --plot docs/kv_policies.png

Each results.json's chunk size is its run's config (meta), shown for retrieval rows."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

STACK = re.compile(r"^(retrieval|streaming|h2o):(\d+),full\b")


def rows(paths: list[Path]) -> list[dict]:
    out = []
    for p in paths:
        data = json.loads(p.read_text())
        chunk = data.get("meta", {}).get("config", {}).get("chunk_size")
        ar = {(r["context_length"], r["temperature"]): r["ms_per_token"] for r in data["rows"] if r["method"] == "ar"}
        for r in data["rows"]:
            m = STACK.match(r["method"])
            if not m:
                continue
            out.append(dict(policy=m.group(1), budget=int(m.group(2)), chunk=chunk if m.group(1) == "retrieval" else None,
                            context=r["context_length"], temperature=r["temperature"],
                            acceptance=r["acceptance"].get("full"), ms=r["ms_per_token"],
                            ar_ms=ar.get((r["context_length"], r["temperature"])), lossless=r["lossless"]))
    return sorted(out, key=lambda r: (r["context"], r["temperature"], r["policy"], r["chunk"] or 0, r["budget"]))


def table(rs: list[dict]) -> str:
    lines = ["| context | T | policy | chunk | budget | acceptance (full) | ms/token | ar ms/token | speedup | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        speed = f"{r['ar_ms'] / r['ms']:.2f}x" if r["ar_ms"] and r["ms"] else "-"
        lines.append(f"| {r['context']} | {r['temperature']} | {r['policy']} | {r['chunk'] or '-'} | {r['budget']} | "
                     f"{r['acceptance']:.3f} | {r['ms']:.1f} | {r['ar_ms']:.1f} | {speed} | "
                     f"{'yes' if r['lossless'] else 'NO' if r['lossless'] is False else '-'} |")
    return "\n".join(lines) + "\n"


def plot(rs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rs})
    fig, axes = plt.subplots(2, len(temps), figsize=(5.5 * len(temps), 7), squeeze=False)
    for col, temp in enumerate(temps):
        sub = [r for r in rs if r["temperature"] == temp]
        for key in dict.fromkeys((r["policy"], r["chunk"]) for r in sub):
            pts = sorted((r["budget"], r["acceptance"], r["ar_ms"] / r["ms"]) for r in sub if (r["policy"], r["chunk"]) == key)
            label = key[0] + (f" (chunks of {key[1]})" if key[1] else "")
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        ctx = sorted({r["context"] for r in sub})
        axes[0][col].set_title(f"{'/'.join(f'{c // 1000}K' for c in ctx)} context, temperature {temp}")
        axes[0][col].set_ylabel("acceptance by the full level (per token)")
        axes[1][col].set_ylabel("speedup over ar (ms/token ratio)")
        axes[1][col].axhline(1.0, color="grey", linewidth=0.8)
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("drafting cache budget (tokens per layer and KV head)")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="triforce bench results.json files")
    ap.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = ap.parse_args()
    rs = rows(args.results)
    print(table(rs), end="")
    if args.plot:
        plot(rs, args.plot)


if __name__ == "__main__":
    main()
