"""Fault injection: interrupted, killed, concurrent runs, unwritable caches and a full disk.

Each test starts from fresh cache directories, injects a fault, runs again and checks that the next
run completes (with the same output where there is one) and that nothing partial is left.
The cheap ones run by default (the PyTorch fallback, TRIFORCE_KERNELS=0, where the kernels are not
what is tested); the ones that compile the kernels from scratch several times are marked `faults`:

    python -m pytest -m faults tests/test_faults.py

Each test adds a row (fault, point, what the next run did, its time) to the table printed at the
end of the session (docs/faults.md holds a copy).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import embedded_available
from triforce import storage

TABLE: list[tuple[str, str, str, float]] = []
needs_model = pytest.mark.skipif(not embedded_available(), reason="embedded model not installed")
GEN = ["generate", "--demo-tokens", "700", "--max-new-tokens", "24", "--gamma", "3"]


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    if TABLE:
        lines = ["| fault | point | next run | its time |", "|---|---|---|---|"]
        lines += [f"| {f} | {p} | {w} | {t:.1f} s |" for f, p, w, t in TABLE]
        print("\n" + "\n".join(lines))
        if os.environ.get("TRIFORCE_FAULTS_TABLE"):
            with open(os.environ["TRIFORCE_FAULTS_TABLE"], "a") as f:
                f.write("\n".join(lines[2:]) + "\n")


class Run:
    """`python -m triforce ARGS` in the background, its output collected as it comes."""

    def __init__(self, args, env, limit_file_size: int | None = None):
        def preexec():
            os.setsid()  # its own process group: a SIGKILL test kills the compiler children too
            # SIGINT at its default, as a terminal's Ctrl-C finds it: a suite started in the background (`nohup ... &`
            # without job control) hands its children SIGINT ignored, and Python then never sees it
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if limit_file_size is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

        self.t0 = time.monotonic()
        self.p = subprocess.Popen([sys.executable, "-m", "triforce", *args], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, preexec_fn=preexec)
        self.out, self.err = bytearray(), bytearray()
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for r in self._readers:
            r.start()

    @staticmethod
    def _read(stream, buf):
        for chunk in iter(lambda: stream.read1(4096), b""):
            buf.extend(chunk)

    def wait_for(self, predicate, timeout: float = 300.0) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            if self.p.poll() is not None:
                raise AssertionError(f"exited {self.p.returncode} before the fault point:\n{self.stderr}")
            if time.monotonic() > end:
                raise AssertionError(f"fault point not reached in {timeout} s:\n{self.stderr}")
            time.sleep(0.05)

    def signal(self, sig, group: bool = False) -> float:
        t = time.monotonic()
        if group:
            os.killpg(self.p.pid, sig)
        else:
            self.p.send_signal(sig)
        return t

    def finish(self, timeout: float = 900.0) -> int:
        self.p.wait(timeout)
        for r in self._readers:
            r.join(5)
        self.seconds = time.monotonic() - self.t0
        return self.p.returncode

    @property
    def stdout(self) -> str:
        return self.out.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.decode(errors="replace")


def env_for(cache: Path, kernels: bool = False, **extra) -> dict:
    env = dict(os.environ, TRIFORCE_CACHE_DIR=str(cache), TRIFORCE_KERNELS="1" if kernels else "0", **extra)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def complete(args, env, **kw) -> Run:
    r = Run(args, env, **kw)
    assert r.finish() == 0, r.stderr
    return r


def tokens_of(run: Run) -> list[int]:
    return json.loads(run.stdout)["token_ids"]


def leftovers(root: Path) -> list[Path]:
    """Temporaries under `root` (what a killed or failed write could leave)."""
    return [p for p in root.rglob(".tmp-*")] if root.exists() else []


def no_traceback(run: Run) -> None:
    assert "Traceback" not in run.stderr, run.stderr


def processes_working_in(root: Path, within: float = 10.0) -> list[str]:
    """The processes whose working directory is under `root` (a kernel build's ninja and compilers run in its
    folder) once `within` seconds have passed without them going (Linux /proc), each as its command line."""
    def working() -> list[str]:
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if Path(os.readlink(proc / "cwd")).is_relative_to(root):
                    found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
            except OSError:
                pass
        return found

    end = time.monotonic() + within
    while (found := working()) and time.monotonic() < end:
        time.sleep(0.25)
    return found


# ---------------------------------------------------------------- storage primitives (always run)

def test_atomic_write_failure_leaves_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    storage.atomic_write(path, "old")

    def broken_replace(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        storage.atomic_write(path, "new")
    assert path.read_text() == "old"
    assert leftovers(tmp_path) == []


def _hold_lock(lock: Path) -> subprocess.Popen:
    code = ("import sys, time; from pathlib import Path; from triforce import storage\n"
            "with storage.exclusive(Path(sys.argv[1]), 'testing', 5):\n"
            "    print('held', flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_lock_of_a_killed_holder_is_free_at_once(tmp_path):
    lock = tmp_path / "x.lock"
    holder = _hold_lock(lock)
    holder.kill()
    holder.wait()
    t = time.monotonic()
    with storage.exclusive(lock, "testing", wait_seconds=60):
        pass
    # milliseconds when free; a lock still held would wait the full 60 s. 10 s tells the two apart on any host
    assert time.monotonic() - t < 10
    TABLE.append(("SIGKILL", "holding a lock", "took the lock over at once", time.monotonic() - t))


def test_lock_of_a_live_holder_is_waited_for_with_a_bound(tmp_path):
    lock = tmp_path / "x.lock"
    holder = _hold_lock(lock)
    messages = []
    try:
        t = time.monotonic()
        with pytest.raises(storage.LockTimeout, match=f"PID {holder.pid}"):
            with storage.exclusive(lock, "testing", wait_seconds=1.0, log=messages.append):
                pass
        # the 1 s bound, then the error: generous above (a loaded host), as an unbounded wait never returns
        assert 0.9 < time.monotonic() - t < 30
        assert len(messages) == 1 and f"PID {holder.pid}" in messages[0] and str(lock) in messages[0]
    finally:
        holder.kill()
        holder.wait()


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".tmp-{int(dead.stdout)}-abc"
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"x")
    mine = storage.temporary_path(tmp_path)
    mine.write_text("in progress")
    assert storage.remove_stale_temporaries(tmp_path) == [stale]
    assert not stale.exists() and mine.exists()
    storage.remove_own_temporaries()
    assert not mine.exists()


# ---------------------------------------------------------------- kernel builds without a compiler run

def _real_kernel_library():
    from triforce import kernels

    module = kernels.cpu()
    if module is None:
        pytest.skip("the CPU kernels are not available here")
    so = Path(module.__file__)
    if not so.exists():  # built by this process (a fresh cache, as in CI): loaded from the build's temporary
        # folder, since renamed into place
        so = next((storage.cache_root() / "kernels").glob(f"*/{so.name}"))
    return so


def test_kernel_build_after_a_killed_build_and_under_a_live_one(tmp_path, monkeypatch):
    """The build logic of kernels/build.py with the compiler replaced by a copy of the built library:
    a dead builder's lock and temporaries do not stop the next build; a live builder is waited for
    up to the bound, then the run goes on without kernels; an interrupted build leaves nothing."""
    import shutil

    from triforce import kernels
    from triforce.kernels import build

    so = _real_kernel_library()
    calls = []

    def fake_compile(name, sources, headers, cflags, ldflags, folder):
        calls.append(folder)
        shutil.copy(so, Path(folder) / so.name)

    monkeypatch.setattr(build, "_compile", fake_compile)
    args = ("triforce_cpu", [kernels._HERE / s for s in kernels._SOURCES], [kernels._HERE / h for h in kernels._HEADERS],
            ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"])
    root = tmp_path / "kernels"
    key = build.build_key(args[1] + args[2], args[3] + args[4])
    # a killed build: its lock file and half-built folder are left behind
    root.mkdir()
    holder = _hold_lock(root / f"triforce_cpu-{key}.lock")
    holder.kill()
    holder.wait()
    (root / f".tmp-{holder.pid}-dead").mkdir()
    (root / f".tmp-{holder.pid}-dead" / "attention.o").write_bytes(b"half")
    t = time.monotonic()
    build.build_and_load(*args, cache_dir=tmp_path, log=lambda m: None)
    assert (root / f"triforce_cpu-{key}" / so.name).is_file() and len(calls) == 1
    assert leftovers(tmp_path) == []
    TABLE.append(("SIGKILL (simulated: lock and half-built folder left)", "kernel build", "built at once",
                  time.monotonic() - t))
    # cached now: no second build
    build.build_and_load(*args, cache_dir=tmp_path, log=lambda m: None)
    assert len(calls) == 1

    # a live builder of another key holds the lock: bounded wait, then no kernels and one message
    other = tmp_path / "other"
    (other / "kernels").mkdir(parents=True)
    holder = _hold_lock(other / "kernels" / f"triforce_cpu-{key}.lock")
    try:
        monkeypatch.setenv("TRIFORCE_KERNEL_WAIT", "1")
        with pytest.raises(storage.LockTimeout):
            build.build_and_load(*args, cache_dir=other, log=lambda m: None)
    finally:
        holder.kill()
        holder.wait()

    # interrupted inside the compiler: no folder under the final name, no temporaries
    def interrupted(*a):
        (Path(a[-1]) / "attention.o").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "_compile", interrupted)
    third = tmp_path / "third"
    with pytest.raises(KeyboardInterrupt):
        build.build_and_load(*args, cache_dir=third, log=lambda m: None)
    assert leftovers(third) == [] and not (third / "kernels" / f"triforce_cpu-{key}").exists()


# ---------------------------------------------------------------- the CLI, PyTorch fallback (always run)

@needs_model
def test_ctrl_c_during_generation_keeps_the_text_and_exits_130(tmp_path):
    env = env_for(tmp_path / "cache")
    complete(["generate", "--prompt", "hi", "--max-new-tokens", "1", "--quiet"], env)  # convert once
    r = Run(["generate", "--demo-tokens", "300", "--max-new-tokens", "2000", "--method", "ar"], env)
    r.wait_for(lambda: len(r.out.strip()) > 20)
    printed = bytes(r.out)
    t = r.signal(signal.SIGINT)
    assert r.finish(60) == 130, r.stderr
    took = time.monotonic() - t
    # About 0.6 s on an idle machine (the watcher exits within half a second, then the interpreter's exit);
    # 1.7 s was seen on an idle AVX2 machine and more on a loaded 2-core one. The run left alone would
    # generate 2000 tokens (a minute or more), so 15 s still tells "stopped by Ctrl-C" from "ran on".
    assert took < 15, took
    no_traceback(r)
    assert "interrupted" in r.stderr
    assert r.out.startswith(printed) and len(r.stdout.strip()) > 20  # the text printed before Ctrl-C is kept
    TABLE.append(("SIGINT", "generation (CLI)", "exit 130, printed text kept", took))


@needs_model
def test_ctrl_c_during_prefill_stops_within_a_second(tmp_path):
    env = env_for(tmp_path / "cache")
    complete(["generate", "--prompt", "hi", "--max-new-tokens", "1", "--quiet"], env)
    r = Run(["generate", "--demo-tokens", "4000", "--max-new-tokens", "8", "--prefill-chunk", "2048"], env)
    r.wait_for(lambda: b"prefill" in r.err)
    time.sleep(0.5)
    t = r.signal(signal.SIGINT)
    assert r.finish(60) == 130, r.stderr
    took = time.monotonic() - t
    # About 0.6 s idle. A chunk of 2048 tokens takes about 5 s on an idle 2-core machine and longer on a
    # loaded one, so a stop that waited for the end of the chunk would show in the progress bar: the first
    # chunk never finished, whatever the load. The time bound itself is generous (a loaded host).
    assert "2048/" not in r.stderr, r.stderr
    assert took < 15, took
    no_traceback(r)
    TABLE.append(("SIGINT", "prefill (2048-token chunks)", "exit 130", took))


@needs_model
@pytest.mark.parametrize("weights,damaged", [("native", "tokenizer.json"), ("fp32", "model.safetensors")])
def test_damaged_conversion_is_rebuilt_with_a_log_line(tmp_path, weights, damaged):
    """native: the cached tokenizer of the GGUF file; fp32: its cached fp32 conversion."""
    env = env_for(tmp_path / "cache")
    args = ["generate", "--prompt", "The cat", "--max-new-tokens", "6", "--json", "--method", "ar", "--weights", weights]
    first = complete(args, env)
    entry = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir() and (p / "manifest.json").exists())
    path = entry / damaged
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)  # as a crash or a full disk could leave it
    again = complete(args, env)
    assert "damaged" in again.stderr and "converting again" in again.stderr
    assert tokens_of(again) == tokens_of(first)
    TABLE.append((f"truncated {damaged}", f"cached GGUF conversion (--weights {weights})", "converted again, same output",
                  again.seconds))


@needs_model
def test_unwritable_cache_directory_runs_without_caching(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = env_for(blocker / "cache")
    r = complete(["generate", "--prompt", "The cat", "--max-new-tokens", "6", "--json", "--method", "ar"], env)
    no_traceback(r)
    assert str(blocker / "cache") in r.stderr and "TRIFORCE_CACHE_DIR" in r.stderr and "this run only" in r.stderr
    ref = complete(["generate", "--prompt", "The cat", "--max-new-tokens", "6", "--json", "--method", "ar"],
                   env_for(tmp_path / "ok"))
    assert tokens_of(r) == tokens_of(ref)
    TABLE.append(("cache directory not writable", "GGUF conversion", "converted for this run only, same output",
                  r.seconds))


@needs_model
def test_full_disk_is_one_clear_error_and_leaves_nothing(tmp_path):
    cache = tmp_path / "cache"
    r = Run(["generate", "--prompt", "The cat", "--max-new-tokens", "6", "--method", "ar", "--weights", "fp32"],
            env_for(cache), limit_file_size=64 << 20)  # `ulimit -f`: the 538 MB fp32 conversion cannot be written
    assert r.finish() == 2, r.stderr
    no_traceback(r)
    assert "TRIFORCE_CACHE_DIR" in r.stderr and str(cache) in r.stderr
    assert leftovers(cache) == [] and not any(p.is_dir() for p in cache.iterdir())
    again = complete(["generate", "--prompt", "The cat", "--max-new-tokens", "6", "--method", "ar", "--quiet",
                      "--weights", "fp32"], env_for(cache))
    TABLE.append(("full disk (ulimit -f 64 MiB)", "GGUF fp32 conversion", "exit 2, one message; next run converted",
                  again.seconds))


@needs_model
def test_results_survive_an_interrupted_bench(tmp_path):
    """bench writes its results after every finished row: a kill keeps the rows it finished."""
    env = env_for(tmp_path / "cache")
    out = tmp_path / "bench"
    r = Run(["bench", "--context-lengths", "600", "--methods", "ar,ngram,streaming", "--temperatures", "0",
             "--max-new-tokens", "8", "--out", str(out), "--quiet"], env)
    r.wait_for(lambda: (out / "results.json").exists(), timeout=600)
    r.signal(signal.SIGKILL)
    r.finish()
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert runs and runs[0]["method"] == "ar"
    # a kill in the middle of writing results.md or the plot leaves that write's temporary (the file
    # it was replacing is whole); the next write of results there removes it
    assert all(p.name.startswith(f".tmp-{r.p.pid}-") for p in leftovers(out)), leftovers(out)
    from triforce.bench.results import write_outputs

    write_outputs(out, runs, results["rows"], results["meta"])
    assert leftovers(out) == []
    TABLE.append(("SIGKILL", "bench, after its first row", "results.json holds the finished rows", r.seconds))


# ---------------------------------------------------------------- kernels compiled for real (-m faults)

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A cache made by one complete run with the kernels, and that run's tokens."""
    cache = tmp_path_factory.mktemp("reference")
    run = complete(GEN + ["--json"], env_for(cache, kernels=True))
    return cache, tokens_of(run)


