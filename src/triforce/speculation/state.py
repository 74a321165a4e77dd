"""A model with its KV cache, positioned over a prefix of the token sequence; prefill."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from ..caches import KVCache, new_cache
from ..caches.base import TokenBlock
from ..execution.runner import DIRECT, ModelRunner
from ..model import Transformer
from ..sampling import SamplingParams, Scores, probs_from_logits
from .tree import DraftTree


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, ids: torch.Tensor, chunk_size: int = 512,
            progress: bool = False, features: list | None = None,
            layers: tuple[int, ...] | None = None, runner: ModelRunner = DIRECT) -> torch.Tensor | None:
    """Feed ids [B, N] in chunks (bounded attention memory); -> fp32 logits of the last token [B, V]
    (None when N == 0: a one-token prompt leaves nothing to prefill before the first draft). `features`: a
    list that receives the features of the last chunk's tokens ([chunk, hidden], B = 1; Transformer.forward;
    `layers`: those layers' inputs instead, [chunk, len(layers) * hidden]). `runner`: runs the forwards
    (execution/runner.py; default: each at once)."""
    n = ids.shape[1]
    logits = None
    with tqdm(total=n, desc="prefill", unit="tok", disable=not progress or n <= chunk_size, leave=False) as bar:
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            with runner.prefilling(n - start):
                if features is not None and end == n:
                    logits, hidden = runner.forward(model, ids[:, start:end], cache, last=1, hidden=True,
                                                    layers=layers)
                    features[:] = [hidden[0]]
                else:
                    logits = runner.forward(model, ids[:, start:end], cache, last=1)
            bar.update(end - start)
    return None if logits is None else logits[:, -1]


def _tree_block(n_pending: int, tree: DraftTree, device) -> TokenBlock:
    """The token block of `n_pending` chain tokens followed by a draft tree: the chain is causal, every
    node sees the whole chain and its own ancestors; positions: the chain's, then chain end + depth."""
    m, n = n_pending, len(tree)
    offsets = torch.tensor(list(range(m)) + [m + d for d in tree.depths], dtype=torch.long)
    visible = torch.zeros(m + n, m + n, dtype=torch.bool)
    visible[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
    visible[m:, :m] = True
    visible[m:, m:] = tree.ancestry()
    return TokenBlock(offsets.to(device), visible.to(device))


@contextmanager
def extended(ctx: list[int]) -> Iterator[list[int]]:
    """`ctx` itself, for tokens appended inside the block and removed at its end (an exception included): a
    drafting level sees its own drafts as context without a copy of the whole sequence per drafted token."""
    n = len(ctx)
    try:
        yield ctx
    finally:
        del ctx[n:]


class ModelState:
    """`fed` are the tokens whose K/V the cache holds (cache.length == len(fed)).

    Sequences passed in are `ctx` (a list of token ids) with ctx[:committed] final: tokens in there
    never change, so the match between `fed` and `ctx` is re-checked only past `stable`.

    Its forwards run through `runner` (execution/runner.py): by default each at once; a generation among others
    is given a runner that batches them (the server's).
    """

    def __init__(self, name: str, model: Transformer, cache: KVCache, params: SamplingParams,
                 runner: ModelRunner = DIRECT):
        self.name, self.model, self.cache, self.params, self.runner = name, model, cache, params, runner
        self._fed: list[int] = []
        # the final norm's output at each fed position, for a trained draft head below (record_features());
        # rows [features_from, len(fed)) are valid
        self.features: torch.Tensor | None = None
        self.features_from = 0
        self.feature_layers: tuple[int, ...] | None = None  # None: the final norm's output; else these layers' inputs
        self.stable = 0  # fed[:stable] is known to be committed
        self.forwards = 0
        self.seconds = 0.0
        self._tree: tuple[int, int, DraftTree] | None = None  # (start, pending tokens, tree) until keep_path
        self.on_forward = None  # called with (tokens fed, seconds) after each forward (the adaptive planner's costs)

    @property
    def fed(self) -> list[int]:
        return self._fed

    @fed.setter
    def fed(self, tokens: list[int]) -> None:
        """Set from outside (a prefill, a rebuild from the full cache): no features for these tokens."""
        self._fed = tokens
        self.features_from = len(tokens)

    def record_features(self, layers: tuple[int, ...] | None = None) -> None:
        """From now on, keep the final norm's output of every token this state feeds (drafthead.HeadDrafter
        drafts from them), or (`layers`, an EAGLE-3 head's) the inputs of those layers concatenated; forwards
        then run eagerly (not as CUDA graphs)."""
        if self.features is None:
            self.feature_layers = layers
            width = self.model.cfg.hidden_size * (len(layers) if layers else 1)
            self.features = torch.zeros(0, width, device=self.model.device)
            self.features_from = len(self._fed)

    def _store_features(self, start: int, rows: torch.Tensor) -> None:
        """rows [n, hidden] are the features of fed[start:start + n]."""
        end = start + rows.shape[0]
        if end > self.features.shape[0]:
            grown = torch.zeros(max(end, 2 * self.features.shape[0], 1024), rows.shape[1], device=rows.device)
            grown[:self.features.shape[0]] = self.features
            self.features = grown
        self.features[start:end] = rows
        if start < self.features_from:
            self.features_from = start

    def _sync(self, ctx: list[int], committed: int) -> int:
        """Roll back to the longest prefix of `fed` matching ctx, keeping at least one ctx token to
        feed (its logits give the next distribution); -> the kept length."""
        n, end = self.stable, min(len(self.fed), len(ctx) - 1)
        while n < end and self.fed[n] == ctx[n]:
            n += 1
        if n < len(self.fed):
            self.cache.rollback(n)
            del self.fed[n:]
        self.stable = min(n, committed)
        return n

    @torch.inference_mode()
    def score(self, ctx: list[int], committed: int, draft: list[int] | DraftTree) -> Scores:
        """Next-token scores after ctx and after each drafted token (row 0 after ctx, row i + 1 after draft node
        i): their argmax ids when greedy, else the fp32 distributions after temperature, top-k and top-p.
        One forward over the ctx tokens not yet fed plus the draft: a list is a chain, a DraftTree
        is fed as a token block (each node at position len(ctx) + depth, seeing its ancestors) and
        must be followed by keep_path() before the next forward."""
        if self.params.greedy:
            return Scores(ids=self._forward(ctx, committed, draft, argmax=True)[1])
        return Scores(probs=probs_from_logits(self._forward(ctx, committed, draft)[0], self.params))

    @torch.inference_mode()
    def ranked(self, ctx: list[int], committed: int, draft: list[int] | DraftTree) -> torch.Tensor:
        """The same forward as score's -> rows [len(draft) + 1, V] a tree drafter ranks each vertex's children by:
        the fp32 logits when greedy (their top-k), else the distributions score gives (sampled)."""
        logits = self._forward(ctx, committed, draft)[0]
        return logits if self.params.greedy else probs_from_logits(logits, self.params)

    def _forward(self, ctx: list[int], committed: int, draft: list[int] | DraftTree, argmax: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of score and ranked -> (fp32 logits [len(draft) + 1, V], their argmax per row [len(draft) +
        1] with `argmax`, else None)."""
        n = self._sync(ctx, committed)
        pending = ctx[n:]
        tree = draft if isinstance(draft, DraftTree) else None
        tokens = list(tree.tokens) if tree is not None else list(draft)
        block = None
        if tree is not None and not tree.is_chain:
            block = _tree_block(len(pending), tree, self.model.device)
            self._tree = (n, len(pending), tree)
        recording = self.features is not None  # (a forward recording features runs eagerly: hidden=True)
        if len(pending) > 1 and block is None and not recording:
            pending = self._catch_up(pending, len(tokens))  # (one pending token is every round's: nothing to split)
        feed = pending + tokens
        t = time.perf_counter()
        graphs = self.model.graphs
        ids = None
        if not recording and graphs is not None and graphs.usable(self.cache, block, len(feed)):
            logits = graphs.forward(feed, self.cache, last=len(tokens) + 1)
        elif argmax and not recording:  # (where the forward runs: a serving batch's, all its requests' at once)
            out, ids = self.runner.forward_argmax(self.model, torch.tensor([feed], device=self.model.device),
                                                  self.cache, last=len(tokens) + 1, block=block)
            logits, ids = out[0], ids[0]
        else:
            out = self.runner.forward(self.model, torch.tensor([feed], device=self.model.device), self.cache,
                                      last=len(tokens) + 1, block=block, hidden=recording, layers=self.feature_layers)
            if recording:
                out, hidden = out
                self._store_features(n, hidden[0])
            logits = out[0]
        self._fed_by_forward(feed, t)
        if argmax and ids is None:
            ids = logits.argmax(-1)
        return logits, ids

    def _fed_by_forward(self, tokens: list[int], started: float) -> None:
        """`tokens` were fed by a forward begun at `started` (perf_counter): counted, timed, and now in `fed`."""
        dt = self.runner.forward_seconds(started)  # among others: its share of its batch's time, not the wait
        self.seconds += dt
        self.forwards += 1
        if self.on_forward is not None:
            self.on_forward(len(tokens), dt)
        self.fed.extend(tokens)

    def _catch_up(self, pending: list[int], drafted: int) -> list[int]:
        """Where the runner batches forwards with other requests' (ModelRunner.catch_up_tokens): feed the head of
        `pending` (tokens a level that sat out missed) in forwards that batch with the others', so that `pending`'s
        rest plus `drafted` tokens fit one too -> the rest. Why: a longer forward runs alone with every other request
        waiting for it; a retrieval level re-fed 17-28 tokens so took 31-49 ms alone, 3-5 times per load of 8
        requests at 8K (AMD Zen 5). Where no forward batches, or the drafts alone fill one: `pending` whole."""
        most = self.runner.catch_up_tokens(self.model, self.cache)
        keep = max(1, most - drafted)  # (the last pending token's logits are the first draft's distribution)
        while most and len(pending) > keep:
            k = min(most, len(pending) - keep)
            head, pending = pending[:k], pending[k:]
            t = time.perf_counter()
            self.runner.forward(self.model, torch.tensor([head], device=self.model.device), self.cache, last=1)
            self._fed_by_forward(head, t)
        return pending

    def keep_path(self, path: list[int]) -> None:
        """After scoring a tree: keep the pending tokens and the accepted nodes `path` (root to leaf)
        in the cache, dropping the other branches (their rows are compacted away). A chain needs no
        call: its rejected suffix is rolled back lazily (one integer) by the next forward."""
        if self._tree is None:
            return
        start, m, tree = self._tree
        self._tree = None
        self.cache.keep(start, list(range(m)) + [m + i for i in path])
        if self.features is not None and path:
            kept = torch.tensor([start + m + i for i in path], device=self.features.device)
            self.features[start + m:start + m + len(path)] = self.features[kept]
        del self.fed[start + m:]
        self.fed.extend(tree.tokens[i] for i in path)

    def prefill(self, tokens: list[int], chunk_size: int = 512, progress: bool = False) -> None:
        """Feed `tokens` (from an empty cache) in chunks (recording features, keeping those of the last chunk)."""
        assert not self.fed
        tail = [] if self.features is not None else None
        prefill(self.model, self.cache, torch.tensor([tokens], device=self.model.device), chunk_size, progress,
                features=tail, layers=self.feature_layers, runner=self.runner)
        self.fed = list(tokens)
        self.stable = len(tokens)
        if tail:
            self._store_features(len(tokens) - tail[0].shape[0], tail[0])


class PrefilledPrompt:
    """A prompt's prefill in a full cache, reused by several generations (benchmarks, tuning): each
    generation rolls the cache back to the prompt, so the prefill is paid once. Pass it to
    generate(..., prefilled=...). Keeps the last prompt token's queries for retrieval builds."""

    def __init__(self, model: Transformer, prompt: list[int], capacity: int, chunk_size: int = 512,
                 progress: bool = False):
        self.model = model
        self.head = list(prompt[:-1])  # every state reads the prompt but its last token
        self.cache = new_cache(model, capacity, record_queries=True)
        tail: list = []
        prefill(model, self.cache, torch.tensor([self.head], device=model.device), chunk_size, progress, features=tail)
        self.features = tail[0] if tail else None  # the last chunk's (a draft head's stack reads them)
        self.queries = self.cache.recorder.last()
        self.point = self.cache.checkpoint()  # a sliding-window ring, an int8 cache's buffer: saved

    def restore(self, prompt: list[int]):
        """The full cache holding exactly this prompt's head; ValueError for another prompt."""
        if list(prompt[:-1]) != self.head:
            raise ValueError("the prefilled prompt belongs to another prompt")
        self.cache.restore(self.point)
        self.cache.recorder.record_all(list(self.queries), len(self.head) - 1)
        return self.cache
