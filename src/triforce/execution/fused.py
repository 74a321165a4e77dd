"""Every layer of a decode-sized forward in one C++ call (kernels/decode_layer.cpp: Block.forward's kernel path, bit
for bit), for a CPU model whose layers all have the fused form. A decode step of a small model costs more in
Python's per-layer calls than in arithmetic; one call through the layers removes them."""
from __future__ import annotations

import weakref

import torch

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

    def layout(self, ops, cfg, layers, T: int, dtype: torch.dtype, cache, prepared: bool = True):
        """The slot layout a T-token chain through `cache` runs the one call over (decode_layers_batch), or None
        where it does not (no kernels, too many rows, a quantized cache (decode_layers_quant's), a tree, a cache
        without slots, a layer without the fused form). `prepared`: False when asked before the forward prepares
        the cache (a serving batch's gate asks first): then only a cache with fixed slots (the full and retrieval
        caches), whose layout does not depend on what is prepared (a StreamingLLM window's is known only after)."""
        g = cfg.n_heads // cfg.n_kv_heads
        if ops is None or T > PANEL_MAX_ROWS or dtype != torch.float32 or g * T > KERNEL_MAX_ROWS:
            return None
        caps = capabilities(ops)
        if cache.quantized_planes or not caps.decode_layers or not (prepared or caps.decode_layers_batch):
            return None
        layout = cache.slot_layout  # a chain in slots: causal, or a StreamingLLM window less each token's gap
        if (layout is None or not layout.chain or not (prepared or layout.fixed) or layout.k.shape[1] != 1
                or layout.k.device.type != "cpu"):
            return None
        return layout if self.stack(layers, ops) is not None else None

    def run_batch(self, ops, cfg, layers, items: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], object]]
                  ) -> list[torch.Tensor]:
        """Several sequences' forwards in one call: items (x [1, T_i, hidden], (cos, sin) [T_i, D], a prepared cache
        whose `layout` is not None) -> each x after every layer [1, T_i, hidden]. The linear layers run over all
        rows at once (the weights read once); RoPE, the cache writes and attention per sequence, over its own cache.
        Each sequence's rows are bit for bit what its forward alone computes (kernels/decode_layer.cpp)."""
        layouts = [cache.slot_layout for _, _, cache in items]
        rows = [x.shape[1] for x, _, _ in items]
        one = len(items) == 1
        x = items[0][0] if one else torch.cat([x for x, _, _ in items], dim=1)
        cos = items[0][1][0] if one else torch.cat([r[0] for _, r, _ in items])
        sin = items[0][1][1] if one else torch.cat([r[1] for _, r, _ in items])
        record = any(cache.recorder is not None for _, _, cache in items)
        gaps = [torch.empty(0, dtype=torch.long) if lay.gap is None else lay.gap for lay in layouts]
        out = ops.decode_layers_batch(x, self.stack(layers, ops), cos, sin, cfg.n_heads, cfg.n_kv_heads,
                                      [lay.k for lay in layouts], [lay.v for lay in layouts],
                                      [lay.first for lay in layouts], rows, record,
                                      gaps if any(lay.gap is not None for lay in layouts) else [])
        if record:  # as FullCache.update records them: per layer, each sequence's queries (layer-major)
            n = len(items)
            for s, (_, _, cache) in enumerate(items):
                if cache.recorder is not None:
                    cache.recorder.record_all(out[1 + s::n])
        return [out[0]] if one else list(out[0].split(rows, dim=1))

    def run(self, ops, cfg, layers, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache
            ) -> torch.Tensor | None:
        """x [B, T, hidden] through every layer for a decode-sized forward through a slot-causal cache, a quantized
        one or a StreamingLLM one (its window's gap) on CPU, where each layer has the fused form and the attention
        kernel runs -> [B, T, hidden]; None otherwise (the layers then run one by one)."""
        B, T, _ = x.shape
        if B != 1:
            return None
        if not cache.quantized_planes:  # (decode_layers: decode_layers_batch's one-sequence case)
            layout = self.layout(ops, cfg, layers, T, x.dtype, cache)
            if layout is None:
                return None
            record = cache.recorder is not None
            window = {} if layout.gap is None else {"gap": layout.gap}  # (a causal chain's call as without one)
            out = ops.decode_layers(x, self.stack(layers, ops), *rope, cfg.n_heads, cfg.n_kv_heads, layout.k, layout.v,
                                    layout.first, record, **window)
            if record:  # as FullCache.update records them
                cache.recorder.record_all(out[1:])
            return out[0]
        g = cfg.n_heads // cfg.n_kv_heads
        if ops is None or T > PANEL_MAX_ROWS or x.dtype != torch.float32 or g * T > KERNEL_MAX_ROWS:
            return None
        # a quantized cache: its attention kernel takes any length (the buffer's keys by the per-row path)
        if cache.batch != 1 or not capabilities(ops).decode_layers_quant or x.device.type != "cpu":
            return None
        stack = self.stack(layers, ops)
        if stack is None:
            return None
        record = cache.recorder is not None
        out = ops.decode_layers_quant(x, stack, *rope, cfg.n_heads, cfg.n_kv_heads, *cache.fused_inputs(g), record)
        if record:  # as FullCache.update records them
            cache.recorder.record_all(out[1:])
        return out[0]