def _seed_kernels(reference_cache: Path, cache: Path) -> None:
    """Give a fresh cache the reference's built kernels (where the fault is not in the build)."""
    import shutil

    shutil.copytree(reference_cache / "kernels", cache / "kernels", ignore=shutil.ignore_patterns("*.lock"))


@needs_model
@pytest.mark.faults
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_killed_kernel_build_then_a_normal_run(tmp_path, sig, reference):
    cache = tmp_path / "cache"
    env = env_for(cache, kernels=True)
    complete(["generate", "--prompt", "hi", "--max-new-tokens", "1", "--quiet"], env_for(cache))  # convert first
    r = Run(GEN + ["--json"], env)
    r.wait_for(lambda: b"compiling the CPU kernels" in r.err)
    time.sleep(8)
    t = r.signal(sig, group=sig == signal.SIGKILL)  # SIGKILL: as a closed terminal kills the whole job
    code = r.finish(60)
    # nothing of the build runs on: ninja gives each compiler a process group of its own, out of reach of a signal
    # to the run's group and of PyTorch's builder, which kills ninja alone (they ran on for half a minute)
    assert processes_working_in(cache) == []
    if sig == signal.SIGINT:
        # a few seconds at most; the build left alone runs for a minute or more, so 30 s allows a loaded host
        assert code == 130 and time.monotonic() - t < 30
        no_traceback(r)
        assert leftovers(cache) == []
    again = complete(GEN + ["--json"], env)
    assert "built in" in again.stderr
    assert tokens_of(again) == reference[1]
    TABLE.append((signal.Signals(sig).name, "kernel build, 8 s in", "built the kernels and completed, same output",
                  again.seconds))


