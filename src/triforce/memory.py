"""What a model and its KV cache take in memory, and refusing a run that will not fit.

A run that outgrows RAM is killed by the OOM killer with no message, often after minutes of loading
or prefill; these checks refuse it up front with the numbers instead. Sizes are what we allocate:
weights as held (--weights), K and V for every token of the context in the KV dtype.
"""
from __future__ import annotations

import torch

from .config import kv_dtype_name
from .errors import TriforceError
from .ggml_blocks import QuantTensor

# A run needs some room beyond weights and KV (activations, the tokenizer, Python): refused if the
# estimate exceeds what is available minus this.
HEADROOM = 256 << 20
# What a whole run holds beside its weights and KV cache: Python, PyTorch (about 220 MiB once imported), the
# tokenizer, the compiled kernels and the activations. Measured with the embedded model (peak RSS, AMD Zen 5):
# 495 MiB for a 100-token run (92 MiB of it weights), and 32K runs 400-480 MiB above weights + KV
# (bf16 1,250 MiB, int8 957 MiB, fp32 1,923 MiB). `triforce info` adds it to what a context needs.
RUNTIME = 448 << 20


def gib(n: float) -> str:
    """Bytes as GiB, MiB or KiB, whichever reads best."""
    if n >= 2 ** 30:
        return f"{n / 2 ** 30:.2f} GiB"
    if n >= 10 * 2 ** 20:
        return f"{n / 2 ** 20:.0f} MiB"
    return f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none: then nothing is refused)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(need: int, what: str, hint: str) -> None:
    """Raise TriforceError if `need` bytes (`what`) exceed the available memory less HEADROOM."""
    avail = available_bytes()
    if avail is not None and need > avail - HEADROOM:
        raise TriforceError(f"{what} would take {gib(need)}, but only {gib(avail)} of memory is available "
                            f"(MemAvailable, less {gib(HEADROOM)} for the rest of the run): {hint}")


def held_bytes(values: int, stored: int, matrix: bool, weights: str) -> int:
    """Bytes one weight tensor of `values` values, `stored` bytes as read, takes when held as `weights`
    (native: as stored; bf16 / fp32: 2 / 4 bytes per value of a matrix; vectors (norms, biases) fp32)."""
    if weights == "native":
        return stored
    return values * (2 if weights == "bf16" and matrix else 4)


def weight_bytes(state: dict, weights: str) -> int:
    """Bytes the tensors of `state` (torch tensors or ggml_blocks.QuantTensor, as read_gguf gives them)
    take when held as `weights` (held_bytes)."""
    total = 0
    for t in state.values():
        if isinstance(t, QuantTensor):
            total += held_bytes(t.shape[0] * t.shape[1], t.nbytes, True, weights)
        else:
            total += held_bytes(t.numel(), t.numel() * t.element_size(), t.dim() > 1, weights)
    return total


# Bytes per K/V value held, by KV dtype. int8 (caches/quantized.py): an 8-bit code plus an fp16 scale and zero
# per group, keys per channel over 64 tokens (4 / 64 bytes a value) and values per token over 32 channels
# (4 / 32): 1.094 bytes on average; int4 (a kv4 level's own cache over a float target) the upper plane alone,
# 0.594. Their full-precision buffer of the newest tokens (2 groups + rollback + a forward) is not counted.
_GROUP_OVERHEAD = (4 / 64 + 4 / 32) / 2
KV_VALUE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1 + _GROUP_OVERHEAD, "int4": 0.5 + _GROUP_OVERHEAD}


def kv_value_bytes(kv_dtype) -> float:
    """Bytes per stored K/V value of a KV dtype (a name of KV_VALUE_BYTES or a torch dtype: torch.int8 is int8)."""
    return KV_VALUE_BYTES[kv_dtype_name(kv_dtype, choices=tuple(KV_VALUE_BYTES))]


def kv_bytes(cfg, tokens: int, value_bytes: float) -> int:
    """K and V of `tokens` tokens over every layer, `value_bytes` bytes per value (kv_value_bytes; an upper bound
    for sliding-window layers, whose caches hold only their window). (cfg.kv_bytes_per_token counts fp32.)"""
    return round(cfg.kv_bytes_per_token // 4 * value_bytes * tokens)


def check_kv_fits(model, tokens: int) -> None:
    """Refuse a context of `tokens` tokens whose KV cache (the model's kv_dtype) will not fit: in the GPU's free
    memory for a model on CUDA (unless its cache is offloaded to host memory: --offload-kv), else in RAM."""
    name = kv_dtype_name(model.kv_dtype)
    need = kv_bytes(model.cfg, tokens, kv_value_bytes(model.kv_dtype))
    if model.device.type == "cuda" and not getattr(model, "offload_kv", False):
        free = torch.cuda.mem_get_info(model.device)[0]
        if need > free - HEADROOM:
            raise TriforceError(f"the KV cache of {tokens} tokens ({name}) would take {gib(need)}, but only "
                                f"{gib(free)} of GPU memory is free beside the weights: shorten the prompt or "
                                f"--max-new-tokens, or keep the cache in host memory with --offload-kv")
        return
    check_fits(need, f"the KV cache of {tokens} tokens ({name})",
               "shorten the prompt or --max-new-tokens" + (", or use --kv-dtype fp16 (half the bytes)"
                                                           if name == "fp32" else
                                                           ", or use --kv-dtype int8 (0.55x fp16's bytes)"
                                                           if name in ("fp16", "bf16") else ""))
