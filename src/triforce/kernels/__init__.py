"""Optional compiled CPU kernels: one C++ source (attention.cpp, layer_ops.cpp, linear_panels.cpp,
quant_linear.cpp over simd.h's vector type) compiled once per instruction set, `triforce_cpu_avx2` (8 fp32 lanes, 16
registers) and `triforce_cpu_avx512` (16 lanes, 32 registers). The variant is chosen from the CPU's
flags when first needed, built on first use with the system compiler and cached under the project's
cache directory (build.py: a killed or concurrent build never wedges a later run).

`TRIFORCE_ISA=auto|avx512|avx2|off` overrides the choice (`TRIFORCE_KERNELS=0` is `off`); asking for
an instruction set the CPU lacks is refused with a message naming what it has, never an
illegal-instruction crash. Every caller falls back to plain PyTorch when no variant is available
(no compiler, a CPU without AVX2 + FMA, or `off`); `override` switches them for measurements and tests.
"""
from __future__ import annotations

import contextlib
import os
import platform
import sys
from pathlib import Path

import torch

from ..errors import TriforceError
from . import build as builder  # (named so: several functions here take a `build` flag)

_HERE = Path(__file__).parent
_SOURCES = ("attention.cpp", "layer_ops.cpp", "linear_panels.cpp", "quant_linear.cpp", "quant_packed.cpp",
            "decode_layer.cpp", "retrieval.cpp", "bindings.cpp")
