"""Build and load the compiled CPU kernels without ever wedging a later run.

PyTorch's JIT builder keeps one build folder per extension name and guards it with a `lock` file
that a killed build leaves behind: every later run then waits on it forever. Here instead:

- each build has its own folder, named by a key over everything the binary depends on (sources,
  headers, flags, torch version, compiler, and the CPU, since the flags say -march=native):
  `<cache>/kernels/<name>-<key>/` holding exactly one `*.so`;
- the build runs in a private temporary folder beside it (its own PyTorch lock is private too) and
  the finished folder is renamed into place: a folder under the final name is always complete;
- builders of one key take an flock (storage.exclusive): a killed holder's lock is free at once,
  a live one is waited for up to `TRIFORCE_KERNEL_WAIT` seconds (default 600), after which the run
  goes on without the kernels and says so once;
- temporaries of killed builds are removed by the next build.
If the cache cannot be written, the kernels are built in a temporary folder for this run only.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from .. import storage

DEFAULT_WAIT_SECONDS = 600.0  # a first build takes 85-115 s on 2 Zen 3 cores; a waiter gives up after this


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return f"{cxx}: {out.stdout.splitlines()[0] if out.stdout else out.returncode}"
    except (OSError, subprocess.SubprocessError):
        return f"{cxx}: unavailable"


def _compiles_with(flags: list[str]) -> bool:
    """Whether the C++ compiler ($CXX, else c++) compiles an empty unit with `flags`."""
    try:
        return subprocess.run([os.environ.get("CXX", "c++"), *flags, "-x", "c++", "-fsyntax-only", "-"], input="",
                              capture_output=True, text=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def compiler_accepts(flag: str) -> bool:
    """Whether the C++ compiler knows `flag` (an optional ISA flag an older compiler may not: -mavx512bf16 needs
    GCC 10, -mamx-tile GCC 11); asked once per flag and process."""
    if flag not in _ACCEPTS:
        _ACCEPTS[flag] = _compiles_with([flag])
    return _ACCEPTS[flag]


def accepted_flags(flags: list[str]) -> list[str]:
    """The flags the compiler knows, in order: one compiler run for all of them where it knows them all (the
    usual case; every process that loads the kernels asks), one per flag only where it does not."""
    if flags and not all(f in _ACCEPTS for f in flags) and _compiles_with(flags):
        _ACCEPTS.update(dict.fromkeys(flags, True))
    return [f for f in flags if compiler_accepts(f)]


_ACCEPTS: dict[str, bool] = {}


def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo ("" where it has none), or None where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return ""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; "" where it names none), or platform.processor() where that
    cannot be read."""
    model = _cpuinfo("model name")
    return platform.processor() if model is None else model


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"), or "" where it cannot say."""
    return _cpuinfo("vendor_id") or ""


def proc_cpu_flags() -> str | None:
    """The CPU's feature flags line as Linux writes it (/proc/cpuinfo), or None where it cannot be read."""
    return _cpuinfo("flags") or None


def _cpu_fingerprint() -> str:
    """What -march=native sees: the CPU model and its feature flags."""
    flags = proc_cpu_flags() or ""
    return f"{platform.machine()}|{cpu_model()}|{hashlib.sha1(flags.encode()).hexdigest()[:12]}"


