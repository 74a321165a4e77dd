"""The lighter alternative to `--replicas`: plain `triforce serve` processes behind vllm-router's
cache-aware policy (vllm-router, a Rust router on PyPI, a fork of sglang-router). Two servers of the
tiny test model on 127.0.0.1, the router as a child process on 127.0.0.1: it finds the servers
healthy and proxies completions (streamed or not, with the SGLang/vLLM fields it adds to each
request), chat and /v1/models. What it does not do with our servers: spread documents by prefix (it
asks each worker's /v1/completions/render, vLLM's tokenizing endpoint, which we lack: every request
went to one server; docs/multi_host.md)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm_router")

import test_serving  # noqa: E402
from test_serving import CONFIG, DOC, STACK, serving  # noqa: E402
from triforce.serving.harness import free_port  # noqa: E402

tiny = test_serving.tiny  # the tiny model and character tokenizer fixture


@contextlib.contextmanager
def router(workers: list[str], policy: str = "cache_aware"):
    """vllm-router on 127.0.0.1 in front of `workers`; yields its URL once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--policy", policy, "--worker-urls", *workers, "--worker-startup-timeout-secs", "60",
           "--worker-startup-check-interval", "1", "--log-level", "warning"]
    log = open(os.devnull, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"vllm-router exited with code {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "vllm-router did not come up"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_plain_servers_behind_vllm_router_cache_aware(tiny):
    with serving(tiny, STACK, CONFIG) as (url_a, a), serving(tiny, STACK, CONFIG) as (url_b, b), \
            router([url_a, url_b]) as url:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert models["data"][0]["object"] == "model"
        docs = [DOC, "A lazy owl naps under the old oak; the owl dreams on and on. " * 3]  # no common prefix
        answers = []
        for q in range(3):
            for doc in docs:
                body = {"model": "m", "prompt": doc + f" Q{q}", "max_tokens": 4, "temperature": 0}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                answers.append((doc, r.json()))
        # every request after a document's first reused its prefix on the server that answered it
        for doc in docs:
            mine = [r for d, r in answers if d is doc]
            assert mine[0]["triforce"]["prefix_cache_tokens"] == 0
            assert all(r["triforce"]["prefix_cache_tokens"] > 0 for r in mine[1:]), [
                r["triforce"]["prefix_cache_tokens"] for r in mine]
        served = [s.prefix_cache.stats()["misses"] + s.prefix_cache.stats()["hits"] for s in (a, b)]
        assert sum(served) == len(answers)  # (all on one server: see the module docstring)
        # streamed completions and chat pass through as server-sent events
        body = {"model": "m", "prompt": DOC + " Q9", "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"]
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
