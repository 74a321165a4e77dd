"""The execution backend of one model: the operations its layers run, its fused CPU decode and its CUDA graphs,
chosen once for the model's device and dtype (Transformer.select_backend, when the model is built and when it
moves)."""
from __future__ import annotations

import copy

from .. import kernels
from .fused import FusedDecode
from .graphs import GraphedForwards
from .linear import Linear, QuantEmbedding, QuantLinear


class Execution:
    """How a model's forwards run.

    backend: kernels.Backend, the operations of norms, RoPE, attention and the MLP's gate (the CPU kernels for an
        fp32 model on a CPU where they build, Triton's fused operations on CUDA, else PyTorch's); linear layers get
        it where it is the CPU kernels (the matrix kernels are the CPU's only).
    fused: the one-call CPU decode of every layer (execution/fused.py).
    graphs: on CUDA, the CUDA graphs of the model's decode-sized forwards (graphs.py); None elsewhere, or to run every
        forward eagerly (--no-cuda-graphs)."""

    def __init__(self, backend: kernels.Backend = kernels.TORCH, graphs=None, fused: FusedDecode | None = None):
        self.backend = backend
        self.graphs = graphs
        self.fused = FusedDecode() if fused is None else fused

    @classmethod
    def for_model(cls, model) -> Execution:
        """Choose the model's execution for its device and dtype and hand each layer its operations."""
        device = model.device
        backend = kernels.Backend.for_model(device, model.dtype)
        graphs = None
        if device.type == "cuda":
            graphs = GraphedForwards(model)
        for m in model.modules():
            if isinstance(m, Linear) and device.type != "cpu":  # CPU-only copies of the weights: dropped
                m.panels = m.packed = None
            if isinstance(m, (Linear, QuantLinear, QuantEmbedding)):  # matrix kernels: the CPU's only
                m.backend = backend if backend.enabled else kernels.TORCH
            elif m is not model and hasattr(m, "backend"):  # norms and blocks
                m.backend = backend
        return cls(backend, graphs)

    def with_graphs(self, graphs) -> Execution:
        """This execution with other CUDA graphs (None: every forward eager)."""
        return Execution(self.backend, graphs, self.fused)

    @property
    def ops(self):
        """The compiled kernels module of the backend, or None for PyTorch's operations."""
        return self.backend.ops

    def decode_layers(self, model, x, rope, cache):
        """Every layer in one call where it can (FusedDecode.run), else None."""
        return self.fused.run(self.backend.ops, model.cfg, model.layers, x, rope, cache)

    def __deepcopy__(self, memo) -> Execution:
        return Execution(self.backend, copy.deepcopy(self.graphs, memo), FusedDecode())
