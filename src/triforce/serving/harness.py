"""The server run locally, for the tests and the lab's measurements (benchmarks/serve.py, benchmarks/routing.py):
`triforce serve` as a child process, an app in a thread, the replicas' deployment on a local Ray instance, a
streamed greedy completion against any of them, and the documents and questions the routing checks ask."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import triforce

from ..corpus import genre_tokens
from ..speculation.settings import SpecConfig
from ..speculation.stack import StackSpec
from .server import build_front, replica_spec

STACK, GAMMAS = "ngram,retrieval:256,full", "3,4"  # the local deployment's stack


def free_port() -> int:
    """A loopback port free now (bound and let go: the caller binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """For Popen's preexec_fn: the child gets SIGTERM when this process dies, however it dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing). Why: a bench killed with SIGKILL runs no `finally`, and the server it had
    started would run on for hours (issue 69 found one still running an hour later)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def wait_until_healthy(server, what: str, t0: float, seconds: float, poll: float) -> float:
    """Poll `server.url`/health until it answers 200 -> seconds since t0. SystemExit naming `what` and the end of its
    log if its process (`server.proc`) exits first, or if `seconds` pass (the server is stopped then)."""
    import httpx  # optional: httpx (the serve extra)

    while time.perf_counter() - t0 < seconds:
        if server.proc.poll() is not None:
            tail = "\n".join(server.log_path.read_text(errors="replace").splitlines()[-15:])
            raise SystemExit(f"{what} exited with code {server.proc.returncode} while starting; the end of its log "
                             f"({server.log_path}):\n{tail}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    server.stop()
    raise SystemExit(f"{what} did not start within {seconds:.0f} s; its log: {server.log_path}")


class ServerProcess:
    """`python -m triforce serve ...` on 127.0.0.1 (in `env`, default this process's environment); stderr goes to a
    log file. It stops when this process does, even on a SIGKILL (die_with_parent)."""

    def __init__(self, extra: list[str], log_path: Path, ready_seconds: float = 600.0, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "triforce", "serve", "--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.command = " ".join(cmd[1:])
        self.log = open(log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=die_with_parent)
        self.ready_seconds = wait_until_healthy(self, "the server", t0, ready_seconds, 0.5)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def documents(tokenizer, n: int, tokens: int) -> list[list[int]]:
    """n distinct prose documents of `tokens` tokens (the shipped corpus, 40K characters apart)."""
    return [genre_tokens(tokenizer, "prose", tokens, offset_chars=40_000 * i) for i in range(n)]


def question(tokenizer, i: int) -> list[int]:
    return tokenizer(f"\n\nQuestion {i}: what does the passage above say about names? Answer:",
                     add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def uvicorn_thread(app):
    """The app on 127.0.0.1 (a free port) in a thread; yields its base URL."""
    import uvicorn  # optional: uvicorn (the serve extra)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def source_path() -> str:
    """The folder this triforce is imported from (the replicas import the same one)."""
    return str(Path(triforce.__file__).resolve().parents[1])


@contextlib.contextmanager
def local_cluster(*, routing: str = "prefix", replicas: int = 2, threads: int = 1, prefill_chunk: int = 128,
                  prefix_cache_bytes: int = 1 << 30, max_tokens: int = 16, max_context: int = 4096,
                  max_queue: int = 16, kv_cache_dir=None):
    """A local Ray instance (`replicas` x `threads` CPUs, loopback, no dashboard) running the
    deployment of the embedded model, and the HTTP API in front (a thread here). Yields
    (url, deployment, stack, config); everything is shut down at the end."""
    from ray import serve  # optional: ray

    from . import replicas as ray_replicas  # optional: ray

    stack, config = StackSpec.parse(STACK, GAMMAS), SpecConfig(prefill_chunk=prefill_chunk)
    args = SimpleNamespace(model=None, rope_theta=None, max_context=max_context, device="cpu", cache_dir=None,
                           kv_dtype=None, weights="native", max_queue=max_queue, prefix_cache_bytes=prefix_cache_bytes,
                           kv_cache_dir=kv_cache_dir, request_timeout=600.0, default_max_tokens=max_tokens,
                           served_model_name=None, shutdown_timeout=5.0, threads=threads,
                           cpus_per_replica=float(threads), log_level="warning")
    spec = replica_spec(args, stack, STACK, config, None, torch.float32)
    path = os.pathsep.join(p for p in (source_path(), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "OMP_NUM_THREADS": str(threads), "RAY_DISABLE_USAGE_STATS": "1"}
    ray_replicas.init_ray(None, num_cpus=replicas * threads, runtime_env={"env_vars": env})
    deployment = None
    try:
        deployment = ray_replicas.deploy(spec, replicas, cpus_per_replica=float(threads), routing=routing,
                                         max_queue=max_queue)
        app = build_front(deployment, default_max_tokens=max_tokens, shutdown_timeout=5.0)
        with uvicorn_thread(app) as url:
            yield SimpleNamespace(url=url, deployment=deployment, stack=stack, config=config,
                                  tokenizer=deployment.info["tokenizer"])
    finally:
        if deployment is not None:
            deployment.close()
        else:
            serve.shutdown()
            ray_replicas.ray.shutdown()


async def stream(client, url: str, ids: list[int], max_tokens: int, on_text=None) -> dict:
    """One greedy streamed completion; -> text, ttft (to the first text, s), the final triforce
    field, and error (the error event's body, or None). `on_text()` runs (in a thread) at each text."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "seed": 0, "stream": True}
    t0 = time.perf_counter()
    out = {"text": "", "ttft": None, "triforce": None, "error": None, "status": None}
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread()).get("error")
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            piece = chunk["choices"][0]["text"] if chunk["choices"] else ""
            if piece and out["ttft"] is None:
                out["ttft"] = time.perf_counter() - t0
            if piece and on_text is not None:
                await asyncio.to_thread(on_text)
            out["text"] += piece
            if "stats" in chunk.get("triforce", {}):  # the last chunk's (the others carry a round's provenance)
                out["triforce"] = chunk["triforce"]
    return out


def stream_one(url: str, ids: list[int], max_tokens: int) -> dict:
    import httpx  # optional: httpx (the serve extra)

    async def go():
        async with httpx.AsyncClient() as client:
            return await stream(client, url, ids, max_tokens)

    return asyncio.run(go())


def kill_replica(name: str) -> None:
    """Kill one replica's actor (as a crash would: no graceful stop); Ray Serve starts another."""
    import ray  # optional: ray

    from .replicas import DEPLOYMENT  # optional: ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::{DEPLOYMENT}#{DEPLOYMENT}#{name}", namespace="serve"), no_restart=True)


def wait_healthy(replicas: int, healthy: bool = True, seconds: float = 180.0) -> float:
    """Wait until the deployment runs `replicas` healthy replicas (healthy=False: until it does not);
    -> seconds waited."""
    from ray import serve  # optional: ray

    from .replicas import DEPLOYMENT  # optional: ray

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        status = serve.status().applications[DEPLOYMENT].deployments[DEPLOYMENT]
        up = status.replica_states.get("RUNNING", 0) == replicas and status.status == "HEALTHY"
        if up == healthy:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise TimeoutError(f"the deployment was {'not ' if healthy else ''}back to {replicas} healthy replicas "
                       f"after {seconds:g} s")
