"""CUDA graphs of a model's decode-sized forwards (gpt-fast's static-cache idea, by explicit capture).

A decode step of a 7B model launches a few hundred small kernels; from Python each costs more host
time than the GPU needs for it, so an eager step is bound by launches, not by HBM. A graph replays
the whole forward as one launch. It needs fixed shapes and addresses: Transformer.forward_static
writes the new tokens' K/V at slots given as a device tensor and masks by slot (caches/static.py),
so one graph per cache serves every position.

Every graph forward carries GRAPH_ROWS token rows, the real ones first and padding after (token 0
at the following positions and slots, whose K/V land past the sequence, invisible to the real rows
and overwritten by later tokens). So an `ar` step and a verification of gamma drafts run the same
kernels on the same shapes, and each row's arithmetic is independent of the others (cuBLAS's choice
of kernel follows the row count; the attention kernel is row-independent by construction): the
verifier scores a token exactly as `ar` does, bit for bit, which is what makes greedy speculation
token-identical on a GPU too. The padding is free where decoding is bound by memory (16 rows of a
weight matrix cost what 1 does).

Used by ModelState.score for chains through caches with fixed slots (SlotLayout.fixed: the full level, ar, retrieval
and streaming levels) when the model is on CUDA; trees, int8 and offloaded caches, and forwards of more than
GRAPH_ROWS tokens (prefill) run eagerly.
"""
from __future__ import annotations

import weakref

import torch

from ..caches.static import GRAPH_ROWS, StaticView


class _Graph:
    """The captured GRAPH_ROWS-row forward through one cache's buffers."""

    def __init__(self, model, cache, layout):
        device, P = layout.k.device, GRAPH_ROWS
        self.inputs = torch.zeros(3, P, dtype=torch.long, device=device)  # tokens, positions, slots
        self.host = torch.zeros(3, P, dtype=torch.long).pin_memory()
        self.copied = torch.cuda.Event()  # the last copy out of `host` is done (it may be refilled)
        self.copied.record()
        self.tokens = self.inputs[0].view(1, P)
        self.positions = self.inputs[1]
        self.view = StaticView(layout.k, layout.v, self.inputs[2], model.cfg.n_heads,
                               record_queries=cache.recorder is not None, window=layout.window, sink=layout.sink)
        self.model = model
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def run(self, rows: list[list[int]]) -> torch.Tensor:
        """rows: token ids, positions, slots (GRAPH_ROWS each) -> the graph's logits buffer [1, P, V]."""
        self.copied.synchronize()
        self.host.copy_(torch.tensor(rows, dtype=torch.long))
        self.inputs.copy_(self.host, non_blocking=True)
        self.copied.record()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        # The warm-up and the capture both write this forward's K/V at its own slots (the replay writes
        # the same values again): nothing else in the cache is touched.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.forward_static(self.tokens, self.positions, self.view)
        torch.cuda.current_stream().wait_stream(side)
        # Its own private memory pool: a pool shared by graphs that die with their caches at different times
        # failed PyTorch's allocator assertion on the next capture (seen with torch 2.11).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.model.forward_static(self.tokens, self.positions, self.view)
        self.graph = graph


class GraphedForwards:
    """The CUDA graphs of one model, one per cache, captured on first use and dropped with their cache.
    `usable(cache, block, n)` says whether a forward can take one; `forward` runs it."""

    def __init__(self, model):
        self.model = model
        self._graphs: dict[int, _Graph] = {}
        self.replays = 0

    def usable(self, cache, block, n_tokens: int) -> bool:
        m, layout = self.model, cache.slot_layout
        return (block is None and 1 <= n_tokens <= GRAPH_ROWS and layout is not None and layout.fixed
                and layout.k.device == m.device and m.windows is None and m.rotary.rope.type != "dynamic"
                and not m.quantized and layout.first + GRAPH_ROWS <= layout.k.shape[3])

    def forward(self, tokens: list[int], cache, last: int) -> torch.Tensor:
        """tokens (a chain at cache.length onwards) -> fp32 logits [last, V] of the last `last` tokens;
        commits them to the cache like Transformer.forward."""
        n, P = len(tokens), GRAPH_ROWS
        cache.prepare(n)  # its own checks (capacity); the visibility it prepares is not used
        layout = cache.slot_layout
        graph = self._graphs.get(id(cache))
        if graph is None:
            graph = self._graphs[id(cache)] = _Graph(self.model, cache, layout)
            weakref.finalize(cache, self._graphs.pop, id(cache), None)
        first, slot = cache.length, layout.first
        rows = [list(tokens) + [0] * (P - n), list(range(first, first + P)), list(range(slot, slot + P))]
        logits = graph.run(rows)[0, n - last:n].clone()
        self.replays += 1
        if graph.view.queries is not None:  # what a retrieval build reads (FullCache.update's record)
            cache.recorder.record_all([q[:, :, :n] for q in graph.view.queries], first)
        cache.commit(n)
        return logits
