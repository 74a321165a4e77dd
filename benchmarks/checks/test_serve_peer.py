"""benchmarks/serve.py's vLLM peer, the parts that need no vLLM: a missing install is one clear line naming the fix, and
the figures reported from streamed timings."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import serve

SERVE = str(Path(serve.__file__))


def test_missing_vllm_names_the_install_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_CACHE_DIR", str(tmp_path))
    r = subprocess.run([sys.executable, SERVE, "--peer", "vllm", "--clients", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "run ./install.sh vllm" in r.stderr and "Traceback" not in r.stderr
    assert str(tmp_path / "vllm-venv" / "bin" / "python") in r.stderr


def test_a_python_without_vllm_is_refused_clearly(tmp_path):
    with pytest.raises(SystemExit, match="cannot import vLLM .*run ./install.sh vllm again"):
        serve._vllm_python(type("Args", (), {"peer_python": sys.executable if not _has_vllm() else "/bin/false"}))


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def test_side_stats_from_stream_timings():
    """Two requests: one chunk per token (a plain decoder) and chunks of two tokens (a speculating server)."""
    one = {"status": 200, "error": None, "first_at": 1.0, "last_at": 1.3, "tokens": 4, "times": [1.0, 1.1, 1.2, 1.3]}
    two = {"status": 200, "error": None, "first_at": 2.0, "last_at": 2.4, "tokens": 4, "times": [2.0, 2.4]}
    run = {"results": [one, two], "tokens": 8, "wall": 2.5, "decode_tokens_per_second": 6 / 0.7,
           "tokens_per_second": 8 / 2.5}
    s = serve._side_stats(run)
    assert s["completed"] == 2 and s["ttft_p50_s"] in (1.0, 2.0) and s["ttft_p99_s"] == 2.0
    assert s["itl_p50_ms"] == 100.0 and s["itl_p99_ms"] == 400.0  # gaps between chunks: 0.1, 0.1, 0.1, 0.4
    assert s["tpot_mean_ms"] == pytest.approx(1000 * (0.1 + 0.4 / 3) / 2, abs=0.1)
    assert s["chunks_per_token"] == 0.75
    failed = {**run, "results": [one, {**two, "status": 429, "error": "busy"}]}
    assert serve._side_stats(failed)["completed"] == 1 and serve._side_stats(failed)["errors"] == ["429 busy"]


@pytest.mark.parametrize("clients", ["1,x", "0", ""])
def test_bad_client_counts_are_one_line(clients, tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_CACHE_DIR", str(tmp_path))
    r = subprocess.run([sys.executable, SERVE, "--peer", "vllm", "--clients", clients],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "give request counts" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_a_sampled_load_sends_its_temperature_and_a_seed_per_request(temperature, monkeypatch):
    """--temperature reaches every request of a load, each with its own seed (its index), so that a sampled load
    can be run again; a greedy load sends no seed."""
    import asyncio
    import json

    import httpx

    bodies = []

    def reply(request):
        bodies.append(json.loads(request.content))
        chunk = {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(reply), **kw))
    run = asyncio.run(serve._load_once("http://peer", [[1, 2], [3], [4]], 8, 10.0, "m", temperature))
    assert run["tokens"] == 3 and [r["text"] for r in run["results"]] == ["a"] * 3
    assert [b["temperature"] for b in bodies] == [temperature] * 3
    seeds = [b.get("seed") for b in bodies]
    assert (seeds == [None] * 3) if temperature == 0 else sorted(seeds) == [0, 1, 2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_each_load_waits_for_the_machine_to_go_quiet_within_a_limit():
    """A side's load starts once the other side stopped using the CPUs (vLLM's engine polls a core for a second
    after its last request): while a thread spins, the wait runs to its limit; once the CPUs are quiet, a window.
    The quiet half reads made-up CPU ticks: the machine running the suite need not be quiet (another process's
    work made the real /proc/stat's wait run long once)."""
    import threading

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert serve.wait_until_quiet(limit=1.2, window=0.3) >= 1.2
    finally:
        stop.set()
        t.join()
    readings = iter([(0, 0), (90, 100), (180, 200), (185, 300), (190, 400)])  # busy 90%, 90%, then 5%
    assert 0.9 <= serve.wait_until_quiet(limit=5.0, window=0.3, ticks=lambda: next(readings)) < 1.5
    assert serve.wait_until_quiet(limit=5.0, window=0.3, ticks=lambda: None) == 0.3  # unreadable: one window


def _children(pid: int) -> list[int]:
    """The processes whose parent is pid (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_the_bench_leaves_no_server_behind_however_it_ends(sig, tmp_path):
    """The bench killed in the middle of its loads (SIGTERM: its `finally` stops the server; SIGKILL: nothing of it
    runs, and the server stops by itself through die_with_parent): within seconds no `triforce serve` it started is
    left running."""
    import os
    import signal
    import time

    server = None
    bench = subprocess.Popen([sys.executable, SERVE, "--peer", "none", "--methods", "ar", "--clients", "1",
                              "--prompt-tokens", "256", "--max-tokens", "4000", "--rounds", "3"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in bench.stdout:  # the load has begun once the warm-up's cold prefill is printed
            if "cold prefill" in line:
                server = next(p for p in _children(bench.pid) if "serve" in Path(f"/proc/{p}/cmdline").read_text())
                break
        assert server is not None, "the bench did not reach its loads"
        time.sleep(1.0)  # inside the first load
        bench.send_signal(getattr(signal, sig))
        deadline = time.monotonic() + 30
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server), f"triforce serve (pid {server}) still runs 30 s after the bench got {sig}"
    finally:
        bench.kill()
        bench.wait()
        if server is not None and _alive(server):  # (a failed check leaves nothing behind either)
            os.kill(server, signal.SIGKILL)
