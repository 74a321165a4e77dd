"""Optional compiled CPU kernels (the `triforce_cpu` extension: attention.cpp, layer_ops.cpp, linear_panels.cpp),
built on first use with the system compiler (torch.utils.cpp_extension) and cached by PyTorch.
Every caller falls back to plain PyTorch when they are unavailable (no compiler, no AVX-512, or
TRIFORCE_KERNELS=0); `override` switches them for measurements and tests."""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).parent
_SOURCES = ("attention.cpp", "layer_ops.cpp", "linear_panels.cpp", "bindings.cpp")
_HEADERS = ("ops.h", "simd.h")
_NAME = "triforce_cpu"
_state: dict[str, object] = {}


def cpu():
    """The compiled module (decode_attention, rms_norm, rope_split, silu_mul, linear_panels), or None."""
    if "cpu" in _state:
        return _state["cpu"]
    module = None
    if os.environ.get("TRIFORCE_KERNELS", "1") != "0" and _cpu_has_avx512():
        try:
            from torch.utils.cpp_extension import load

            _ninja_on_path()
            if not _cached():
                print("triforce: compiling the CPU kernels (once, about a minute)...", file=sys.stderr, flush=True)
            # PyTorch rebuilds when a source or a flag changes, not a header: the headers' hash is a flag
            headers = hashlib.sha1(b"".join((_HERE / h).read_bytes() for h in _HEADERS)).hexdigest()[:12]
            module = load(_NAME, [str(_HERE / s) for s in _SOURCES],
                          extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DTRIFORCE_HEADERS={headers}"],
                          extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure means: use PyTorch's kernels
            print(f"triforce: CPU kernels unavailable ({type(e).__name__}: {str(e)[:200]}); using PyTorch",
                  file=sys.stderr)
            module = None
    _state["cpu"] = module
    return module


def for_tensor(x: torch.Tensor):
    """The compiled module if it applies to `x` (fp32 on the CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return cpu()


@contextlib.contextmanager
def override(module):
    """Use `module` (None: PyTorch only, or a wrapper of the real one) inside the block."""
    had, old = "cpu" in _state, _state.get("cpu")
    _state["cpu"] = module
    try:
        yield
    finally:
        if had:
            _state["cpu"] = old
        else:
            _state.pop("cpu", None)


def _ninja_on_path() -> None:
    """torch builds extensions with the `ninja` executable; the PyPI package ships one, which is not
    on PATH when a virtual environment's scripts are run without activating it."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            pass


def _cpu_has_avx512() -> bool:
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    except Exception:  # noqa: BLE001
        return False


def _cached() -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    try:
        return any(Path(_get_build_directory(_NAME, False)).glob("*.so"))
    except Exception:  # noqa: BLE001
        return False
