"""Files the project writes: where its cache lives, atomic writes, and locks that die with their holder.

Invariants every writer here keeps, so that an interrupted, killed or concurrent run never leaves
something that breaks or hangs the next one:
- a file or folder appears under its final name complete, or not at all: it is written under a
  temporary name in the same directory (`.tmp-<pid>-...`), flushed, and renamed (atomic on POSIX);
- temporaries left by a killed process are recognised by the dead PID in their name and removed by
  the next run (`remove_stale_temporaries`);
- a lock is an `flock` on a file: the kernel releases it the moment its holder dies, so a dead
  holder's lock is free at once; the file records who holds it (PID, host, start time) for the
  message a waiting run prints, and a live holder is waited for only up to a bound.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from .errors import TriforceError

CACHE_ENV = "TRIFORCE_CACHE_DIR"
_TMP_PREFIX = ".tmp-"
_pending: set[Path] = set()  # temporaries of this process not yet renamed into place


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """--cache-dir, else $TRIFORCE_CACHE_DIR, else $XDG_CACHE_HOME/triforce or ~/.cache/triforce."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "triforce"


class CacheUnwritable(TriforceError):
    """The cache directory cannot be created or written (read-only, full disk, file size limit)."""

    def __init__(self, directory: Path, error: BaseException):
        self.directory = directory
        super().__init__(f"cannot write to the cache directory {directory} ({_describe(error)}): "
                         f"free some space there, or point {CACHE_ENV} (or --cache-dir) to a writable directory")


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"


def writable_dir(directory: Path) -> Path:
    """Create `directory` if needed; CacheUnwritable if that or writing in it fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=f"{_TMP_PREFIX}{os.getpid()}-probe-")
        probe.close()
    except OSError as e:
        raise CacheUnwritable(directory, e) from e
    return directory


def temporary_path(directory: Path, suffix: str = "") -> Path:
    """A fresh name in `directory` for something written there and renamed into place later; the
    PID in it lets a later run recognise (and remove) what a killed process left."""
    fd, name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", suffix=suffix, dir=directory)
    os.close(fd)
    os.unlink(name)
    _pending.add(Path(name))
    return Path(name)


def _remove(tmp: Path) -> None:
    _pending.discard(tmp)
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            tmp.unlink()


def remove_own_temporaries() -> None:
    """Remove this process's unfinished temporaries (for an exit that skips `finally` blocks)."""
    for tmp in list(_pending):
        _remove(tmp)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` atomically: a temporary file in the same directory, fsync, rename.
    On any failure the temporary is removed and `path` is untouched; the OSError propagates."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_file(path: Path):
    """Yields a temporary path next to `path` (same suffix); a file written there is renamed to
    `path` when the block ends without an exception (for writers that take a file name, such as
    savefig). If the block wrote nothing, `path` is left as it was."""
    path = Path(path)
    tmp = temporary_path(path.parent, path.suffix)
    try:
        yield tmp
        if tmp.exists():
            os.replace(tmp, path)
    finally:
        _remove(tmp)


@contextlib.contextmanager
def atomic_directory(target: Path):
    """Yields an empty temporary folder beside `target`; filled in the block, it is renamed to
    `target` at the end. If `target` appeared meanwhile (a concurrent run made it), ours is
    dropped: both hold the same content. On an exception the temporary folder is removed."""
    target = Path(target)
    tmp = temporary_path(target.parent)
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        _remove(tmp)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove `.tmp-<pid>-*` entries of `directory` whose process is gone; -> what was removed."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for p in entries:
        if not p.name.startswith(_TMP_PREFIX):
            continue
        try:
            pid = int(p.name[len(_TMP_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        _remove(p)
        removed.append(p)
    return removed


class LockTimeout(TriforceError):
    pass


@contextlib.contextmanager
def exclusive(lock_path: Path, what: str, wait_seconds: float, log=None):
    """Hold an exclusive lock on `lock_path` for the block (`what` names the work for messages).

    A lock whose holder died is free at once (flock). A live holder is waited for, with one message
    saying who holds it, for at most `wait_seconds`; then LockTimeout. The lock file itself stays
    (removing it would race with a waiter); it holds only the last holder's description.
    """
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    lock_path = Path(lock_path)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_seconds
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if not told:
                holder = _read_holder(fd)
                log(f"triforce: waiting for another run ({holder}) that is {what}; "
                    f"at most {wait_seconds:.0f} s (lock {lock_path})")
                told = True
            if time.monotonic() >= deadline:
                raise LockTimeout(f"another run ({_read_holder(fd)}) is still {what} after {wait_seconds:.0f} s "
                                  f"(lock {lock_path})")
            time.sleep(0.2)
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        age = time.time() - float(info["started"])
        return f"PID {info['pid']} on {info['host']}, started {age:.0f} s ago"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
