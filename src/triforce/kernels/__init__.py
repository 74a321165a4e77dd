"""Optional compiled kernels, built on first use with the system compiler (torch.utils.cpp_extension)
and cached by PyTorch; every caller falls back to plain PyTorch when they are unavailable
(no compiler, no AVX-512, or TRIFORCE_KERNELS=0)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

_state: dict[str, object] = {}


def decode_attention():
    """The compiled decode-attention module (its function `decode_attention`), or None."""
    if "decode_attention" in _state:
        return _state["decode_attention"]
    module = None
    if os.environ.get("TRIFORCE_KERNELS", "1") != "0" and _cpu_has_avx512():
        try:
            from torch.utils.cpp_extension import load

            _ninja_on_path()
            if not _cached():
                print("triforce: compiling the CPU decode-attention kernel (once, about a minute)...",
                      file=sys.stderr, flush=True)
            module = load("triforce_decode_attention", [str(Path(__file__).with_name("decode_attention.cpp"))],
                          extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                          verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure means: use PyTorch's kernels
            print(f"triforce: CPU decode-attention kernel unavailable ({type(e).__name__}: {str(e)[:200]}); "
                  f"using PyTorch attention", file=sys.stderr)
            module = None
    _state["decode_attention"] = module
    return module


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
        import torch

        return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    except Exception:  # noqa: BLE001
        return False


def _cached() -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    try:
        return any(Path(_get_build_directory("triforce_decode_attention", False)).glob("*.so"))
    except Exception:  # noqa: BLE001
        return False
