"""Every layer of a decode-sized forward in one C++ call (kernels/decode_layer.cpp: Block.forward's kernel path, bit
for bit), for a CPU model whose layers all have the fused form. A decode step of a small model costs more in
Python's per-layer calls than in arithmetic; one call through the layers removes them."""
from __future__ import annotations

import weakref

import torch

from ..caches.quantized import QuantizedCache
from ..kernels.capabilities import capabilities
from .attention import KERNEL_HEAD_DIMS, KERNEL_MAX_ROWS
from .linear import PANEL_MAX_ROWS, Linear, QuantLinear


def kernel_weights(lin) -> tuple[list, list, list] | None:
    """A linear layer's weights as kernels/decode_layer.cpp takes them: the packed parts of a QuantLinear
    whose parts are all packed (linear_packed), or a Linear's panels ({panels}, {-1}, {out_features});
    None for anything else (those layers run the Python path)."""
    if isinstance(lin, QuantLinear) and lin.kernel_ready and all(lin.packed):
        return [lin._buffers[name] for name in lin._names], list(lin.types), list(lin.rows)
    if isinstance(lin, Linear) and lin.panels is not None:
        return [lin.panels], [-1], [lin.out_features]
    return None


def layer_args(block, ops) -> tuple | None:
    """ops.LayerStack's arguments for one Block (norm weights and eps, each linear as the kernels take it), or None
    where the layer has something the fused call does not do (QK-norm, sandwich norms, GeGLU, a sliding window, a
    head dim without the attention kernel, a projection without the panel or integer kernel, biases but the qkv
    one)."""
    if not (capabilities(ops).decode_layers and block.q_norm is None and block.post_attn_norm is None
            and block.post_mlp_norm is None and block.activation == "silu" and not block.sliding
            and block.head_dim in KERNEL_HEAD_DIMS
            and all(m.bias is None for m in (block.wo, block.w_gate_up, block.w_down))):
        return None
    specs = [kernel_weights(m) for m in (block.wqkv, block.wo, block.w_gate_up, block.w_down)]
    if any(spec is None for spec in specs):
        return None
    (qp, qt, qr), (op, ot, orow), (gp, gt, gr), (dp, dt, dr) = specs
    return (block.attn_norm.weight, block.mlp_norm.weight, block.attn_norm.eps, qp, qt, qr, block.wqkv.bias,
            op, ot, orow, gp, gt, gr, dp, dt, dr)


class FusedDecode:
    """The one-call decode of a model's layers. Its ops.LayerStack (every layer's layer_args and attention scale) is
    built once per (kernels module, layers): a draft copy of the model (loading.transforms.draft_weights) has its
    own layers and so its own stack; re-packing the weights drops them (`clear`). Kept per layers object, not in
    the model, so that a deepcopy of a model carries no compiled object (it builds its own)."""

    def __init__(self):
        self._stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layers -> (ops, LayerStack | None)

    def __deepcopy__(self, memo) -> FusedDecode:
        return FusedDecode()

    def clear(self) -> None:
        self._stacks.clear()

    def stack(self, layers, ops):
        """ops.LayerStack of `layers` (an nn.ModuleList of Blocks), or None where a layer has no fused form."""
        cached = self._stacks.get(layers)
        if cached is not None and cached[0] is ops:
            return cached[1]
        args = [layer_args(block, ops) for block in layers]
        stack = None
        if all(a is not None for a in args):
            stack = ops.LayerStack([(*a, b.head_dim ** -0.5 if b.scale is None else b.scale)
                                    for a, b in zip(args, layers)])
        self._stacks[layers] = (ops, stack)
        return stack

    def run(self, ops, cfg, layers, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache
            ) -> torch.Tensor | None:
        """x [B, T, hidden] through every layer for a decode-sized forward through a slot-causal cache, a quantized
        one or a StreamingLLM one (its window's gap) on CPU, where each layer has the fused form and the attention
        kernel runs -> [B, T, hidden]; None otherwise (the layers then run one by one)."""
        B, T, _ = x.shape
        g = cfg.n_heads // cfg.n_kv_heads
        if ops is None or T > PANEL_MAX_ROWS or B != 1 or x.dtype != torch.float32 or g * T > KERNEL_MAX_ROWS:
            return None
        quantized = isinstance(cache, QuantizedCache) and cache.batch == 1
        layout = None
        if quantized:  # its attention kernel takes any length (the buffer's keys by the per-row path)
            if not capabilities(ops).decode_layers_quant or x.device.type != "cpu":
                return None
        else:  # a chain in slots: causal, or a StreamingLLM window less each token's gap (KVCache.slot_layout)
            layout = cache.slot_layout
            if layout is None or not layout.chain:
                return None
        stack = self.stack(layers, ops)
        if stack is None:
            return None
        record = cache.recorder is not None
        if quantized:
            out = ops.decode_layers_quant(x, stack, *rope, cfg.n_heads, cfg.n_kv_heads, *cache.fused_inputs(g), record)
        else:
            window = {} if layout.gap is None else {"gap": layout.gap}  # (a causal chain's call as without one)
            out = ops.decode_layers(x, stack, *rope, cfg.n_heads, cfg.n_kv_heads, layout.k, layout.v, layout.first,
                                    record, **window)
        if record:  # as FullCache.update records them
            cache.recorder.record_all(out[1:])
        return out[0]
