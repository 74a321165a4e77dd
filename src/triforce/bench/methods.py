"""Every method on the same long prompts, in one process: ms/token, speedup over `ar`, acceptance.

    triforce bench --context-lengths 16384 --methods ar,triforce,retrieval,ngram --temperatures 0,0.6

The prompt's prefill is done once per prompt and shared by all methods (each run rolls the full
cache back to it). At temperature 0 each method's tokens are compared with `ar`'s (`lossless`).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..caches import new_cache
from ..config import kv_dtype_name
from ..corpus import GENRES, genre_tokens
from ..errors import TriforceError
from ..generate import generate
from ..loading import configure_device, load_model, resolve_dtype
from ..memory import kv_value_bytes
from ..speculation.builder import full_capacity
from ..speculation.kinds import drafting_model
from ..speculation.level import verify_rates
from ..speculation.stack import LevelSpec, REBUILT, StackSpec, method_stack
from ..speculation.state import PrefilledPrompt
from ..tuning import flags as tuned_flags
from ..tuning.flags import tuned_allowed, tuned_run
from ..tuning.measure import sampling_params
from . import peers as peer_mod
from .hardware import floor_seconds, measure_bandwidth, prefill_flops
from .results import answer_markdown, cells_markdown, markdown, prefill_markdown, summarize, write_outputs


def level_floor_ms(model, n_ctx: int, config, bandwidth: float | None, level: str) -> float | None:
    """Physical floor of one forward of a level's verifier (named as in the stats: kind[:budget]):
    (weights + the KV it reads) / bandwidth. The drafting levels read the bf16 draft weights where
    the run uses them, and their KV in config.draft_kv_dtype; the full level its KV in the model's
    kv_dtype. None without a bandwidth or for a level without a model of the target."""
    spec = LevelSpec.parse(level)
    if not bandwidth or spec.kind not in ("full", "retrieval", "h2o", "streaming", "kv4"):
        return None
    kv = kv_value_bytes(config.draft_kv_dtype)
    if spec.kind == "full":
        m, n, kv = model, n_ctx, kv_value_bytes(model.kv_dtype)
    elif spec.kind == "kv4":  # the upper planes (the 4-bit codes' bytes and the groups' scales)
        m, n, kv = drafting_model(model, config), n_ctx, kv_value_bytes("int4")
    elif spec.kind in REBUILT:
        m, n = drafting_model(model, config), min(n_ctx, (spec.budget or config.budget) + config.recent)
    else:
        m, n = drafting_model(model, config), min(n_ctx, spec.budget or config.streaming_budget)
    return round(floor_seconds(m, n, bandwidth, kv) * 1e3, 1)


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


def _sample_seed(seed: int, prompt_index: int, sample: int) -> int:
    return seed + prompt_index + 1000 * sample


def _ms_per_token(results) -> float:
    """Decode ms per generated token over one or more generations (their time over their tokens)."""
    return sum(r.decode_seconds for r in results) / sum(len(r.tokens) for r in results) * 1e3


_SUMMED = ("rounds", "proposed", "accepted", "seconds", "forwards", "host_syncs", "tokens", "shortcut_rounds")


def _summed_levels(results) -> list[dict]:
    """The generations' per-level stats, counts summed over the samples (the same stack: the same levels)."""
    levels = [dict(lvl) for lvl in results[0].stats["levels"]]
    for other in results[1:]:
        for lvl, o in zip(levels, other.stats["levels"]):
            for k in _SUMMED:
                if isinstance(lvl.get(k), (int, float)) and isinstance(o.get(k), (int, float)):
                    lvl[k] += o[k]
    for lvl in levels:
        if lvl.get("role") == "verify" and lvl.get("rounds"):
            lvl.update(verify_rates(lvl["rounds"], lvl["proposed"], lvl["accepted"]))
    return levels


