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


class Backend:
    """Which operations a model's layers run, chosen once when the model is built
    (Transformer.select_backend): the compiled CPU kernels for an fp32 model on the CPU where they
    build, else PyTorch's. Every layer of the model holds the same Backend and reads `ops` (the
    module, or None for PyTorch); `override` swaps what an enabled Backend returns (tests, A/B runs)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    @property
    def ops(self):
        return cpu() if self.enabled else None

    @classmethod
    def for_model(cls, device: torch.device | str, dtype: torch.dtype) -> Backend:
        return cls(torch.device(device).type == "cpu" and dtype == torch.float32 and cpu() is not None)


TORCH = Backend(False)  # PyTorch's operations only: layers not (yet) part of a built model


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
