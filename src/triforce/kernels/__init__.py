"""Optional compiled CPU kernels (the `triforce_cpu` extension: attention.cpp, layer_ops.cpp, linear_panels.cpp),
built on first use with the system compiler and cached under the project's cache directory (build.py:
a killed or concurrent build never wedges a later run).
Every caller falls back to plain PyTorch when they are unavailable (no compiler, no AVX-512, or
TRIFORCE_KERNELS=0); `override` switches them for measurements and tests."""
from __future__ import annotations

import contextlib
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
        from .build import build_and_load

        try:
            module = build_and_load(_NAME, [_HERE / s for s in _SOURCES], [_HERE / h for h in _HEADERS],
                                    cflags=["-O3", "-march=native", "-fopenmp"], ldflags=["-fopenmp"])
        except Exception as e:  # noqa: BLE001 - a failed build or wait means: use PyTorch's kernels
            print(f"triforce: CPU kernels unavailable ({type(e).__name__}: {str(e)[:300]}); using PyTorch",
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


def _cpu_has_avx512() -> bool:
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    except Exception:  # noqa: BLE001
        return False
