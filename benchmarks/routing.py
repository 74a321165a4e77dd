"""Prefix-affinity routing against round robin, on `triforce serve --replicas N`'s deployment.

    python benchmarks/routing.py --out docs/benchmarks/DATE-MACHINE-ray

One local Ray instance per routing (loopback, `--replicas` replicas of `--threads` threads, cold
caches), the HTTP API in front as `triforce serve --replicas N` runs it. The workload: `--docs`
documents (prose from the shipped corpus, `--doc-tokens` tokens each), each asked `--questions`
questions, all requests in one seeded random order, `--concurrency` clients streaming greedy
completions. Time to first token is measured by the client (arrival to the first text, routing and
queueing included): p50, p99 and mean per routing. Each replica's prefix cache holds about
`--cache-docs` documents (`--prefix-cache-bytes` by default): affinity keeps each document on one
replica, round robin makes every replica cache every document.

Then, on the affinity deployment, a replica is killed while `--docs` x 2 new requests are running
or queued: a request the killed replica had not started streaming must be answered by the other
(sent again by the front end), one it was streaming ends with the retryable `replica_died` error and
is retried by the client once; every final answer must equal `triforce generate`'s (greedy, computed
in this process with the replicas' thread count). Writes results.json and summary.md to --out; exit
code 0 when every answer is equal and nothing was lost, 1 if not.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from triforce.serving.harness import (
    GAMMAS,
    STACK,
    documents,
    kill_replica,
    local_cluster,
    question,
    stream,
    stream_one,
    wait_healthy,
)

def workload(tokenizer, docs: int, questions: int, doc_tokens: int, seed: int = 0) -> list[dict]:
    """Every document with every question, in one seeded random order."""
    texts = documents(tokenizer, docs, doc_tokens)
    items = [{"doc": d, "question": q, "ids": texts[d] + question(tokenizer, q)}
             for d in range(docs) for q in range(questions)]
    random.Random(seed).shuffle(items)
    return items


async def run_all(url: str, items: list[dict], max_tokens: int, concurrency: int) -> list[dict]:
    """The items' requests by `concurrency` clients in order; -> one result per item."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(items)):
        queue.put_nowait(i)
    results: list[dict | None] = [None] * len(items)

    async def client_loop(client):
        while not queue.empty():
            i = queue.get_nowait()
            results[i] = await stream(client, url, items[i]["ids"], max_tokens)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ttft_summary(results: list[dict]) -> dict:
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"n": len(ttfts), "p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99),
            "mean": statistics.fmean(ttfts), "cache_hits": sum(1 for r in results if r["triforce"]
                                                               and r["triforce"]["prefix_cache_tokens"] > 0)}


def kill_phase(cluster, items: list[dict], max_tokens: int, victim: str, replicas: int) -> dict:
    """`items` sent at once; `victim` killed at the first streamed text; a `replica_died` answer is
    retried once by the client. -> the outcomes, and how long Ray took to replace the replica."""
    engine = cluster.deployment.engine
    retried_before = engine.retried
    lock, killed, replaced = threading.Lock(), [], []

    def watch():
        with contextlib.suppress(TimeoutError):
            wait_healthy(replicas, healthy=False, seconds=30)  # the controller has seen the death...
        wait_healthy(replicas)  # ...and started a new replica
        replaced.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)

    def kill_once():
        with lock:
            if not killed:
                killed.append(time.monotonic())
                kill_replica(victim)
                watcher.start()

    first_results = asyncio.run(_run_killing(cluster.url, items, max_tokens, kill_once))
    retries = []
    for item, r in zip(items, first_results):
        if r["error"] is not None and r["error"].get("code") == "replica_died":
            retries.append(stream_one(cluster.url, item["ids"], max_tokens))
        else:
            retries.append(None)
    watcher.join(240)
    return {"victim": victim, "first": first_results, "client_retries": retries,
            "sent_again_by_front_end": engine.retried - retried_before,
            "replaced_after_s": replaced[0] - killed[0] if replaced and killed else None}


