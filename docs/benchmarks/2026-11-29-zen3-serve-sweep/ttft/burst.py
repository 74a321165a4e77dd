"""First burst on a fresh server (pool empty): 8 requests at once at 8K, then 4 running + 4 arriving 1.5 s later
(the running ones' ITL p99 while the newcomers start). Prints TTFT p50/p95, aggregate, ITL."""
import asyncio, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "/work/main/benchmarks")
import serve
from triforce.loading import load_model
from types import SimpleNamespace

tok = load_model(None, progress=False).tokenizer
doc, prompts = serve._prompts(SimpleNamespace(prompt_tokens=8192, batch_compare=16), tok)
srv = serve.ServerProcess(["--prefix-cache-bytes", "1G", "--max-batch", "16", "--max-queue", "32", "--method", "ar"],
                          Path(tempfile.mkdtemp()) / "s.log")
try:
    asyncio.run(serve._load_guarded(srv.url, [doc + [doc[0]]], 2, 600, None))
    serve.wait_until_quiet()
    s = serve._side_stats(asyncio.run(serve._load_guarded(srv.url, prompts[:8], 32, 600, None)))
    print(f"first burst of 8: TTFT p50 {s['ttft_p50_s']} p95 {s['ttft_p95_s']}, decode {s['decode_tokens_per_s']}, prefill {s.get('server_prefill_s')}")
    serve.wait_until_quiet()
    async def staggered():
        import httpx
        async with httpx.AsyncClient(timeout=600) as c:
            t0 = time.perf_counter()
            first = [asyncio.create_task(serve._timed(c, srv.url, p, 96, t0)) for p in prompts[8:12]]
            await asyncio.sleep(1.5)
            late = [asyncio.create_task(serve._timed(c, srv.url, p, 32, t0)) for p in prompts[12:16]]
            return await asyncio.gather(*first), await asyncio.gather(*late)
    a, b = asyncio.run(staggered())
    gaps = sorted(y - x for r in a for x, y in zip(r["times"], r["times"][1:]) if 1.5 <= x <= 6.0)
    print(f"staggered: running requests' gaps while 4 start: max {gaps[-1]*1e3:.0f} ms, p95 {gaps[int(0.95*(len(gaps)-1))]*1e3:.0f} ms; "
          f"newcomers' TTFT {[round(r['first_at'] - 1.5, 2) for r in b]}")
finally:
    srv.stop()
