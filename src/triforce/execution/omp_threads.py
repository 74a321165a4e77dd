"""How many OpenMP threads this thread's own parallel regions use, set for this thread alone.

Why it matters: PyTorch's CPU kernels (ours too, through at::parallel_for) run on OpenMP, and GNU OpenMP (libgomp,
which PyTorch ships) gives every thread that opens a parallel region a team of its own. While the process holds
more OpenMP threads than the machine has cores, libgomp's idle workers stop spinning between regions and sleep
(its "throttled" spin), and every region then waits for its workers to wake. A decode forward opens a few hundred
regions, so this costs a third of its time: eight 8K decode steps batched took 84 ms from the main thread alone
and 108-111 ms once one other thread had run a parallel region (2-core Xeon, benchmarks/omp_teams.py).
A server whose request threads each ran a little PyTorch work (sampling over the vocabulary, zeroing a cache)
would make a team on each of them; the serving gate instead runs every request's generation and every forward on
one thread of its own (execution/batching.py), and a request's own thread (its caches' release) keeps to one OpenMP
thread (`one_thread`), which opens no team at all.

torch.set_num_threads cannot do this: it sets the process-wide default as well as the calling thread's. OpenMP's
omp_set_num_threads sets the calling thread's alone; it is called from the OpenMP runtime PyTorch has loaded. Where
none is found (another platform or build), nothing is changed."""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from functools import cache

import torch

_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@cache
def _runtime():
    """The OpenMP runtime loaded in this process (PyTorch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if any(path.rsplit("/", 1)[-1].startswith(name + ".so") for name in _RUNTIMES):
            try:
                lib = ctypes.CDLL(path)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                return lib
            except (OSError, AttributeError):
                continue
    return None


def set_this_thread(n: int) -> bool:
    """Parallel regions opened by this thread from now on use at most n threads; -> whether it could be set."""
    lib = _runtime()
    if lib is None:
        return False
    torch.get_num_threads()  # PyTorch sets a thread's count the first time the thread asks: let it do so first
    lib.omp_set_num_threads(n)
    return True


def release_this_thread() -> bool:
    """Free the OpenMP team this thread holds (its workers exit; a later parallel region of the thread makes a new
    one): OpenMP 5's omp_pause_resource_all(omp_pause_soft), which libgomp implements as exactly this. -> whether
    the runtime has it."""
    lib = _runtime()
    pause = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    return pause(1) == 0  # 1: omp_pause_soft


@contextmanager
def one_thread():
    """This thread's PyTorch work in the block runs on this thread alone (see the module docstring)."""
    before = torch.get_num_threads()
    changed = set_this_thread(1)
    try:
        yield
    finally:
        if changed:
            set_this_thread(before)