async def _run_killing(url: str, items: list[dict], max_tokens: int, kill) -> list[dict]:
    """All items at once; `kill()` runs at every streamed text (it acts once)."""
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(items) + 2)) as client:
        return await asyncio.gather(*(stream(client, url, it["ids"], max_tokens, on_text=kill) for it in items))


def reference_texts(prompts: list[list[int]], max_tokens: int, stack, config, threads: int) -> list[str]:
    """`triforce generate`'s greedy text for each prompt, with the replicas' thread count."""
    if not prompts:
        return []
    import torch

    from triforce import SamplingParams, generate
    from triforce.loading import load_model

    loaded = load_model(None, max_context=4096, progress=False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [generate(loaded.model, ids, max_tokens, SamplingParams(), stack=stack, config=config,
                         eos_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer, seed=0).text for ids in prompts]
    finally:
        torch.set_num_threads(before)


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:24]


def kv_bytes_per_token() -> int:
    """The embedded model's K/V bytes per token in its default KV dtype (the prefix cache's unit)."""
    import torch

    from triforce.loading import default_kv_dtype

    kv = getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[default_kv_dtype(torch.float32)])
    n_layers, n_kv_heads, head_dim = 30, 3, 64  # SmolLM2-135M
    return 2 * n_layers * n_kv_heads * head_dim * torch.empty((), dtype=kv).element_size()


