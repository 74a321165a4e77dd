"""Ctrl-C that takes effect within a second, even while the main thread is inside a long PyTorch op.

Python raises KeyboardInterrupt only between bytecodes: a prefill chunk at 32K tokens or a GGUF
dequantisation keeps the main thread in C++ for seconds. `prompt_interrupts()` registers a wakeup
file descriptor, to which the C-level signal handler writes at once; a watcher thread reads it and,
if the main thread has not unwound within `grace` seconds, flushes what was printed, removes this
process's unfinished temporaries (storage) and exits with 130. Normally the main thread unwinds
first: KeyboardInterrupt runs every `finally` and the CLI exits with 130 itself.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from . import storage

EXIT_INTERRUPTED = 130


def _flush_stdout(timeout: float) -> None:
    # in a thread of its own: if the main thread were inside a write, flush() would wait on its lock
    t = threading.Thread(target=lambda: sys.stdout.flush(), daemon=True)
    t.start()
    t.join(timeout)


@contextlib.contextmanager
def prompt_interrupts(grace: float = 0.5):
    """For the block: a SIGINT ends the process within about `grace` seconds (exit code 130).
    A no-op outside the main thread (signal handlers belong to it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    finished = threading.Event()
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        os.close(r), os.close(w)
        yield
        return

    def watch():
        while not finished.is_set():
            try:
                got = os.read(r, 64)
            except OSError:
                return
            if not got:
                return
            if signal.SIGINT in got and not finished.is_set():
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and not finished.is_set():
                    time.sleep(0.02)
                if finished.is_set():
                    return
                _flush_stdout(0.2)
                storage.remove_own_temporaries()
                os.write(2, b"\ntriforce: interrupted\n")
                os._exit(EXIT_INTERRUPTED)

    watcher = threading.Thread(target=watch, name="triforce-interrupts", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        signal.set_wakeup_fd(previous)
        os.close(w)  # the watcher's read returns b""
        watcher.join(1.0)
        os.close(r)