_HEADERS = ("ops.h", "simd.h")
ISAS = ("avx512", "avx2")  # best first
# what each variant needs from the CPU (/proc/cpuinfo names) and how it is compiled: -march=x86-64-v3
# is AVX2 + FMA + F16C + BMI1/2 (Haswell, Zen 1 on), x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL (Skylake-X,
# Zen 4 on); at::vec reads CPU_CAPABILITY to pick its 256- or 512-bit Vectorized<float>.
_NEEDS = {"avx2": ("avx2", "fma", "f16c", "bmi1", "bmi2"),
          "avx512": ("avx2", "fma", "f16c", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")}
_CFLAGS = {"avx2": ["-march=x86-64-v3", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
           "avx512": ["-march=x86-64-v4", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]}
_COMMON_CFLAGS = ["-O3", "-mtune=native", "-fopenmp"]
# used where the CPU has them: VNNI's 4-byte dot product, vpdpbusd (else emulated, quant_packed.cpp); AMX's
# bf16 tiles for a bf16 cache's multi-token attention (attention.cpp), else AVX512-BF16's dot products (vdpbf16ps),
# else FMAs
_AMX_CFLAGS = ["-mamx-tile", "-mamx-bf16"]
_BF16_CFLAG = "-mavx512bf16"
_OPTIONAL = {"avx512": (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", _BF16_CFLAG), ("amx_tile", _AMX_CFLAGS[0]),
                        ("amx_bf16", _AMX_CFLAGS[1]))}
_state: dict[str, object] = {}


class KernelChoiceError(TriforceError):
    """TRIFORCE_ISA names an instruction set this CPU lacks, or no instruction set at all."""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); elsewhere, what PyTorch detects."""
    line = builder.proc_cpu_flags()
    if line is not None:
        return frozenset(line.split())
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        return frozenset()
    if cap in ("AVX512", "AMX"):
        return frozenset(_NEEDS["avx512"])
    return frozenset(_NEEDS["avx2"]) if cap == "AVX2" else frozenset()


def runnable_isas(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The kernel variants this CPU can execute, best first (an x86-64 CPU only)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    flags = cpu_flags() if flags is None else flags
    return tuple(isa for isa in ISAS if all(f in flags for f in _NEEDS[isa]))


def chosen_isa(flags: frozenset[str] | None = None) -> str | None:
    """The variant to use: TRIFORCE_ISA (auto, avx512, avx2, off), else the best the CPU runs; None
    for PyTorch only. Raises KernelChoiceError for an unknown value or one the CPU cannot run."""
    if os.environ.get("TRIFORCE_KERNELS", "1") == "0":
        return None
    want = os.environ.get("TRIFORCE_ISA", "auto").strip().lower() or "auto"
    flags = cpu_flags() if flags is None else flags
    runnable = runnable_isas(flags)
    if want == "off":
        return None
    if want == "auto":
        return runnable[0] if runnable else None
    if want not in ISAS:
        raise KernelChoiceError(f"TRIFORCE_ISA={want!r} is not one of auto, avx512, avx2, off")
    if want not in runnable:
        have = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "bmi")))
        missing = [f for f in _NEEDS[want] if f not in flags]
        raise KernelChoiceError(
            f"TRIFORCE_ISA={want} but this CPU lacks {', '.join(missing) or 'x86-64'} (it has: "
            f"{', '.join(have) or 'none of AVX/FMA'}); use "
            + (f"TRIFORCE_ISA={runnable[0]} or " if runnable else "") + "TRIFORCE_ISA=auto")
    return want


def _optional_cflags(isa: str) -> list[str]:
    """The optional instructions' flags for `isa` that both this CPU has and the compiler knows (an older compiler
    without one builds the variant without it rather than failing the whole build)."""
    flags = cpu_flags()
    return builder.accepted_flags([flag for need, flag in _OPTIONAL.get(isa, ()) if need in flags])


def variant(isa: str, optional: bool = True):
    """The compiled module for `isa` (built on first use), or None if it cannot be built here. The
    caller must know that the CPU runs `isa` (runnable_isas). optional=False: without the optional
    instructions (VNNI, AMX) even where the CPU has them, as on a CPU without them (tests)."""
    key = f"variant-{isa}" + ("" if optional else "-plain")
    if key in _state:
        return _state[key]
    try:
        # (TRIFORCE_KERNEL_NAME_SUFFIX: a lab build under a name of its own, so that benchmarks/inprocess_ab.py can
        # load it beside another build in one process)
        name = f"triforce_cpu_{isa}" + ("" if optional else "_plain") + os.environ.get("TRIFORCE_KERNEL_NAME_SUFFIX", "")
        module = builder.build_and_load(name, [_HERE / s for s in _SOURCES],
                                [_HERE / h for h in _HEADERS],
                                cflags=_COMMON_CFLAGS + _CFLAGS[isa] + (_optional_cflags(isa) if optional else []),
                                ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - a failed build or wait means: use PyTorch's kernels
        print(f"triforce: CPU kernels ({isa}) unavailable ({type(e).__name__}: {str(e)[:300]}); using PyTorch",
              file=sys.stderr)
        module = None
    _state[key] = module
    return module


def cpu():
    """The compiled module of the chosen variant (decode_attention, rms_norm, rope_split, silu_mul,
    linear_panels, linear_quant, dequantize_rows; attributes ISA, LANES, HALF_KV), or None for PyTorch's operations."""
    if "cpu" in _state:
        return _state["cpu"]
    isa = chosen_isa()
    module = variant(isa) if isa is not None else None
    _state["cpu"] = module
    return module


def amx_attention(build: bool = True) -> bool:
    """Whether the chosen CPU kernels run a bf16 cache's multi-token attention (verifications, trees, prefill) on
    AMX tiles in this process (kernels/attention.cpp): where they do, bf16 is the default KV dtype. build=False
    does not build the kernels to ask them: until they are built, the answer is read from the CPU's flags and
    TRIFORCE_AMX (the kernels also need Linux to grant the tile state, which only they can ask)."""
    if "cpu" not in _state and not build:  # what the build would compile in (_OPTIONAL), and TRIFORCE_AMX
        isa = chosen_isa()
        return (isa is not None and set(_AMX_CFLAGS) <= set(_optional_cflags(isa))
                and os.environ.get("TRIFORCE_AMX", "1") != "0")
    ops = cpu()
    return ops is not None and bool(getattr(ops, "amx_attention", lambda: False)())


def bf16_dot_attention(build: bool = True) -> bool:
    """Whether the chosen CPU kernels run a bf16 cache's multi-token attention on dot products in this process:
    AMX's tiles (amx_attention), or AVX512-BF16's vdpbf16ps (AMD Zen 4 on, Intel Cooper Lake on: twice an FMA's
    multiply-adds per instruction). Where they do, bf16 is the default KV dtype (docs/kv_dtype.md). build=False:
    read from the CPU's flags until the kernels are built, as amx_attention does."""
    if "cpu" not in _state and not build:
        isa = chosen_isa()
        return amx_attention(build=False) or (isa is not None and _BF16_CFLAG in _optional_cflags(isa))
    ops = cpu()
    return ops is not None and bool(getattr(ops, "bf16_dot_attention", lambda: False)())


def bf16_cache_faster(build: bool = True) -> bool:
    """Whether a bf16 KV cache is faster here than an fp16 one, which makes bf16 the default (docs/kv_dtype.md): its
    multi-token attention (verifications, trees, prefill) on AMX's tiles (amx_attention), or on AVX512-BF16's dot
    products (bf16_dot_attention) where the cores run vdpbf16ps at an FMA's rate with twice its multiply-adds, as AMD's
    Zen 4 and Zen 5 do. Intel's cores run it at half that rate: on an Intel Xeon without AMX (a VM that hides it) an
    fp16 cache was as fast or faster in every measured case, its 8K prefill 27% faster. build=False: from the CPU's
    flags until the kernels are built, as amx_attention."""
    if amx_attention(build):
        return True
    return bf16_dot_attention(build) and builder.cpu_vendor() == "AuthenticAMD"


class Backend:
    """Which operations a model's layers run, chosen once when the model is built
    (execution.Execution.for_model): the compiled CPU kernels for an fp32 model on the CPU where they
    build; on CUDA with Triton, its fused layer operations (kernels/cuda_ops.py: rms_norm, rope_split,
    silu_mul); else PyTorch's. Every layer of the model holds the same Backend and reads `ops` (the
    module, or None for PyTorch); `enabled` says the CPU kernels are on; `override` swaps what an
    enabled Backend returns (tests, A/B runs)."""

    def __init__(self, enabled: bool, module=None):
        self.enabled = enabled
        self._module = module

    @property
    def ops(self):
        if self._module is not None:
            return self._module
        return cpu() if self.enabled else None

    @classmethod
    def for_model(cls, device: torch.device | str, dtype: torch.dtype) -> Backend:
        device = torch.device(device)
        if device.type == "cuda":
            from . import cuda_ops  # optional: triton (the CUDA kernels), only on a GPU

            return cls(False, cuda_ops) if cuda_ops.available() else TORCH
        return cls(device.type == "cpu" and dtype == torch.float32 and cpu() is not None)


TORCH = Backend(False)  # PyTorch's operations only: layers not (yet) part of a built model


@contextlib.contextmanager
def override(module):
    """Use `module` (None: PyTorch only, a variant, or a wrapper of one) inside the block."""
    had, old = "cpu" in _state, _state.get("cpu")
    _state["cpu"] = module
    try:
        yield
    finally:
        if had:
            _state["cpu"] = old
        else:
            _state.pop("cpu", None)