def machine() -> str:
    from triforce.kernels.build import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/routing.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and summary.md")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads (and Ray CPUs) per replica")
    p.add_argument("--prefill-chunk", type=int, default=128, help="the prefix cache's block size")
    p.add_argument("--cache-docs", type=float, default=2.5,
                   help="each replica's prefix cache holds about this many documents (default 2.5)")
    p.add_argument("--prefix-cache-bytes", type=int, help="the prefix cache per replica (overrides --cache-docs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--references", type=Path, metavar="RESULTS.json",
                   help="reuse the `triforce generate` answers of an earlier run's results.json (same prompts, "
                        "stack and --max-tokens): computing them takes longer than the runs")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    budget = a.prefix_cache_bytes or int(a.cache_docs * a.doc_tokens * kv_bytes_per_token())
    kw = {"replicas": a.replicas, "threads": a.threads, "prefill_chunk": a.prefill_chunk,
          "prefix_cache_bytes": budget, "max_tokens": a.max_tokens}
    runs, items, kill = {}, None, None
    for routing in ("prefix", "round-robin"):
        with local_cluster(routing=routing, **kw) as cluster:
            if items is None:
                items = workload(cluster.tokenizer, a.docs, a.questions, a.doc_tokens, a.seed)
            t0 = time.perf_counter()
            results = asyncio.run(run_all(cluster.url, items, a.max_tokens, a.concurrency))
            runs[routing] = {"seconds": time.perf_counter() - t0, "results": results, "ttft": ttft_summary(results)}
            print(f"{routing}: {json.dumps(runs[routing]['ttft'])}", flush=True)
            if routing == "prefix":
                victim = next(r["triforce"]["replica"] for r in results if r["triforce"])
                extra = [{"doc": d, "question": a.questions + k,
                          "ids": documents(cluster.tokenizer, a.docs, a.doc_tokens)[d]
                          + question(cluster.tokenizer, a.questions + k)} for k in range(2) for d in range(a.docs)]
                kill = kill_phase(cluster, extra, a.max_tokens, victim, a.replicas)
                kill["items"] = extra
                stack, config = cluster.stack, cluster.config
    prompts = [it["ids"] for it in items] + [it["ids"] for it in kill["items"]]
    known = {}
    if a.references:
        earlier = json.loads(a.references.read_text())
        if earlier["settings"]["max_tokens"] == a.max_tokens and earlier["settings"]["stack"] == f"{STACK} --gammas {GAMMAS}":
            known = earlier.get("references", {})
    missing = [ids for ids in prompts if _digest(ids) not in known]
    known.update({_digest(ids): text for ids, text in zip(missing, reference_texts(missing, a.max_tokens, stack, config,
                                                                                      a.threads))})
    ref_of = {tuple(ids): known[_digest(ids)] for ids in prompts}
    unequal = {routing: sum(1 for it, r in zip(items, run["results"])
                            if r["error"] is not None or r["text"] != ref_of[tuple(it["ids"])])
               for routing, run in runs.items()}
    lost = 0
    for it, first, retry in zip(kill["items"], kill["first"], kill["client_retries"]):
        final = retry if retry is not None else first
        if final["error"] is not None or final["text"] != ref_of[tuple(it["ids"])]:
            lost += 1
    died = sum(1 for r in kill["client_retries"] if r is not None)
    ratio = runs["round-robin"]["ttft"]["mean"] / runs["prefix"]["ttft"]["mean"]
    summary = {
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/routing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {**vars(a), "out": str(a.out), "prefix_cache_bytes": budget, "stack": f"{STACK} --gammas {GAMMAS}",
                     "model": "SmolLM2-135M-Instruct (embedded)"},
        "ttft": {k: v["ttft"] for k, v in runs.items()},
        "wall_seconds": {k: round(v["seconds"], 2) for k, v in runs.items()},
        "mean_ttft_ratio_round_robin_over_prefix": ratio,
        "answers_unequal_to_generate": unequal,
        "kill": {"victim": kill["victim"], "requests": len(kill["items"]),
                 "sent_again_by_front_end": kill["sent_again_by_front_end"], "replica_died_to_client": died,
                 "lost": lost, "replaced_after_s": kill["replaced_after_s"] and round(kill["replaced_after_s"], 1)},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    summary["references_computed_here"] = len(missing)
    (a.out / "results.json").write_text(json.dumps({**summary, "references": known, "runs": runs, "kill_detail": {
        k: v for k, v in kill.items() if k != "items"}}, indent=1, default=str))
    (a.out / "summary.md").write_text(_markdown(summary))
    print(_markdown(summary))
    ok = not any(unequal.values()) and lost == 0
    return 0 if ok else 1


def _markdown(s: dict) -> str:
    rows = "\n".join(f"| {k} | {v['p50']:.3f} | {v['p99']:.3f} | {v['mean']:.3f} | {v['cache_hits']}/{v['n']} | "
                     f"{s['wall_seconds'][k]:.1f} |" for k, v in s["ttft"].items())
    k = s["kill"]
    return (f"# Prefix-affinity vs round-robin routing, {s['date']}\n\n"
            f"Machine: {s['machine']}. Command: `{s['command']}`\n\n"
            f"Settings: {json.dumps(s['settings'], default=str)}\n\n"
            "| routing | TTFT p50 (s) | TTFT p99 (s) | TTFT mean (s) | prefix-cache hits | wall (s) |\n|---|---|---|---|---|---|\n"
            f"{rows}\n\nMean TTFT, round robin over affinity: {s['mean_ttft_ratio_round_robin_over_prefix']:.2f}x. "
            f"Answers unequal to `triforce generate`'s: {s['answers_unequal_to_generate']} (its answers computed "
            f"here for {s['references_computed_here']} prompts, the others taken from `--references`).\n\n"
            f"Replica killed mid-load (affinity deployment, {k['requests']} requests in flight): sent again by the "
            f"front end {k['sent_again_by_front_end']}, ended with `replica_died` after streaming (retried by the "
            f"client) {k['replica_died_to_client']}, lost {k['lost']}; Ray Serve ran 2 healthy replicas again "
            f"{k['replaced_after_s']} s after the kill.\n")


if __name__ == "__main__":
    sys.exit(main())