def build_key(sources: list[Path], cflags: list[str]) -> str:
    h = hashlib.sha256()
    for s in sources:
        h.update(s.name.encode() + b"\0" + s.read_bytes() + b"\0")
    for part in (" ".join(cflags), torch.__version__, _compiler_version(), _cpu_fingerprint(), sys.version):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _import(name: str, so: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built(folder: Path) -> Path | None:
    """The one shared library of a finished build folder, or None."""
    found = sorted(folder.glob("*.so")) if folder.is_dir() else []
    return found[0] if len(found) == 1 else None


# The build, in a child process that leads its own process group. PyTorch's builder runs ninja with subprocess.run,
# which on an interrupt kills ninja alone; ninja runs each compiler in a process group of its own, so they ran on
# for half a minute after a Ctrl-C had ended the run. Ninja stops its compilers on SIGTERM: the child sends it to
# its group (ninja) when this process ends the build (an interrupt or an error here) or dies (PR_SET_PDEATHSIG).
_BUILD_CHILD = r"""
import ctypes, json, os, signal, sys
spec = json.loads(sys.argv[1])
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)  # ninja, which stops the compilers it started
    os._exit(1)
signal.signal(signal.SIGTERM, stop)
try:
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG (Linux)
except (OSError, AttributeError):
    pass
if os.getppid() != spec["parent"]:  # the parent died before the line above
    sys.exit(1)
from torch.utils.cpp_extension import load
load(spec["name"], spec["sources"], extra_cflags=spec["cflags"], extra_ldflags=spec["ldflags"],
     build_directory=spec["folder"], verbose=False)
"""


def _compile(name: str, sources: list[Path], headers: list[Path], cflags: list[str], ldflags: list[str],
             folder: Path) -> None:
    """Build into `folder` (private to this process) with PyTorch's builder, in a child process (_BUILD_CHILD)."""
    _ninja_on_path()
    # PyTorch rebuilds when a source or a flag changes, not a header: the headers' hash is a flag
    # (our folder key covers them too; this keeps PyTorch's own bookkeeping honest)
    hh = hashlib.sha1(b"".join(h.read_bytes() for h in headers)).hexdigest()[:12]
    spec = dict(name=name, sources=[str(s) for s in sources], cflags=cflags + [f"-DTRIFORCE_HEADERS={hh}"],
                ldflags=ldflags, folder=str(folder), parent=os.getpid())
    child = subprocess.Popen([sys.executable, "-c", _BUILD_CHILD, json.dumps(spec)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = child.communicate()
    except BaseException:
        child.terminate()  # (its handler stops ninja and so the compilers)
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        raise
    if child.returncode != 0:
        lines = output.strip().splitlines()
        detail = [line for line in lines if "error" in line.lower()][:5] or lines[-5:]
        raise RuntimeError(f"the kernel build exited with {child.returncode}: " + " | ".join(detail))


def build_and_load(name: str, sources: list[Path], headers: list[Path], cflags: list[str], ldflags: list[str],
                   cache_dir: Path | None = None, log=None) -> ModuleType:
    """The compiled module, from the cache or built now (see the module docstring). Raises on a
    failed build or a timed-out wait; the caller falls back to PyTorch."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    key = build_key(sources + headers, cflags + ldflags)
    root = (cache_dir or storage.cache_root()) / "kernels"
    final = root / f"{name}-{key}"
    so = _built(final)
    if so is not None:
        return _import(so.stem, so)
    try:
        storage.writable_dir(root)
    except storage.CacheUnwritable as e:
        log(f"triforce: {e}; building the CPU kernels for this run only")
        with tempfile.TemporaryDirectory(prefix="triforce-kernels-") as tmp:
            log("triforce: compiling the CPU kernels (a minute or two)...")
            _compile(name, sources, headers, cflags, ldflags, Path(tmp))
            so = _built(Path(tmp))
            return _import(so.stem, so)
    wait = float(os.environ.get("TRIFORCE_KERNEL_WAIT", DEFAULT_WAIT_SECONDS))
    with storage.exclusive(root / f"{name}-{key}.lock", "compiling the CPU kernels", wait, log):
        so = _built(final)  # another run may have finished the build while we waited
        if so is None:
            storage.remove_stale_temporaries(root)
            if final.exists():  # not a complete build (made by hand?): build it again
                shutil.rmtree(final, ignore_errors=True)
            t = time.perf_counter()
            log("triforce: compiling the CPU kernels (once, a minute or two)...")
            with storage.atomic_directory(final) as tmp:
                _compile(name, sources, headers, cflags, ldflags, tmp)
                if _built(tmp) is None:
                    raise RuntimeError(f"the build in {tmp} produced no single shared library")
            log(f"triforce: CPU kernels built in {time.perf_counter() - t:.0f} s, cached in {final}")
            so = _built(final)
    return _import(so.stem, so)


def _ninja_on_path() -> None:
    """torch builds extensions with the `ninja` executable; the PyPI package ships one, which is not
    on PATH when a virtual environment's scripts are run without activating it."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # optional: the ninja package (a build tool), checked only where it is missing

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            pass
