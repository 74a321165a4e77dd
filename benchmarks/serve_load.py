"""`triforce serve` alone under loads of N concurrent requests on one cached document: time to first token and
aggregate decode tokens/s per load, with each request's server-side prefill time (the cached prefix's copy, the
question's prefill and the drafting levels' builds). The loads of `python benchmarks/serve.py --peer vllm`
without the peer, for A/B runs of the server itself (two rounds: the second starts with the engine's buffer pool
filled by the first).

    python benchmarks/serve_load.py 1,4,8                   # the default stack
    python benchmarks/serve_load.py 1,4,8 --method ar       # any further arguments go to triforce serve
    python benchmarks/serve_load.py 1,4,8 T=0.6             # sampled loads (request i: seed i)
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import serve
from triforce.loading import load_model


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:2]):
        print(__doc__)
        return
    try:
        counts = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 8]
    except ValueError:
        raise SystemExit(f"serve_load.py: the first argument is the loads, N[,N...] (e.g. 1,4,8), not {sys.argv[1]!r}; "
                         f"--help shows the usage") from None
    rest = sys.argv[2:]
    try:
        temperature = float(rest.pop(0)[2:]) if rest and rest[0].startswith("T=") else 0.0
    except ValueError:
        raise SystemExit(f"serve_load.py: T= takes a temperature (e.g. T=0.6), not {sys.argv[2]!r}") from None
    tokenizer = load_model(None, progress=False).tokenizer
    doc, prompts = serve._prompts(SimpleNamespace(prompt_tokens=8192, batch_compare=max(counts)), tokenizer)
    server = serve.ServerProcess(["--prefix-cache-bytes", "1G", "--max-batch", str(max(counts)), "--max-queue", "64",
                                  *rest], Path(tempfile.mkdtemp()) / "server.log")
    try:
        warm = asyncio.run(serve._load_guarded(server.url, [doc + [doc[0]]], 4, 600, None))
        print(f"document prefill (warm-up): first token after {warm['results'][0]['first_at']:.2f} s", flush=True)
        for _ in range(2):
            for c in counts:
                serve.wait_until_quiet()
                run = asyncio.run(serve._load_guarded(server.url, prompts[:c], 64, 600, None, temperature))
                s = serve._side_stats(run)
                prefill = sorted(round(r["server"]["prefill_seconds"], 2) for r in run["results"] if r.get("server"))
                print(f"N={c}: decode {s['decode_tokens_per_s']:.1f} tokens/s, TTFT p50 {s['ttft_p50_s']:.2f} s "
                      f"p99 {s['ttft_p99_s']:.2f} s, server prefill s {prefill}", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
