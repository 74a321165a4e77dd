"""`triforce tune`: pick gamma, gamma-draft and budget for this machine and model (Sequoia's
hardware-aware idea applied to the hierarchy).

    triforce tune --context-length 32768

Measures, on one real prompt of the given length (prefilled once):
- the cost of a forward of k tokens through the full cache, and through retrieval caches of
  each candidate budget (k = 1 .. max gamma + 1), medians of a few repeats;
- the per-token acceptance of each level: the full model accepting the retrieval level's drafts
  (per budget), and the retrieval level accepting the n-gram drafter's, from short triforce runs.
Then predicts ms/token for every (gamma, gamma-draft, budget) with the i.i.d. acceptance model of
speculative decoding (a round of gamma drafts yields (1 - a^(gamma+1)) / (1 - a) tokens) and
prints the best settings as flags. The prediction is a model, not a promise: `--check` (on by default) runs
the best few predicted settings and the defaults for real and records whichever ran fastest.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from ..caches.base import Buildable
from ..corpus import demo_tokens
from ..drafthead.loading import head_for
from ..errors import TriforceError
from ..generate import generate
from ..loading import configure_device, load_model, resolve_dtype
from ..speculation.builder import max_rollback
from ..speculation.cost_model import per_token_acceptance, predict_ms, predict_two_level_ms, tree_ms_per_token
from ..speculation.kinds import BuildContext, KIND_CLASSES, drafting_cache, drafting_model
from ..speculation.stack import LevelSpec, StackSpec
from ..speculation.state import PrefilledPrompt
from ..speculation.tree import best_tree, fixed_tree, tree_value
from ..storage import CacheUnwritable
from . import flags as tuned_flags
from .measure import sampling_params, time_forwards


CHECK_SEEDS = 4  # sampled runs per acceptance probe and per setting in --check (greedy: one)


def probe_seeds(temperature: float, seed: int) -> list[int]:
    """Seeds of an acceptance probe or a check: one greedy run (it is one path), CHECK_SEEDS sampled ones (one sampled
    run's text, and so its acceptance, is one draw: at 32K and T = 0.6 one 96-token probe put the full level's
    acceptance of a budget-8192 level's drafts at 0.886 where a 2-prompt bench saw about 0.84)."""
    return [seed] if temperature <= 0 else [seed + i for i in range(CHECK_SEEDS)]


def pooled_mean_accepted(runs: list[list[dict]]) -> dict[str, float]:
    """Per verifying level, accepted drafts per round over several runs' stats (res.stats["levels"] each)."""
    acc: dict[str, list[int]] = {}
    for levels in runs:
        for x in levels:
            if x.get("role") == "verify" and x.get("rounds"):
                a = acc.setdefault(x["level"], [0, 0])
                a[0] += x["accepted"]
                a[1] += x["rounds"]
    return {name: accepted / rounds for name, (accepted, rounds) in acc.items()}


def two_level_grid(cost_full: dict, draft_ms: float, a: float, max_gamma: int) -> list[dict]:
    """A two-level stack's predicted ms/token for every gamma up to max_gamma, best first (its bottom level drafting
    a token in `draft_ms`, the full level accepting each draft with probability a)."""
    return sorted(({"gamma": g, "predicted_ms_per_token": round(predict_two_level_ms(cost_full, draft_ms, a, g), 2)}
                   for g in range(1, max_gamma + 1)), key=lambda r: r["predicted_ms_per_token"])


def tune_kv4(model, shared, prompt, cost_full: dict, max_gamma: int, config, tokens: int, repeats: int,
             temperature: float, seed: int, log=print) -> dict:
    """The kv4 level's draft step (the drafting weights over a 4-bit reading of the prefilled prompt: the
    int8 target's own upper planes, or a 4-bit cache built from the float one) and the full level's per-token
    acceptance of its drafts from a quantspec run at gamma max_gamma; the predicted ms/token of quantspec for
    every gamma, best first."""
    full = shared.restore(prompt)
    build_context = BuildContext(model, sampling_params(temperature), config, full.capacity, 64, full_cache=full)
    state = KIND_CLASSES["kv4"].state(build_context, LevelSpec("kv4"), "kv4")  # the level as a stack builds it
    cache: Buildable = state.cache
    with torch.inference_mode():
        cache.build(full)
    step = time_forwards(state.model, state.cache, state.cache.length, 1, repeats) * 1e3
    del state
    runs = [generate(model, prompt, tokens, sampling_params(temperature), method="quantspec",
                     config=replace(config, gamma=max_gamma), prefilled=shared, seed=s).stats["levels"]
            for s in probe_seeds(temperature, seed)]
    a = per_token_acceptance(pooled_mean_accepted(runs)["full"], max_gamma)
    log(f"kv4: per-token acceptance {a:.3f}; forward ms k=1 {step:.1f} (full {cost_full[1]:.1f})")
    grid = two_level_grid(cost_full, step, a, max_gamma)
    return {"acceptance": round(a, 4), "cost_kv4_ms": round(step, 2), "best": grid[0], "top": grid[:5]}


def tune_head(model, shared, prompt, cost_full: dict, max_gamma: int, config, tokens: int, temperature: float,
              seed: int, log=print) -> dict | None:
    """A draft head under the full level (head,full): its time per drafted token and the full level's per-token
    acceptance of its drafts from runs at gamma max_gamma (no n-gram shortcut: the head's drafts alone); the
    predicted ms/token for every gamma, best first. None when no head is available for the model (--head)."""
    try:
        head_for(model, config.head)
    except TriforceError:
        return None
    cfg = replace(config, ngram_shortcut=0.0)
    runs = [generate(model, prompt, tokens, sampling_params(temperature), stack=StackSpec.parse("head,full", max_gamma),
                     config=cfg, prefilled=shared, seed=s).stats["levels"] for s in probe_seeds(temperature, seed)]
    a = per_token_acceptance(pooled_mean_accepted(runs)["full"], max_gamma)
    drafted = [lv[-1] for lv in runs]
    step = 1e3 * sum(d["seconds"] for d in drafted) / max(1, sum(d["tokens"] for d in drafted))
    log(f"head: per-token acceptance {a:.3f}; {step:.2f} ms per drafted token (full forward k=1 {cost_full[1]:.1f})")
    grid = two_level_grid(cost_full, step, a, max_gamma)
    return {"acceptance": round(a, 4), "cost_head_ms_per_token": round(step, 3), "best": grid[0], "top": grid[:5]}


def tune(loaded, n_ctx: int, budgets: list[int], max_gamma: int, max_gamma_draft: int, config, tokens: int,
         repeats: int = 3, progress: bool = True, log=print, temperature: float = 0.0, seed: int = 0,
         kv4: bool = False) -> dict:
    config = replace(config, adapt=False)  # fixed stacks are what is measured
    model = loaded.model
    prompt = demo_tokens(loaded.tokenizer, n_ctx)
    capacity = n_ctx + tokens + max(max_gamma, max_gamma_draft) + 8
    t = time.perf_counter()
    shared = PrefilledPrompt(model, prompt, capacity, config.prefill_chunk, progress)
    log(f"prefill of {n_ctx} tokens: {time.perf_counter() - t:.1f} s")
    full = shared.cache
    length = full.length

    drafting = drafting_model(model, config)  # the retrieval level's model, as the built stack runs it
    ks = range(1, max(max_gamma, max_gamma_draft) + 2)
    cost_full = {k: time_forwards(model, full, length, k, repeats) * 1e3
                 for k in tqdm(ks, desc="full-cache forwards", disable=not progress, leave=False)}
    cost_retr: dict[int, dict[int, float]] = {}
    for b in budgets:
        rc = drafting_cache(drafting, config, lambda n_layers, **kw: KIND_CLASSES["retrieval"].new_cache(  # the level's own
            n_layers, budget=b, recent=config.recent, max_new=64, model=drafting, config=config, **kw))
        shared.restore(prompt)  # the timed forwards replaced the recorded queries
        with torch.inference_mode():
            rc.build(full)
        cost_retr[b] = {k: time_forwards(drafting, rc, rc.length, k, repeats) * 1e3
                        for k in tqdm(range(1, max_gamma_draft + 2), desc=f"budget {b} forwards",
                                      disable=not progress, leave=False)}
        del rc

    # Acceptance per budget from real triforce runs at the asked temperature with long drafts at
    # both levels (so the per-token rates are estimated over many positions; sampled: over
    # CHECK_SEEDS seeds, pooled). Acceptance depends strongly on the temperature: flags tuned at
    # T = 0 can lose at T = 0.6.
    probe_gamma, probe_gamma_draft = max_gamma, max_gamma_draft
    accept: dict[int, tuple[float, float]] = {}
    for b in tqdm(budgets, desc="acceptance", disable=not progress, leave=False):
        cfg = replace(config, budget=b, gamma=probe_gamma, gamma_draft=probe_gamma_draft)
        lv = pooled_mean_accepted([generate(model, prompt, tokens, sampling_params(temperature), method="triforce",
                                            config=cfg, prefilled=shared, seed=s).stats["levels"]
                                   for s in probe_seeds(temperature, seed)])
        a_full = per_token_acceptance(lv["full"], probe_gamma)
        a_retr = per_token_acceptance(lv["retrieval"], probe_gamma_draft) if "retrieval" in lv else 0.0
        accept[b] = (a_full, a_retr)
        log(f"budget {b}: per-token acceptance full {a_full:.3f}, retrieval {a_retr:.3f}; "
            f"forward ms full k=1 {cost_full[1]:.1f}, retrieval k=1 {cost_retr[b][1]:.1f}")

    grid = []
    for b in budgets:
        for g in range(1, max_gamma + 1):
            for gd in range(1, max_gamma_draft + 1):
                grid.append({"budget": b, "gamma": g, "gamma_draft": gd,
                             "predicted_ms_per_token": round(predict_ms(cost_full, cost_retr[b], *accept[b], g, gd), 2)})
    grid.sort(key=lambda r: r["predicted_ms_per_token"])
    extra = {"quantspec": tune_kv4(model, shared, prompt, cost_full, max_gamma, config, tokens, repeats, temperature,
                                   seed, log)} if kv4 else {}
    head = tune_head(model, shared, prompt, cost_full, max_gamma, config, tokens, temperature, seed, log)
    if head is not None:
        extra["head"] = head
    return {**extra, "context_length": n_ctx, "temperature": temperature, "cost_full_ms": {k: round(v, 2) for k, v in cost_full.items()},
            "cost_retrieval_ms": {b: {k: round(v, 2) for k, v in d.items()} for b, d in cost_retr.items()},
            "acceptance": {b: {"full": round(a, 4), "retrieval": round(r, 4)} for b, (a, r) in accept.items()},
            "predicted_ar_ms_per_token": round(cost_full[1], 2), "best": grid[0], "top": grid[:10],
            "shared": shared, "prompt": prompt}


def main(args, config) -> int:
    """`triforce tune` (the CLI has parsed and checked the speculation options into config)."""
    config = replace(config, adapt=False)  # tune measures fixed stacks; the adaptive planner re-plans from them

    try:
        asked = [int(x) for x in args.budgets.split(",")]
    except ValueError:
        raise TriforceError(f"--budgets must be comma-separated integers, got {args.budgets!r}") from None
    loaded = load_model(args.model, rope_theta=args.rope_theta, max_context=args.max_context,
                        dtype=resolve_dtype(args), device=args.device, cache_dir=args.cache_dir,
                        weights=args.weights,
                        progress=not args.quiet, kv_dtype=getattr(args, "kv_dtype", None))
    configure_device(loaded.model, args)
    log = (lambda *a, **k: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    # room past the prompt: a tree round's lookahead (_main_trees' capacity), or the largest gamma's
    room = (TREE_ROOM + max(args.tokens, 64) if args.trees
            else args.tokens + max(args.max_gamma, args.max_gamma_draft) + 8)
    if args.context_length + room > loaded.config.max_context:
        raise TriforceError(f"--context-length {args.context_length} plus {args.tokens} tokens exceeds the model's "
                            f"context of {loaded.config.max_context}: lower --context-length or raise --max-context")
    if args.trees:
        return _main_trees(args, config, loaded, log)
    budgets = [b for b in asked if b + config.chunk_size < args.context_length]
    if not budgets:
        raise TriforceError(f"every budget in --budgets {args.budgets} is as large as --context-length "
                            f"{args.context_length}: the retrieval cache must be smaller than the context")
    out = tune(loaded, args.context_length, budgets, args.max_gamma, args.max_gamma_draft, config, args.tokens,
               progress=not args.quiet, log=log, temperature=args.temperature, seed=args.seed,
               kv4=getattr(args, "kv4", False))
    shared, prompt = out.pop("shared"), out.pop("prompt")
    best = out["best"]
    if args.check:
        out["check"] = check_candidates(loaded.model, prompt, shared, config, out["top"], args, log)
    measured = {"predicted_ms_per_token": best["predicted_ms_per_token"],
                "predicted_ar_ms_per_token": out["predicted_ar_ms_per_token"], **out.get("check", {})}
    flags, kept_defaults = chosen_flags(best, config, out.get("check"))
    if kept_defaults:
        measured["kept_defaults"] = True
        out["kept_defaults"] = flags
        log(f"the defaults ran faster than every predicted setting checked ({out['check']['default']['triforce_ms_per_token']}"
            f" vs {out['check']['tuned']['triforce_ms_per_token']} ms/token at best): they are recorded instead")
    out["recorded"] = flags
    out["saved"] = _save(loaded, "chain", args, flags, measured, log=log)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"context {args.context_length}, temperature {args.temperature}: ar ~{out['predicted_ar_ms_per_token']} ms/token; best predicted "
              f"{best['predicted_ms_per_token']} ms/token (x{out['predicted_ar_ms_per_token'] / best['predicted_ms_per_token']:.2f})")
        print(f"  flags: --budget {best['budget']} --gamma {best['gamma']} --gamma-draft {best['gamma_draft']}")
        if flags != {k: best[k] for k in flags}:
            why = "the defaults ran faster in the check" if kept_defaults else "the check ran these fastest"
            print(f"  {why}: --budget {flags['budget']} --gamma {flags['gamma']} --gamma-draft {flags['gamma_draft']} "
                  f"(these are recorded)")
        for key, what, flag in (("head", "head,full; head", "--levels head,full --gammas"),
                                ("quantspec", "kv4,full; kv4", "--method quantspec --gamma")):
            if key in out:
                x = out[key]
                print(f"  {key} ({what} acceptance {x['acceptance']}): best predicted "
                      f"{x['best']['predicted_ms_per_token']} ms/token with {flag} {x['best']['gamma']}")
    return 0


FLAGS = ("budget", "gamma", "gamma_draft")
CHECK_CANDIDATES = 4  # predicted settings, best first, that --check runs for real beside the defaults


def check_candidates(model, prompt, shared, config, top: list[dict], args, log) -> dict:
    """--check: `ar`, the defaults and the CHECK_CANDIDATES best predicted settings (other than the defaults) run for
    real, taking turns within each seed (the machine drifts), totals compared -> {"default": ..., "tuned": the fastest
    candidate (its flags, prediction and timing), "candidates": every candidate's}. The prediction narrows the grid
    and the clock decides: its i.i.d. model misses what a run adds (at 32K, AMD Zen 5, greedy: predicted best budget
    2048 ran at 2.59x `ar` where budget 1024, second by the prediction, ran at 2.65x; at T = 0.6 a prediction of 1.43x
    ran at 1.21x against the defaults' 1.31x). Sampled runs: CHECK_SEEDS seeds (one run's text, and so its
    acceptance, is one draw); greedy: one."""
    defaults = tuple(getattr(config, k) for k in FLAGS)
    picks: list[dict] = []
    for row in top:
        if tuple(row[k] for k in FLAGS) != defaults:
            picks.append(row)
        if len(picks) == CHECK_CANDIDATES:
            break
    runs = [("ar", "ar", config, None), ("default", "triforce", config, None)]
    runs += [(f"candidate {i}", "triforce", replace(config, **{k: row[k] for k in FLAGS}), row)
             for i, row in enumerate(picks)]
    seeds = probe_seeds(args.temperature, args.seed)
    secs, toks = {name: 0.0 for name, *_ in runs}, {name: 0 for name, *_ in runs}
    for seed in seeds:
        for name, method, cfg, _ in runs:
            res = generate(model, prompt, args.tokens, sampling_params(args.temperature), method=method, config=cfg,
                           prefilled=shared, seed=seed)
            secs[name] += res.decode_seconds
            toks[name] += len(res.tokens)
    ms = {name: secs[name] / toks[name] * 1e3 for name in secs}

    def timing(name: str) -> dict:
        return {"triforce_ms_per_token": round(ms[name], 2), "ar_ms_per_token": round(ms["ar"], 2),
                "speedup_vs_ar": round(ms["ar"] / ms[name], 3), "seeds": len(seeds)}

    each = "" if len(seeds) == 1 else f" ({len(seeds)} runs each)"
    log(f"check default (--budget {defaults[0]} --gamma {defaults[1]} --gamma-draft {defaults[2]}): "
        f"{ms['default']:.1f} ms/token, ar {ms['ar']:.1f}, x{ms['ar'] / ms['default']:.2f}{each}")
    candidates = []
    for name, _, _, row in runs[2:]:
        candidates.append({"flags": {k: row[k] for k in FLAGS}, "predicted_ms_per_token": row["predicted_ms_per_token"],
                           **timing(name)})
        log(f"check --budget {row['budget']} --gamma {row['gamma']} --gamma-draft {row['gamma_draft']} (predicted "
            f"{row['predicted_ms_per_token']}): {ms[name]:.1f} ms/token, x{ms['ar'] / ms[name]:.2f}{each}")
    tuned = min(candidates, key=lambda c: c["triforce_ms_per_token"], default=None) or \
        {"flags": dict(zip(FLAGS, defaults)), **timing("default")}
    return {"default": timing("default"), "tuned": tuned, "candidates": candidates}


def chosen_flags(best: dict, config, checked: dict | None) -> tuple[dict, bool]:
    """The chain flags a tune run records -> (flags, whether they are the defaults): unchecked, the predicted best;
    checked, the fastest predicted setting the check ran, unless the defaults (config's flags) ran faster. Then the
    defaults, so that they, and not an earlier entry of this context and temperature, are what generate and bench
    take."""
    if checked is None:
        return {k: best[k] for k in FLAGS}, False
    if checked["tuned"]["triforce_ms_per_token"] > checked["default"]["triforce_ms_per_token"]:
        return {k: getattr(config, k) for k in FLAGS}, True
    return dict(checked["tuned"]["flags"]), False


def _save(loaded, kind: str, args, flags: dict, measured: dict, log) -> str | None:
    """Record the chosen flags as this machine's default for --method triforce (chain) or sequoia (tree) near
    this context and temperature (tuning/flags.py) -> the file, or None where the cache cannot be written
    (said, not fatal)."""
    what = "--method triforce" if kind == "chain" else "--method sequoia"
    try:
        path = tuned_flags.record(loaded, kind, args.context_length, args.temperature, flags, measured)
    except CacheUnwritable as e:
        log(f"not recorded as this machine's default: {e}")
        return None
    log(f"recorded in {path}: {what} uses them by default on this machine, with this model and KV dtype, for "
        f"{'greedy' if args.temperature <= 0 else 'sampled'} runs at contexts within 2x of {args.context_length} "
        f"(--no-tuned ignores them)")
    return str(path)


def check_tree(model, prompt, shared, config, tree: str, args, log) -> dict:
    """--check of `tune --trees`: `ar`, the chain defaults (--method triforce with config's flags: what runs
    without a tree) and `streaming,full --tree TREE` run for real, taking turns within each seed as the chain
    check does -> their ms/token ("tuned": the tree's, "default": the chain defaults')."""
    runs = [("ar", dict(method="ar")), ("default", dict(method="triforce")),
            ("tuned", dict(stack=StackSpec.parse("streaming,full", config.gamma, tree=tree)))]
    seeds = probe_seeds(args.temperature, args.seed)
    secs, toks = {name: 0.0 for name, _ in runs}, {name: 0 for name, _ in runs}
    for seed in seeds:
        for name, how in runs:
            res = generate(model, prompt, args.tokens, sampling_params(args.temperature), config=config,
                           prefilled=shared, seed=seed, **how)
            secs[name] += res.decode_seconds
            toks[name] += len(res.tokens)
    ms = {name: secs[name] / toks[name] * 1e3 for name in secs}
    log(f"check: streaming,full --tree {tree} {ms['tuned']:.1f} ms/token, chain defaults {ms['default']:.1f}, "
        f"ar {ms['ar']:.1f}" + ("" if len(seeds) == 1 else f" ({len(seeds)} runs each)"))
    return {"tuned_ms_per_token": round(ms["tuned"], 2), "default_ms_per_token": round(ms["default"], 2),
            "ar_ms_per_token": round(ms["ar"], 2), "speedup_vs_ar": round(ms["ar"] / ms["tuned"], 3),
            "default_speedup_vs_ar": round(ms["ar"] / ms["default"], 3), "seeds": len(seeds)}


def tree_to_record(tree: str, checked: dict | None) -> dict | None:
    """The tree flags a `tune --trees` run records: unchecked (--no-check), the predicted best; checked, that tree
    only if it ran faster than the chain defaults, else None (nothing is recorded: the tree would slow runs down)."""
    if checked is not None and checked["tuned_ms_per_token"] >= checked["default_ms_per_token"]:
        return None
    return {"tree": tree}


def _main_trees(args, config, loaded, log) -> int:
    prompt = demo_tokens(loaded.tokenizer, args.context_length)
    t = time.perf_counter()
    shared = PrefilledPrompt(loaded.model, prompt, args.context_length + max(args.tokens, 64) + TREE_ROOM,
                             config.prefill_chunk, not args.quiet)
    log(f"prefill of {args.context_length} tokens: {time.perf_counter() - t:.1f} s")
    out = tune_trees(loaded, shared, prompt, config, args.tokens, args.temperature, args.seed,
                     max_nodes=args.max_tree_nodes, log=log)
    best = out["best"]
    if args.check:
        out["check"] = check_tree(loaded.model, prompt, shared, config, best["tree"], args, log)
    flags = tree_to_record(best["tree"], out.get("check"))
    out["recorded"] = flags
    if flags is None:  # the chain defaults ran faster: no tree is recorded
        out["kept_defaults"] = True
        out["saved"] = None
        log(f"not recorded: the chain defaults ran faster than --tree {best['tree']} in the check "
            f"({out['check']['default_ms_per_token']} vs {out['check']['tuned_ms_per_token']} ms/token)")
    else:
        out["saved"] = _save(loaded, "tree", args, flags,
                             {"predicted_ms_per_token": best["predicted_ms_per_token"],
                              "predicted_ar_ms_per_token": out["predicted_ar_ms_per_token"], **out.get("check", {})},
                             log=log)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"context {args.context_length}, temperature {args.temperature}: ar ~{out['predicted_ar_ms_per_token']} "
              f"ms/token; best tree predicted {best['predicted_ms_per_token']} ms/token "
              f"(x{out['predicted_ar_ms_per_token'] / best['predicted_ms_per_token']:.2f}, "
              f"{best['expected_tokens']} tokens per round)")
        print(f"  flags: --levels streaming,full --tree {best['tree']}")
        if flags is None:
            print("  the chain defaults ran faster in the check: no tree is recorded")
    return 0


