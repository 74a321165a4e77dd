"""What a compiled kernels module offers, asked in one place.

The CPU kernels grow by variant and version (an older build, a test's wrapper, `kernels.override(None)` for
PyTorch only), so callers never probe the module themselves: `capabilities(ops)` answers for the module in use
now, and is made once per module."""
from __future__ import annotations

from functools import cached_property

# the head dims the compiled CPU kernels' attention (dense and quantized) and chunk scores take
HEAD_DIMS = (64, 128, 256)


class Capabilities:
    """The operations of `ops` (a compiled kernels module, a wrapper of one, kernels.cuda_ops, or None for
    PyTorch's operations) that callers choose a path by."""

    def __init__(self, ops):
        self.ops = ops
        # bf16 / fp16 K/V read by the decode-attention kernel (else it takes fp32 K/V only)
        self.half_kv = bool(getattr(ops, "HALF_KV", False))
        # the integer kernel over interleaved GGML blocks (QuantLinear.pack)
        self.linear_packed = hasattr(ops, "linear_packed")
        # ... and the GGML types it has a many-row path for (a verification's rows in one call, the same bits)
        self.packed_many_rows = frozenset(getattr(ops, "PACKED_MANY_ROWS", ()))
        # ... and whether it takes a prefill's rows too (AVX-512 VNNI builds: faster than dequantized weights there)
        self.packed_prefill = bool(getattr(ops, "PACKED_PREFILL", False))
        # quantized blocks unpacked by the kernels (quantized.unpack_rows)
        self.unpack_rows = hasattr(ops, "unpack_rows")
        # every layer of a decode-sized forward in one call (execution/fused.py), over a K/V cache ...
        self.decode_layers = hasattr(ops, "decode_layers") and hasattr(ops, "LayerStack")
        # ... and over several sequences' caches at once (a serving batch; execution/batching.py)
        self.decode_layers_batch = self.decode_layers and hasattr(ops, "decode_layers_batch")
        # ... and over an int8 cache's planes
        self.decode_layers_quant = self.decode_layers and hasattr(ops, "decode_layers_quant")
        # a quantized cache's attention over its planes (caches/quantized.py)
        self.quant_attention = hasattr(ops, "quant_attention")
        # the retrieval cache's chunk scores (caches/retrieval.py)
        self.chunk_scores = hasattr(ops, "chunk_scores")

    @cached_property
    def bf16_dot_attention(self) -> bool:
        """A bf16 cache's multi-token attention on AMX tiles or AVX512-BF16 dot products (asked of the kernels
        when first needed: they ask Linux for the tile state)."""
        return self.ops is not None and bool(getattr(self.ops, "bf16_dot_attention", lambda: False)())

    @cached_property
    def attention_chain_rows(self) -> int:
        """The most query rows per KV head one call of the decode-attention kernel takes for a prefill chain over a
        bf16 cache (execution/attention.py, _kernel_chain): more than a verification's 64 where it runs on dot
        products at every row count, so that each call reads the keys once for more tokens (asked of the kernels
        when first needed, as bf16_dot_attention)."""
        return int(getattr(self.ops, "attention_chain_rows", lambda: 64)())


_MADE: dict[int, Capabilities] = {}


def capabilities(ops) -> Capabilities:
    """The Capabilities of `ops`, made once per module (the entry keeps the module alive, so its id is not reused)."""
    caps = _MADE.get(id(ops))
    if caps is None or caps.ops is not ops:
        caps = _MADE[id(ops)] = Capabilities(ops)
    return caps