def _bracket_ar(group: list[dict], second: float, log) -> float:
    """`ar` timed a second time after the other methods of one (context, prompt, temperature) group (`second`: its
    ms/token then; `group`: the group's rows, ar's first): its ms/token becomes the mean of the two timings
    and every row's speedup is taken against that. The host's speed drifts (other tenants: the read bandwidth
    moved between 47 and 71 GB/s within one session), and a baseline timed once, before everything else, carried
    the drift of its minute into every ratio of the group: one run's 2.08x at T = 0.6 was 1.68x with `ar` timed in
    a normal minute. -> the baseline's ms/token."""
    first = group[0]  # run_bench runs ar first
    ar_ms = round((first["ms_per_token"] + second) / 2, 2)  # as a row's ms_per_token: ar's own speedup stays 1.0
    first["notes"].append(f"ar timed before and after the other methods: {first['ms_per_token']:.2f} and "
                          f"{second:.2f} ms/token; the mean is the baseline of this group's speedups")
    first["ms_per_token"] = ar_ms
    for row in group:
        if row["ms_per_token"]:
            row["speedup_vs_ar"] = round(ar_ms / row["ms_per_token"], 3)
    log(f"  ar again {second:8.1f} ms/token: baseline {ar_ms:.1f}")
    return ar_ms


def _row(method, n_ctx, pi, temp, ms, ar_ms, floor_ms, tokens, ar_tokens, *, levels=(), notes=()):
    acc = {lvl["level"]: lvl.get("acceptance_rate") for lvl in levels if lvl.get("role") == "verify"}
    tpr = {lvl["level"]: lvl.get("tokens_per_round") for lvl in levels if lvl.get("role") == "verify"}
    top = levels[0] if levels else {}
    direct = ({"rounds_direct": top["shortcut_rounds"], "rounds": top["rounds"]}  # the n-gram shortcut's rounds
              if "shortcut_rounds" in top else None)
    return {"method": method, "context_length": n_ctx, "prompt": pi, "temperature": temp,
            "ms_per_token": round(ms, 2) if ms is not None else None,  # None: a peer that could not run
            "speedup_vs_ar": round(ar_ms / ms, 3) if ar_ms and ms else None,
            "floor_ms": floor_ms, "ar_floor_ms": floor_ms,
            # At T=0 an exact engine reproduces ar's tokens; agree_with_ar says where one stops doing so.
            "lossless": (tokens == ar_tokens) if (temp == 0 and tokens is not None) else None,
            "agree_with_ar": _agreement(tokens, ar_tokens) if (temp == 0 and tokens is not None) else None,
            "acceptance": acc, "tokens_per_round": tpr, "shortcut": direct, "tokens": len(tokens) if tokens else 0,
            "notes": list(notes), "levels": list(levels)}