@needs_model
@pytest.mark.faults
def test_two_fresh_runs_at_once(tmp_path):
    env = env_for(tmp_path / "cache", kernels=True)
    a, b = Run(GEN + ["--json"], env), Run(GEN + ["--json"], env)
    assert a.finish() == 0, a.stderr
    assert b.finish() == 0, b.stderr
    assert tokens_of(a) == tokens_of(b)
    assert (a.stderr + b.stderr).count("built in") == 1  # one built, the other waited and loaded it
    TABLE.append(("two fresh runs at once", "conversion and kernel build", "both completed, identical output",
                  max(a.seconds, b.seconds)))


@needs_model
@pytest.mark.faults
@pytest.mark.parametrize("point", ["conversion", "prefill", "generation"])
def test_sigkill_then_the_same_output(tmp_path, point, reference):
    cache = tmp_path / "cache"
    env = env_for(cache, kernels=True)
    _seed_kernels(reference[0], cache)
    if point != "conversion":
        complete(["generate", "--prompt", "hi", "--max-new-tokens", "1", "--quiet"], env)
    weights = ["--weights", "fp32"] if point == "conversion" else []  # native loads convert no weights
    r = Run(GEN[:-4] + ["--max-new-tokens", "400"] + weights, env)
    if point == "conversion":
        r.wait_for(lambda: b"dequantising" in r.err)
    elif point == "prefill":
        r.wait_for(lambda: b"prefill" in r.err)
    else:
        r.wait_for(lambda: len(r.out) > 10)
    r.signal(signal.SIGKILL, group=True)
    r.finish()
    again = complete(GEN + ["--json"] + weights, env)
    assert tokens_of(again) == reference[1]  # (fp32 weights: the same greedy tokens as native on this prompt)
    TABLE.append(("SIGKILL", point, "completed, same output", again.seconds))


