"""How a model's forwards are executed, single or batched (vLLM v1's model runner): the one object a model state
(speculation/state.py) hands its `forward(model, tokens, cache, ...)` calls to, apart from what the forward
computes (model.py).

`ModelRunner` runs each forward at once, on the calling thread: a generation alone. It also runs several
sequences' decode-sized chains as one forward (`forward_batch`), each over its own cache, bit for bit each one's
forward alone; a serving batch's runner (execution/batching.py, GatedRunner) sends its forwards there through the
server's gate. What a model state asks of a runner beyond the forward (`catch_up_tokens`, `own_clock`,
`forward_seconds`, `exclusive`, `prefilling`) is what a batch changes about a request's forwards; alone, each is
the plain answer (no catch-up, the wall clock, the forward's time, run it now, nothing)."""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager

import torch

from ..memory import kv_bytes
from .attention import KERNEL_MAX_ROWS
from .linear import PANEL_MAX_ROWS, Linear, QuantLinear

# A batched forward's rows after the first cost this fraction each of reading its K/V once (their attention
# arithmetic), in the gate's split of a batch's time (batch_cost). Measured with benchmarks/batched_forward.py at 8K
# (Intel Xeon, 2 cores): 8 requests x 1, 2, 3, 5 rows 85.0, 112.5, 144.3, 199.8 ms, so 3.4-3.7 ms per extra row per
# request; 2 requests x 1 row 25.2 ms, so in a batch a request's K/V costs 10.0 ms and the weights 5.3 (the bytes'
# split: 92 MiB against 180).
BATCH_ROW_COST = 0.36

_WEIGHT_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> weight_bytes(model), once measured


def weight_bytes(model) -> int:
    """The weight bytes a decode-sized forward of `model` reads: every linear layer's, as its forward reads them."""
    if model not in _WEIGHT_BYTES:
        _WEIGHT_BYTES[model] = sum(m.nbytes for m in model.modules() if isinstance(m, (Linear, QuantLinear)))
    return _WEIGHT_BYTES[model]


def batch_layout(model, T: int, cache):
    """Where a T-token chain through `cache` sits for forward_batch, or None where forward_batch does not take it
    (FusedDecode.layout: the one call through every layer over a cache with fixed slots, on the CPU; asked before
    the cache is prepared)."""
    if cache.windows != model.windows or model.windows is not None:
        return None
    return model.execution.fused.layout(model.backend.ops, model.cfg, model.layers, T, model.dtype, cache,
                                        prepared=False)


def batch_cost(model, T: int, layout) -> tuple[int, float]:
    """A batched forward's cost for the gate's split of its batch's time (ForwardGate.batched): the weight bytes
    every forward of the batch shares, and its own, the K/V bytes it reads, 1 + BATCH_ROW_COST per row after the
    first (its rows' attention arithmetic)."""
    kv = kv_bytes(model.cfg, layout.first + T, layout.k.element_size())
    return weight_bytes(model), kv * (1 + BATCH_ROW_COST * (T - 1))


def batch_tokens(model, cache) -> int:
    """The most tokens of a chain through `cache` that a batched forward takes with other sequences'
    (forward_batch); 0 where it takes none. A longer forward runs alone."""
    g = model.cfg.n_heads // model.cfg.n_kv_heads
    most = min(PANEL_MAX_ROWS, KERNEL_MAX_ROWS // g)
    return most if most and batch_layout(model, most, cache) is not None else 0


def forward_batch(model, calls: list[tuple[torch.Tensor, object, int]], argmax: bool = False) -> list:
    """Several sequences' decode-sized chains in one forward of `model`, each over its own cache: calls (tokens
    [1, T], its cache, last) -> each one's fp32 logits [1, last, V], bit for bit what model(tokens, cache,
    last=last) gives it alone: the layers run as one call over every row (FusedDecode.run_batch) and the final norm
    and LM head over the kept rows, PANEL_MAX_ROWS at a time (a row's logits never depend on the rows beside it,
    and a forward alone runs these rows on the same kernels). A call the one call does not take (batch_layout)
    runs alone. `argmax`: each one's (logits, ids [1, last]) instead, every kept row's argmax in one call."""
    if any(batch_layout(model, t.shape[1], c) is None for t, c, _ in calls):
        alone = [model(t, c, last=n) for t, c, n in calls]
        return [(l, l.argmax(-1)) for l in alone] if argmax else alone
    items = []
    for tokens, cache, _ in calls:
        T = tokens.shape[1]
        cache.prepare(T, None)
        rope = model.rotary.cos_sin(cache.length + torch.arange(T, device=tokens.device), model.dtype)
        items.append((model._embed(tokens), rope, cache))
    xs = model.execution.fused.run_batch(model.backend.ops, model.cfg, model.layers, items)
    for (tokens, cache, _) in calls:
        cache.commit(tokens.shape[1])
    kept = torch.cat([x[:, -n:] for x, (_, _, n) in zip(xs, calls)], dim=1)
    logits = torch.cat([model._logits(kept[:, r:r + PANEL_MAX_ROWS])
                        for r in range(0, kept.shape[1], PANEL_MAX_ROWS)], dim=1)
    sizes = [n for _, _, n in calls]
    if argmax:
        return list(zip(logits.split(sizes, dim=1), logits.argmax(-1).split(sizes, dim=1)))
    return list(logits.split(sizes, dim=1))


class ModelRunner:
    """Runs a generation's forwards at once, on the calling thread (a generation alone). A serving batch's
    runner (execution/batching.py, GatedRunner) answers each question for a request among others."""

    def forward(self, model, tokens: torch.Tensor, cache, last: int | None = None, block=None, hidden: bool = False,
                layers: tuple[int, ...] | None = None):
        """model(tokens, cache, ...) (Transformer.forward), run as this runner runs forwards."""
        return model(tokens, cache, last=last, block=block, hidden=hidden, layers=layers)

    def forward_argmax(self, model, tokens: torch.Tensor, cache, last: int | None = None, block=None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(...) and each kept row's argmax (a greedy forward's next tokens) -> (logits [1, last, V], ids
        [1, last]). Alone, the argmax after the forward; a serving batch's runner takes every request's in one call
        where the batch ran (GatedRunner)."""
        logits = self.forward(model, tokens, cache, last=last, block=block)
        return logits, logits.argmax(-1)

    def catch_up_tokens(self, model, cache) -> int:
        """The most tokens a forward of a chain through `cache` may take so that it runs batched with other
        requests' (ModelState._catch_up feeds a longer backlog in forwards of this size); 0: no forward is batched
        with others, so a backlog is fed whole."""
        return 0

    @contextmanager
    def prefilling(self, tokens_left: int):
        """The forwards in the block are a prefill chunk of a prompt with `tokens_left` tokens left to prefill (a
        batch's order among its solo forwards); alone, nothing."""
        yield

    def forward_seconds(self, started: float) -> float:
        """The time of this thread's last forward, begun at `started` (perf_counter): alone, the time since."""
        return time.perf_counter() - started

    def own_clock(self) -> float:
        """A clock of this generation's own time, in seconds (the adaptive planner's round costs, a rebuild's cost):
        alone, the wall clock."""
        return time.perf_counter()

    def exclusive(self, fn):
        """fn() -> its result, run with the cores to itself (a retrieval level's build): alone, now."""
        return fn()


DIRECT = ModelRunner()  # a generation alone: every forward at once, on its own thread