def run_bench(loaded, context_lengths, methods, temperatures, n_prompts, max_new_tokens, config, seed=0,
              progress=True, draft_model=None, log=print, bandwidth=None, peers=(), draft_dir=None,
              prompt_files=(), on_row=None, tuned=None, reference_kv: str | None = None,
              genres: tuple[str, ...] = ("dialogue",), samples: int = 1, on_prefill=None) -> list[dict]:
    """-> one row per (context, prompt, temperature, method); `methods` are method names or StackSpecs
    (a row's method is then the stack's text). `on_row(rows)` is called after each new row (the CLI
    writes the results so far, so an interrupted run keeps its finished rows). `tuned(method, context,
    temperature)` -> (stack, config, entry) or None: a named method's run with this machine's tuned flags
    (tuning/flags.tuned_run; the row's notes say which). `reference_kv` (a KV dtype name): also `ar` over a
    cache of that dtype, with its own prefill of each prompt (row "ar (<dtype> KV)", marked `reference`), so
    that summarize() gives every method's speedup over it too: the end-to-end gain of the run's --kv-dtype.
    Without prompt files, `n_prompts` prompts of each of `genres` (corpus.GENRES), from different stretches of
    its text. `samples`: runs per method and cell, interleaved with the other methods' (A B C A B C ...), each with
    its own seed when sampling; a row's ms/token is their decode time over their tokens, its acceptances their sums
    (one run says little: the host's speed drifts within a minute, and when sampling each method samples a
    different text, where one loop or one novel stretch decides a run). `on_prefill(entry)`: each prompt's shared
    prefill, {context_length, prompt, prompt_name, seconds, gflop, gflop_per_s} (the time to its first token, less
    the first token's forward)."""
    model, tok = loaded.model, loaded.tokenizer
    rows = []

    def add(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(rows)

    def reference_ar(n_ctx: int, pi: int, prompt: list[int], ar_by_temp: dict) -> None:
        """`ar` over a cache of reference_kv: the model's KV dtype switched for its own prefill and decoding
        (the weights are shared; the run's cache is freed before, so the two never coexist)."""
        own = model.kv_dtype
        model.kv_dtype = reference_kv
        try:
            stack = runs["ar"]
            t = time.perf_counter()
            ref = PrefilledPrompt(model, prompt, full_capacity(n_ctx, max_new_tokens, stack), config.prefill_chunk,
                                  progress)
            log(f"context {n_ctx}, prompt {pi}: prefill with {reference_kv} KV {time.perf_counter() - t:.1f} s")
            ref_floor = level_floor_ms(model, n_ctx, config, bandwidth, "full")
            generate(model, prompt, 4, sampling_params(0.0), stack=stack, config=config, prefilled=ref)  # warm-up
            name = f"ar ({reference_kv} KV)"
            for temp in temperatures:
                res = generate(model, prompt, max_new_tokens, sampling_params(temp), stack=stack, config=config,
                               seed=seed + pi, prefilled=ref)
                ms = res.decode_seconds / len(res.tokens) * 1e3
                ar_tokens, ar_ms = ar_by_temp[temp]
                row = _row(name, n_ctx, pi, temp, ms, ar_ms, ref_floor, res.tokens, ar_tokens,
                           notes=[f"the reference: ar over a {reference_kv} KV cache, another model than the run's "
                                  f"--kv-dtype (its tokens need not equal ar's)"])
                row["lossless"], row["reference"] = None, True
                add(row)
                log(f"  T={temp} {name:10s} {ms:8.1f} ms/token  x{ar_ms / ms:.2f}")
            del ref
        finally:
            model.kv_dtype = own

    methods = ["ar"] + [m for m in methods if m != "ar"]  # ar first: the baseline of every row after it
    runs = {str(m) if isinstance(m, StackSpec) else m:
            m if isinstance(m, StackSpec) else method_stack(m, config.gamma, config.gamma_draft, config.draft,
                                                                  adaptive=config.adapt)
            for m in methods}  # name -> stack
    tuned_runs = {}  # (method, context, temperature) -> (stack, config, entry)
    if tuned is not None:
        for m in runs:
            for n in context_lengths:
                for temp in temperatures:
                    if (t := tuned(m, n, temp)) is not None:
                        tuned_runs[m, n, temp] = t
    stacks = list(runs.values()) + [t[0] for t in tuned_runs.values()]
    fitting = []
    for n in context_lengths:
        capacity = max(full_capacity(n, max_new_tokens, st) for st in stacks)
        if capacity <= model.cfg.max_context:
            fitting.append(n)
        else:
            log(f"skip context {n}: with {max_new_tokens} new tokens it exceeds the model's context")
    tf_peer = None
    if any(p.startswith("transformers") for p in peers):
        tf_peer = peer_mod.TransformersPeer(loaded.hf_dir, model.cfg.rope.theta, draft_dir)
    llama = _LlamaCppRuns(loaded, peers, max_new_tokens, seed, config, runs.get("ar"), progress, log, add)
    file_tokens = [(str(f), tok(Path(f).read_text(encoding="utf-8"))["input_ids"]) for f in prompt_files]
    warmed = False
    for n_ctx in fitting:
        floor_ms = level_floor_ms(model, n_ctx, config, bandwidth, "full")
        if not file_tokens:  # each genre's text, a different stretch per prompt
            named = [(genre if n_prompts == 1 else f"{genre} {i}", genre_tokens(tok, genre, n_ctx, i * 200_000))
                     for genre in genres for i in range(n_prompts)]
        else:
            named = []
            for name, ids in file_tokens:
                if len(ids) >= n_ctx:
                    named.append((Path(name).name, ids[:n_ctx]))
                else:
                    log(f"skip {name} at context {n_ctx}: it has only {len(ids)} tokens")
        for pi, (prompt_name, prompt) in enumerate(named):
            t = time.perf_counter()
            shared = PrefilledPrompt(model, prompt, max(full_capacity(n_ctx, max_new_tokens, st) for st in stacks),
                                     config.prefill_chunk, progress)
            prefill_s = time.perf_counter() - t
            log(f"context {n_ctx}, prompt {pi} ({prompt_name}): prefill {prefill_s:.1f} s")
            if on_prefill is not None:
                flop = sum(prefill_flops(model.cfg, len(prompt)))
                on_prefill({"context_length": n_ctx, "prompt": pi, "prompt_name": prompt_name,
                            "seconds": round(prefill_s, 3), "gflop": round(flop / 1e9, 1),
                            "gflop_per_s": round(flop / prefill_s / 1e9, 1)})
            if not warmed:  # first calls of every code path (kernels, oneDNN, allocator) stay untimed
                t = time.perf_counter()
                for stack in stacks:
                    generate(model, prompt, 4, sampling_params(0.0), stack=stack, config=config,
                             draft_model=draft_model, prefilled=shared)
                warmed = True
                log(f"warm-up (4 tokens of each of {len(stacks)} stacks, untimed): {time.perf_counter() - t:.1f} s")
            ar_by_temp = {}  # temperature -> (ar's tokens, ar's ms/token), for the llama.cpp rows
            for temp in temperatures:
                params = sampling_params(temp)
                ar_tokens, ar_ms = None, None
                # every method `samples` times, interleaved (A B C A B C ...): the host's speed drifts by tens of
                # percent within a minute, and a method timed in one stretch carries its minute into its ratio
                chosen = {}
                for method, stack in runs.items():
                    chosen[method] = (stack, config, None)
                    if (method, n_ctx, temp) in tuned_runs:
                        chosen[method] = tuned_runs[method, n_ctx, temp]
                done: dict[str, list] = {method: [] for method in runs}
                passes = tqdm(total=samples * len(runs), desc=f"{n_ctx} T={temp}", leave=False, disable=not progress)
                for i in range(samples):
                    for method, (stack, cfg, _) in chosen.items():
                        done[method].append(generate(model, prompt, max_new_tokens, params, stack=stack, config=cfg,
                                                     draft_model=draft_model, seed=_sample_seed(seed, pi, i),
                                                     prefilled=shared))
                        passes.update()
                passes.close()
                for method, results in done.items():
                    stack, cfg, entry = chosen[method]
                    res = results[0]
                    ms = _ms_per_token(results)
                    if method == "ar":
                        ar_tokens, ar_ms = res.tokens, ms
                        ar_by_temp[temp] = (ar_tokens, ar_ms)
                    levels = _summed_levels(results)
                    for lvl in levels:  # per-level cost of one verification forward beside its floor
                        if lvl.get("role") == "verify" and lvl.get("forwards"):
                            lvl["ms_per_forward"] = round(lvl["seconds"] / lvl["forwards"] * 1e3, 2)
                            lvl["floor_ms"] = level_floor_ms(model, n_ctx, cfg, bandwidth, lvl["level"])
                    tuned_note = [] if entry is None else [f"tuned flags (triforce tune): {tuned_flags.describe(entry)}"]
                    if len(results) > 1:
                        same = temp == 0 or all(r.tokens == res.tokens for r in results)
                        tuned_note.append(f"{len(results)} runs interleaved with the other methods' "
                                          f"({sum(len(r.tokens) for r in results)} tokens"
                                          + ("" if same else ", each its own seed") + "); routes and tokens of the first")
                    row = _row(method, n_ctx, pi, temp, ms, ar_ms, floor_ms, res.tokens, ar_tokens, levels=levels,
                               notes=tuned_note + res.stats.get("notes", []))
                    row["tuned"] = None if entry is None else tuned_flags.flags_text(entry)
                    row["prompt_name"] = prompt_name
                    if "adaptive" in res.stats:
                        row["adaptive"] = res.stats["adaptive"]
                    add(row)
                    log(f"  T={temp} {method:10s} {ms:8.1f} ms/token  x{ar_ms / ms:.2f}  accept {row['acceptance']}"
                        + (f"  lossless={row['lossless']}" if temp == 0 else ""))
                if len(runs) > 1:
                    ar_ms = _bracket_ar(rows[-len(runs):], _ms_per_token([generate(
                        model, prompt, max_new_tokens, params, stack=runs["ar"], config=config, draft_model=draft_model,
                        seed=_sample_seed(seed, pi, 0), prefilled=shared)]), log)
                    ar_by_temp[temp] = (ar_tokens, ar_ms)
                    if on_row is not None:
                        on_row(rows)
                for peer in peers:
                    if not peer.startswith("transformers-"):
                        continue  # transformers: decode steps only, below; llama.cpp: after this prompt
                    ms, toks = tf_peer.continue_prompt(prompt, max_new_tokens, temp, seed + pi, peer.split("-")[1])
                    row = _row(peer, n_ctx, pi, temp, ms, ar_ms, floor_ms, toks, ar_tokens,
                               notes=["transformers generate with its own prefill, timed as "
                                      "(t(max_new tokens) - t(1 token)) / (max_new - 1)"])
                    add(row)
                    log(f"  T={temp} {peer:10s} {ms:8.1f} ms/token  x{ar_ms / ms:.2f}"
                        + (f"  lossless={row['lossless']} agree={row['agree_with_ar']}" if temp == 0 else ""))
            del shared
            if reference_kv is not None:
                reference_ar(n_ctx, pi, prompt, ar_by_temp)
            llama.run(n_ctx, pi, prompt, temperatures, ar_by_temp, floor_ms, prefill_s)
        if "transformers" in peers:
            hf_ms = tf_peer.decode_ms(n_ctx)
            ar_rows = [r for r in rows if r["method"] == "ar" and r["context_length"] == n_ctx]
            for temp in temperatures:
                ar_ms = statistics.median(r["ms_per_token"] for r in ar_rows if r["temperature"] == temp)
                add(_row("transformers", n_ctx, 0, temp, hf_ms, ar_ms, floor_ms, None, None, notes=[
                    "transformers generate, greedy decode steps over a KV cache of this length (random contents), "
                    "prefill excluded; the same figure for every temperature"]))
            log(f"  transformers generate {hf_ms:8.1f} ms/token")
    llama.close()
    return rows


class _LlamaCppRuns:
    """The llama.cpp peers of one bench run (peers.LlamaCppPeer): per prompt and flash setting one
    prefill, then one decode per temperature; rows like the methods' plus prefill tokens/s (llama.cpp's
    and ours for the same prompt). If llama-cpp-python is missing or fails, the rows say why instead."""

    CHECK_PROMPT, CHECK_NEW = 64, 16  # the greedy agreement check with our ar, on a short prompt

    def __init__(self, loaded, peers, max_new, seed, config, ar_stack, progress, log, add):
        self.variants = peer_mod.llama_cpp_variants(peers)
        self.asked = [p for p in peers if p in peer_mod.LLAMA_CPP_PEERS]
        self.loaded, self.max_new, self.seed, self.config, self.ar_stack = loaded, max_new, seed, config, ar_stack
        self.log, self.add = log, add
        self.peer, self.why, self.check_notes = None, None, {}
        if not self.variants:
            return
        try:
            self.peer = peer_mod.LlamaCppPeer.for_model(loaded, progress=progress, log=log)
        except peer_mod.LlamaCppUnavailable as e:
            self.why = str(e)
            log(f"llama.cpp peer: {e}")

    def _check(self, name: str, flash: bool, prompt: list[int]) -> str:
        """A row note: how many greedy tokens llama.cpp and our ar share on a short prompt (the
        same model computed twice: a wrong setting such as the RoPE base shows as early disagreement)."""
        if name not in self.check_notes:
            short = prompt[:self.CHECK_PROMPT]
            ours = generate(self.loaded.model, short, self.CHECK_NEW, sampling_params(0.0), stack=self.ar_stack,
                            config=self.config).tokens
            theirs = self.peer.greedy_tokens(short, self.CHECK_NEW, flash)
            agree = _agreement(theirs, ours)
            self.check_notes[name] = (f"greedy check: {agree}/{self.CHECK_NEW} tokens equal to our ar after a "
                                      f"{len(short)}-token prompt (the same weights, other arithmetic: its "
                                      "activations at 8 bits, ours at 16 or fp32; near ties can part)")
            self.log(f"  {name}: {self.check_notes[name]}")
        return self.check_notes[name]

    def run(self, n_ctx, pi, prompt, temperatures, ar_by_temp, floor_ms, ours_prefill_s) -> None:
        if not self.variants:
            return
        n_head = len(prompt) - 1
        ours_rate = round(n_head / ours_prefill_s, 1) if ours_prefill_s > 0 else None
        if self.peer is None:
            for name in self.asked:
                self._not_run(name, n_ctx, pi, temperatures, floor_ms, ours_rate, self.why)
            return
        for name, flash in self.variants:
            done = set()  # temperatures with a row
            try:
                check = self._check(name, flash, prompt)
                seconds = self.peer.prefill(prompt, self.max_new, flash, label=name, hint_s=ours_prefill_s)
                rate = round(n_head / seconds, 1)
                self.log(f"  {name}: prefill {seconds:.1f} s = {rate} tokens/s (ours {ours_rate} tokens/s)")
                for temp in temperatures:
                    ar_tokens, ar_ms = ar_by_temp.get(temp, (None, None))
                    params = sampling_params(temp)
                    ms, toks = self.peer.decode(self.max_new, temp, params.top_p, self.seed + pi)
                    row = _row(name, n_ctx, pi, temp, ms, ar_ms, floor_ms, toks, ar_tokens, notes=[
                        f"llama.cpp (llama-cpp-python {self.peer.settings(flash)['llama_cpp_python']}) on "
                        f"{self.peer.path.name}, flash attention {'on' if flash else 'off'}, {self.peer.kv_type} KV, "
                        f"{self.peer.threads} threads; decode = {self.max_new} x (sample + llama_decode of one "
                        "token) after its own prefill", check])
                    # not an exact engine of our fp32 model (quantised products): agree_with_ar says how far
                    # its greedy tokens follow ar's, and the table shows "n/a (N tokens agree)"
                    row.update(lossless=None,
                               prefill_tokens=n_head, prefill_seconds=round(seconds, 2), prefill_tokens_per_s=rate,
                               ours_prefill_tokens_per_s=ours_rate, decode_ms_per_token=row["ms_per_token"],
                               settings=self.peer.settings(flash))
                    self.add(row)
                    done.add(temp)
                    self.log(f"  T={temp} {name:10s} {ms:8.1f} ms/token"
                             + (f"  x{ar_ms / ms:.2f}" if ar_ms else "")
                             + (f"  agree={row['agree_with_ar']}/{len(toks)}" if temp == 0 else ""))
            except (peer_mod.LlamaCppUnavailable, RuntimeError, ValueError, OSError) as e:
                why = str(e) if isinstance(e, peer_mod.LlamaCppUnavailable) else f"llama.cpp failed: {type(e).__name__}: {e}"
                self.log(f"  {name}: {why}")
                self._not_run(name, n_ctx, pi, [t for t in temperatures if t not in done], floor_ms, ours_rate, why)

    def _not_run(self, name, n_ctx, pi, temperatures, floor_ms, ours_rate, why: str) -> None:
        """Rows of a peer that did not run at these temperatures: no timings, the reason as their note."""
        for temp in temperatures:
            row = _row(name, n_ctx, pi, temp, None, None, floor_ms, None, None, notes=[why])
            row.update(prefill_tokens_per_s=None, ours_prefill_tokens_per_s=ours_rate)
            self.add(row)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()


def main(args, config, draft_path: str | None, stacks=()) -> int:
    """`triforce bench` (the CLI has parsed and checked the speculation options into config, and
    --stacks into StackSpecs)."""
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(peer_mod.PEERS)
    if unknown:
        raise TriforceError(f"unknown peer(s) {', '.join(sorted(unknown))}: choose from {', '.join(peer_mod.PEERS)}")
    for f in args.prompt_file or ():
        if not Path(f).is_file():
            raise TriforceError(f"prompt file not found: {f}")
    dtype = resolve_dtype(args)
    loaded = load_model(args.model, rope_theta=args.rope_theta, max_context=args.max_context, dtype=dtype,
                        device=args.device, cache_dir=args.cache_dir, progress=not args.quiet,
                        weights=args.weights,
                        kv_dtype=getattr(args, "kv_dtype", None))
    configure_device(loaded.model, args)
    draft_model = load_model(draft_path, dtype=dtype, device=args.device, cache_dir=args.cache_dir,
                        weights=args.weights,
                             max_context=loaded.config.max_context, progress=False) if draft_path else None
    log = (lambda *a, **k: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    if "transformers-assisted" in peers and draft_model is None:
        raise TriforceError("--peers transformers-assisted needs --draft PATH: a small model sharing the target's "
                            "tokenizer (no such model for SmolLM2 ships on PyPI)")
    reference_kv = getattr(args, "reference_kv_dtype", None)
    if reference_kv is not None:
        if reference_kv == kv_dtype_name(loaded.model.kv_dtype):
            raise TriforceError(f"--reference-kv-dtype {reference_kv} is this run's own KV dtype: name another one to "
                                f"compare with (e.g. --kv-dtype int8 --reference-kv-dtype fp32)")
        try:  # a tiny cache of that dtype now: the model's own refusals (int8 with sliding-window layers) come
            new_cache(loaded.model, 1, dtype=reference_kv)  # before any method has run, not after
        except TriforceError as e:
            raise TriforceError(f"--reference-kv-dtype {reference_kv}: {e}") from e
    bandwidth = measure_bandwidth(device=loaded.model.device)  # floors on a GPU are its HBM's
    ops = loaded.model.backend.ops
    # the build's measured vector peaks (FMAs; AVX512-BF16 dot products where it has them), which each prompt's
    # prefill rate is compared with in results.md
    peaks = {}
    if ops is not None and hasattr(ops, "vector_peak_flops"):
        peaks = {"fma": round(ops.vector_peak_flops(False) / 1e9, 1)}
        if (dot := ops.vector_peak_flops(True)) > 0:  # (each probe runs about 10 ms of arithmetic: once)
            peaks["bf16_dot"] = round(dot / 1e9, 1)
    meta = {"model": loaded.source, "threads": torch.get_num_threads(), "torch": torch.__version__,
            # the compiled CPU build (TRIFORCE_ISA), or none (PyTorch's, or a GPU's)
            "kernels": ops.ISA if ops is not None else f"none ({loaded.model.device.type})",
            "bandwidth_gb_s": round(bandwidth / 1e9, 1), "config": config.__dict__,
            "kv_dtype": str(loaded.model.kv_dtype).removeprefix("torch."), "reference_kv_dtype": reference_kv,
            "max_new_tokens": args.max_new_tokens, "command": " ".join(sys.argv),
            "vector_peak_gflop_s": peaks, "prefills": []}
    out_dir = Path(args.out)

    genres = tuple(g for g in args.genres.split(",") if g)
    if not genres or set(genres) - set(GENRES):
        raise TriforceError(f"--genres {args.genres!r}: choose from {', '.join(GENRES)}")
    rows = run_bench(loaded, [int(x) for x in args.context_lengths.split(",")], args.methods.split(",") + list(stacks),
                     [float(x) for x in args.temperatures.split(",")], args.prompts, args.max_new_tokens, config,
                     seed=args.seed, progress=not args.quiet, draft_model=draft_model.model if draft_model else None,
                     log=log, bandwidth=bandwidth, peers=peers, prompt_files=args.prompt_file or (),
                     draft_dir=draft_model.hf_dir if draft_model else None,
                     on_row=lambda rs: write_outputs(out_dir, rs, summarize(rs), meta), genres=genres,
                     tuned=lambda m, n, t: tuned_run(loaded, m, config, n, t, log) if tuned_allowed(args, m) else None,
                     reference_kv=reference_kv, samples=args.samples, on_prefill=meta["prefills"].append)
    summary = summarize(rows)
    write_outputs(out_dir, rows, summary, meta)
    print(markdown(summary) + cells_markdown(rows) + prefill_markdown(meta) + answer_markdown(rows, meta))
    return 0