@needs_model
@pytest.mark.faults
def test_unwritable_kernel_cache_builds_for_this_run(tmp_path, reference):
    cache = tmp_path / "cache"
    complete(["generate", "--prompt", "hi", "--max-new-tokens", "1", "--quiet"], env_for(cache))
    (cache / "kernels").write_text("a file where the kernels folder should be")
    r = complete(GEN + ["--json"], env_for(cache, kernels=True))
    assert "for this run only" in r.stderr and "TRIFORCE_CACHE_DIR" in r.stderr
    no_traceback(r)
    assert tokens_of(r) == reference[1]
    TABLE.append(("kernel cache not writable", "kernel build", "built for this run only, same output", r.seconds))


def _serving(env, log: Path, *args):
    """`triforce serve` (one request at a time) on a free loopback port, once it answers /health."""
    from triforce.serving.harness import ServerProcess

    return ServerProcess(["--max-batch", "1", *args], log, ready_seconds=300, env=env)


def _manifest_files(folder: Path) -> dict[str, int]:
    """The block files the prefix cache's manifest under `folder` lists -> their bytes ({} without a manifest)."""
    manifest = next(folder.glob("*/manifest.json"), None)
    entries = json.loads(manifest.read_text())["blocks"].values() if manifest else ()
    return {e["file"]: e["bytes"] for e in entries}


