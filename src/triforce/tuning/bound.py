"""What speedup can a drafter give here, and what would it need for a target speedup?

    triforce tune --context-length 32000 --temperature 0.6 --kv4 --json > tune.json
    python -m triforce.tuning.bound tune.json [--target 2] [--drafter ngram:0:0.178 ...]

Reads `triforce tune --json`'s measurements on this machine (the full cache's forward of k tokens, each
drafting level's forward and the full level's per-token acceptance of its drafts) and, with the i.i.d.
acceptance model `tune` predicts with (speculation/cost_model.py: a round of g drafts yields (1 - a^(g+1)) / (1 - a)
tokens), prints for every drafter as the only level under `full`:

- the best speedup over `ar` it can give at its measured cost (best g);
- the ceiling with a free draft (cost 0: the verification alone bounds it);
- the per-token acceptance it would need at its measured cost for --target, and the draft cost (ms) it would
  need at its measured acceptance ("never" where even a free draft falls short);
- with --verification-at-step, the same with every verification priced at one `ar` step (its memory floor).

A deeper stack (a drafter under the drafting level) only lowers the drafting level's cost per token; it cannot
raise the full level's acceptance of its drafts, so the free-draft ceiling bounds it too. --drafter adds rows
measured elsewhere (name:ms_per_forward:acceptance), e.g. the n-gram drafter's acceptance from a bench row.
"""
from __future__ import annotations

import argparse
import json

from triforce.speculation.cost_model import predict_two_level_ms


def speedup(ar_ms: float, verify_ms: dict[int, float], draft_ms: float, a: float, gamma: int) -> float:
    """ar ms/token over a two-level chain's: gamma drafts at draft_ms each, one verification of gamma + 1."""
    return ar_ms / predict_two_level_ms(verify_ms, draft_ms, a, gamma)


def best(ar_ms, verify_ms, draft_ms, a) -> tuple[float, int]:
    return max((speedup(ar_ms, verify_ms, draft_ms, a, g), g) for g in range(1, max(verify_ms)))


def needed_acceptance(ar_ms, verify_ms, draft_ms, target) -> float | None:
    """The smallest per-token acceptance reaching target at this draft cost (None: not even a = 1)."""
    if best(ar_ms, verify_ms, draft_ms, 1.0)[0] < target:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if best(ar_ms, verify_ms, draft_ms, mid)[0] >= target else (mid, hi)
    return hi


def needed_cost(ar_ms, verify_ms, a, target) -> float | None:
    """The largest draft ms per forward reaching target at acceptance a (None: not even a free draft)."""
    if best(ar_ms, verify_ms, 0.0, a)[0] < target:
        return None
    lo, hi = 0.0, ar_ms
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best(ar_ms, verify_ms, mid, a)[0] >= target else (lo, mid)
    return lo


def drafters(tune: dict, extra: list[str]) -> list[tuple[str, float, float]]:
    """(name, ms per draft forward, per-token acceptance by the full level) of each measured drafter."""
    rows = [(f"retrieval:{b}", float(tune["cost_retrieval_ms"][str(b)]["1"]), float(acc["full"]))
            for b, acc in ((int(b), acc) for b, acc in tune["acceptance"].items())]
    if "quantspec" in tune:
        rows.append(("kv4", float(tune["quantspec"]["cost_kv4_ms"]), float(tune["quantspec"]["acceptance"])))
    for d in extra:
        try:
            name, ms, a = d.rsplit(":", 2)
            rows.append((name, float(ms), float(a)))
        except ValueError:
            raise ValueError(f"--drafter {d!r}: expected name:ms_per_forward:acceptance, e.g. ngram:0:0.178") from None
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("tune_json", help="the output of `triforce tune --json` (with --kv4 for the kv4 row)")
    ap.add_argument("--target", type=float, default=2.0, help="speedup over ar to price (default 2)")
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME:MS:ACCEPTANCE",
                    help="another drafter measured elsewhere (repeatable)")
    ap.add_argument("--verification-at-step", action="store_true",
                    help="price every verification (of up to the largest measured k tokens) at one ar step, its "
                         "memory floor (it reads what a step reads): what the drafters would need if verifying "
                         "were free of arithmetic")
    args = ap.parse_args(argv)
    try:
        with open(args.tune_json) as f:
            tune = json.load(f)
        verify = {int(k): float(v) for k, v in tune["cost_full_ms"].items()}
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"{args.tune_json}: not the JSON of `triforce tune --json` ({e})")
    try:
        ar, rows = verify[1], drafters(tune, args.drafter)
    except (ValueError, KeyError) as e:
        ap.error(str(e))
    if args.verification_at_step:
        verify = {k: ar for k in verify}
    print(f"context {tune['context_length']}, T = {tune['temperature']}: ar {ar:.2f} ms/token; verification of k "
          f"tokens / ar step: " + ", ".join(f"{k}: {v / ar:.2f}" for k, v in sorted(verify.items()) if k > 1))
    print(f"\n| drafter | ms / draft forward (x ar step) | acceptance | best speedup (gamma) | free-draft ceiling | "
          f"acceptance needed for {args.target:g}x | draft ms needed for {args.target:g}x |")
    print("|---|---|---|---|---|---|---|")
    for name, ms, a in rows:
        s, g = best(ar, verify, ms, a)
        ceiling, _ = best(ar, verify, 0.0, a)
        na, nc = needed_acceptance(ar, verify, ms, args.target), needed_cost(ar, verify, a, args.target)
        print(f"| {name} | {ms:.2f} ({ms / ar:.2f}) | {a:.3f} | {s:.2f}x ({g}) | {ceiling:.2f}x | "
              f"{'never' if na is None else f'{na:.3f}'} | {'never' if nc is None else f'{nc:.2f}'} |")
    if "best" in tune:
        b = tune["best"]
        print(f"\ntune's best three-level prediction (ngram, retrieval:{b['budget']}, full; gamma {b['gamma']}, "
              f"gamma-draft {b['gamma_draft']}): {b['predicted_ms_per_token']} ms/token = "
              f"{ar / b['predicted_ms_per_token']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