# --- Sequoia trees: `triforce tune --trees` ------------------------------------------------------------

PROBE_TREE = (4, 2, 2, 1)  # wide at the root, where most ranks are tried: 4 + 8 + 16 + 16 = 44 nodes
TREE_ROOM = 80  # cache room past the generated tokens for a tree round (the probe's 44 nodes and slack)


def width_trees(max_nodes: int, max_depth: int, max_width: int = 4):
    """Every widths-per-depth tree (`--tree W0,W1,...`, widths not increasing with depth) of at most
    max_nodes nodes and max_depth depths."""
    def grow(widths):
        if widths:
            yield tuple(widths), fixed_tree(widths)
        if len(widths) == max_depth:
            return
        for w in range(1, (widths[-1] if widths else max_width) + 1):
            nxt = widths + [w]
            if len(fixed_tree(nxt)) <= max_nodes:
                yield from grow(nxt)

    yield from grow([])


def tune_trees(loaded, shared, prompt: list[int], config, tokens: int, temperature: float, seed: int,
               repeats: int = 3, max_nodes: int = 32, max_depth: int = 6, progress: bool = True, log=print) -> dict:
    """Sequoia's hardware-aware choice for `streaming,full --tree`: the positional acceptance vector of the
    streaming level's trees under the full model, measured from a run with a wide probe tree; the cost of a
    full-cache forward of k tokens and of a streaming-cache forward of k tokens (k up to max_nodes + 2);
    then, for every widths-per-depth tree, predicted ms/token = (the draft's forwards, one per depth,
    each feeding the tree so far, + the verification of all nodes) / expected tokens per round. Also the
    expected tokens of Sequoia's optimal tree (tree.best_tree) of as many nodes, for reference."""
    model = loaded.model
    probe = StackSpec.parse("streaming,full", config.gamma, tree=PROBE_TREE)
    res = generate(model, prompt, tokens, sampling_params(temperature), stack=probe, config=config, prefilled=shared,
                   seed=seed)
    top = res.stats["levels"][0]
    acceptance = top["acceptance_by_rank"]
    log(f"trees, T={temperature}: acceptance by child rank {acceptance} (tried {top['tried_by_rank']})")

    full = shared.cache
    length = shared.restore(prompt).length
    sizes = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64} & set(range(1, max_nodes + 3)) | {max_nodes + 2})
    cost_full = {k: time_forwards(model, full, length, k, repeats) * 1e3 for k in sizes}
    build_context = BuildContext(model, sampling_params(temperature), config, length + 256, max_rollback(probe))
    state = KIND_CLASSES["streaming"].state(build_context, probe.levels[0], "streaming")
    KIND_CLASSES["streaming"].prefill(state, prompt[:-1], None, config)
    cost_stream = {k: time_forwards(state.model, state.cache, state.cache.length, k, repeats) * 1e3 for k in sizes}
    shared.restore(prompt)

    rows = []
    for widths, parents in width_trees(max_nodes, max_depth):
        e = tree_value(parents, acceptance)
        rows.append({"tree": ",".join(map(str, widths)), "nodes": len(parents), "expected_tokens": round(e, 3),
                     "predicted_ms_per_token": round(tree_ms_per_token(cost_stream, cost_full, widths, len(parents),
                                                                       e), 2)})
    rows.sort(key=lambda r: r["predicted_ms_per_token"])
    best = rows[0]
    optimal = tree_value(best_tree(acceptance, best["nodes"], max_depth), acceptance)
    return {"temperature": temperature, "acceptance_by_rank": acceptance, "tried_by_rank": top["tried_by_rank"],
            "cost_full_ms": {k: round(v, 2) for k, v in cost_full.items()},
            "cost_streaming_ms": {k: round(v, 2) for k, v in cost_stream.items()},
            "predicted_ar_ms_per_token": round(cost_full[1], 2), "best": best, "top": rows[:10],
            "sequoia_optimal_expected_tokens_same_nodes": round(optimal, 3)}