@needs_model
@pytest.mark.faults
def test_sigkill_while_a_server_writes_its_prefix_cache(tmp_path):
    """A server killed (SIGKILL) while it writes a prompt's prefix-cache blocks to --kv-cache-dir: the next server
    on that folder starts, removes what the kill left half-written, and answers the prompt exactly as a server
    without a cache did."""
    import httpx

    from triforce.corpus import demo_text

    env = env_for(tmp_path / "cache")
    folder = tmp_path / "kv"
    body = {"prompt": demo_text()[:9000], "max_tokens": 16, "temperature": 0}  # ~2.6K tokens: 5 blocks of 512

    def answer(url: str) -> dict:
        return httpx.post(url + "/v1/completions", json=body, timeout=600).json()

    plain = _serving(env, tmp_path / "plain.log")
    reference = answer(plain.url)["choices"][0]["text"]
    assert plain.stop() == 0, (tmp_path / "plain.log").read_text()

    # the kill: as soon as the first block file is being written or written (the manifest listing the blocks is
    # written after all of them, so the folder is caught half-done)
    writing = _serving(env, tmp_path / "writing.log", "--kv-cache-dir", str(folder))

    def ask_and_lose_the_answer():
        with contextlib.suppress(httpx.HTTPError):  # (the server dies before it answers)
            httpx.post(writing.url + "/v1/completions", json=body, timeout=600)

    threading.Thread(target=ask_and_lose_the_answer, daemon=True).start()
    deadline = time.monotonic() + 600
    while not (leftovers(folder) or any(folder.glob("*/*.safetensors"))):  # (polled tightly: writes are quick)
        assert time.monotonic() < deadline and writing.proc.poll() is None, (tmp_path / "writing.log").read_text()
        time.sleep(0.001)
    t = time.monotonic()
    writing.proc.kill()
    writing.stop()
    listed = _manifest_files(folder)
    unlisted = [f for f in folder.glob("*/*.safetensors") if f.name not in listed]
    assert leftovers(folder) or unlisted, "the kill should have left the folder half-written"

    again = _serving(env, tmp_path / "again.log", "--kv-cache-dir", str(folder))
    took = time.monotonic() - t
    assert not leftovers(folder)  # the start-up removed the dead writer's temporaries
    first, second = answer(again.url), answer(again.url)
    log = tmp_path / "again.log"
    assert again.stop() == 0, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()
    assert first["choices"][0]["text"] == reference and second["choices"][0]["text"] == reference
    assert second["triforce"]["prefix_cache_tokens"] > 0  # the folder works again: the prompt's blocks are reused
    for name, size in _manifest_files(folder).items():  # every block listed has its whole file
        assert (next(folder.glob("*/")) / name).stat().st_size == size
    TABLE.append(("SIGKILL", "server writing its prefix cache (--kv-cache-dir)",
                  "next server started, unlisted block files removed, same answer", took))
