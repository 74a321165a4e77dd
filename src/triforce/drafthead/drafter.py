"""HeadDrafter: a trained draft head at the bottom of a stack.

Terms. Position p of the head's cache holds the pair (f[p-1], x[p]) (head.py). A position is *real* when
f[p-1] is a feature some level above computed (its `features`), *drafted* when it is the head's own
prediction (the drafted tokens of the last round). Each round:

    keep     the real positions that still match the context; roll the rest back (the drafted ones)
    catch up feed the positions up to the context's last token with the features the levels above computed
             since (the verifier's last forward: the accepted drafts and the token before them)
    draft    k tokens, each from the LM head over the head's prediction (q: its distribution after the
             temperature, top-k and top-p, so the verifier's acceptance rule stays exact), feeding the
             prediction and the drafted token to get the next one

Worked example (k = 3): context ... a b, the verifier has features up to a. Catch up: (f[a], b) -> f^[b];
draft c ~ q(f^[b]); (f^[b], c) -> f^[c]; d ~ q(f^[c]); (f^[c], d) -> f^[d]; e ~ q(f^[d]). The verifier
accepts c, d and samples y: next round keeps positions up to b, catches up (f[b], c), (f[c], d), (f[d], y).
"""
from __future__ import annotations

import time
import weakref

import torch

from ..caches import new_window_cache
from ..caches.base import KVCache, TokenBlock
from ..model import Transformer
from ..sampling import SamplingParams, probs_from_logits, sample
from ..speculation.drafters import draft_tree
from ..speculation.state import ModelState
from ..speculation.tree import DraftTree
from .head import DraftHead, embed_tokens


def prepare_for_drafting(head: DraftHead, model: Transformer) -> None:
    """Once per head: on the target's device (fp32, as the features it reads); on a CPU its layer and linear layers
    run on the target's kernels, the weights as bf16 panels (half the bytes; the head only drafts)."""
    prepared = getattr(head, "_prepared_for", None)
    if prepared is not None and prepared() is model:
        return
    head._prepared_for = weakref.ref(model)  # (the head outlives no model it was loaded for: head_for's cache)
    head.to(model.device)
    head.rotary.inv_freq = head.rotary.inv_freq.to(model.device)  # (rope.Rotary holds a plain tensor, not a buffer)
    if model.device.type != "cpu":
        return
    head.layer.backend = model.backend
    for lin in (head.fc, head.layer.wqkv, head.layer.wo, head.layer.w_gate_up, head.layer.w_down):
        lin.backend = model.backend if model.backend.enabled else lin.backend
        lin.pack(torch.bfloat16)


class HeadDrafter:
    """Drafts chains and trees from a DraftHead, reading the features of the model states above it
    (read_features_of)."""

    name = "head"

    def __init__(self, head: DraftHead, model: Transformer, params: SamplingParams, generator: torch.Generator,
                 max_rollback: int, kv_dtype: torch.dtype = torch.float32, lm_model: Transformer | None = None):
        """`lm_model`: the model whose LM head turns predictions into logits (the target's draft-weights copy:
        the same head in fewer bytes); default the target."""
        self.head, self.model, self.params, self.generator = head, model, params, generator
        self.lm_model = lm_model or model
        prepare_for_drafting(head, model)
        self.window, self.max_rollback, self.kv_dtype = head.cfg.window, max_rollback + 8, kv_dtype
        self.sources: list[ModelState] = []  # the states whose features it reads, nearest first
        self.feature_layers = head.feature_layers  # the target layers whose inputs it reads (None: final norm's output)
        self.cache: KVCache | None = None
        self.start = 0  # the cache's first position
        self.tokens: list[int] = []  # x[p] at positions start ..
        self.real = 0  # positions start .. start + real - 1 are real
        self.tokens_drafted = self.forwards = self.syncs = 0
        self.seconds = 0.0
        self.catch_up_rows = 0
        self.on_forward = None  # called with (1, seconds) per drafted token (the adaptive planner's cost of the level)

    def read_features_of(self, states: list[ModelState]) -> None:
        """Read the features of `states` (the levels above, nearest first), which record them from now on."""
        self.sources = states
        for s in states:
            s.record_features(self.feature_layers)

    def _reset(self, start: int) -> None:
        c = self.head.cfg
        self.cache = new_window_cache(1, c.n_kv_heads, c.head_dim, self.window, self.max_rollback,
                                      dtype=self.kv_dtype, device=self.model.device)
        if start:
            self.cache.skip_to(start)
        self.start, self.tokens, self.real = start, [], 0

    def _features(self, ctx: list[int], lo: int, hi: int) -> tuple[int, list[torch.Tensor]]:
        """The features of context rows [j, hi) for the smallest j >= lo the sources hold without a gap (each
        row from the nearest source that computed it for this context) -> (j, row blocks in order)."""
        spans = []  # (source, first valid row, end of valid rows)
        for s in self.sources:
            if s.features is None:
                continue
            n = min(len(s.fed), len(ctx))
            end = s.stable
            while end < n and s.fed[end] == ctx[end]:
                end += 1
            if end > s.features_from:
                spans.append((s, s.features_from, end))
        blocks, j = [], hi
        while j > lo:
            best = None
            for s, a, b in spans:  # nearest first: the first source holding row j - 1, back as far as it goes
                if a < j <= b:
                    best = (s, max(a, lo))
                    break
            if best is None:
                break
            s, a = best
            blocks.append(s.features[a:j])
            j = a
        return j, blocks[::-1]

    @torch.inference_mode()
    def _forward(self, features: torch.Tensor, tokens: list[int], offsets: torch.Tensor, block=None) -> torch.Tensor:
        """One forward of the head over `tokens` at the cache's length + offsets (a TokenBlock's visibility, or a
        causal chain): (features [T, hidden], tokens [T]) -> predictions [T, hidden], committed to the cache."""
        cache, dev = self.cache, self.model.device
        cache.prepare(len(tokens), block)
        emb = embed_tokens(self.model, torch.tensor([tokens], device=dev))
        out = self.head(features[None].float(), emb, cache.length + offsets, cache)[0]
        cache.commit(len(tokens))
        self.forwards += 1
        return out

    def _feed(self, features: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Positions len .. len + T - 1 of the cache: (features [T, hidden], tokens [T]) -> predictions [T, hidden]."""
        out = self._forward(features, tokens, torch.arange(len(tokens), device=self.model.device))
        self.tokens.extend(tokens)
        return out

    def _catch_up(self, ctx: list[int], committed: int) -> torch.Tensor | None:
        """Keep, roll back and catch up so that the cache holds positions up to len(ctx) - 1, all real ->
        the prediction at the last one (None when no source has the feature it needs)."""
        n = len(ctx)
        keep = 0
        while keep < self.real and self.start + keep < n - 1 and self.tokens[keep] == ctx[self.start + keep]:
            keep += 1
        lo = max(self.start + keep, 1, n - 1 - self.window)
        j, blocks = self._features(ctx, lo - 1, n - 1)
        if not blocks:
            return None
        first = j + 1  # the first position fed
        if self.cache is None or first != self.start + keep:  # a gap in the features, or past the window
            self._reset(first)
            keep = 0
        else:
            try:
                self.cache.rollback(first)
            except ValueError:  # farther than the cache keeps: start over at `first`
                self._reset(first)
                keep = 0
            del self.tokens[first - self.start:]
        feats = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        self.catch_up_rows += feats.shape[0]
        out = self._feed(feats, ctx[first:n])
        self.real = len(self.tokens)
        return out[-1]

    def _logits(self, prediction: torch.Tensor) -> torch.Tensor:
        """The next-token logits [V] of a prediction [hidden]: the target's LM head (and softcap)."""
        return self.head.logits(prediction, self.lm_model)

    @torch.inference_mode()
    def propose(self, ctx: list[int], committed: int, k: int) -> tuple[list[int], torch.Tensor | None]:
        t = time.perf_counter()
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        pred = self._catch_up(ctx, committed)
        for i in range(k if pred is not None else 0):
            t_token = time.perf_counter()
            row = self._row(pred)
            if self.params.greedy:
                x = int(row.argmax())
            else:
                x = int(sample(row, self.generator))
                rows.append(row)
            tokens.append(x)
            self.syncs += 1
            if i + 1 < k:
                pred = self._feed(pred[None], [x])[-1]
            if self.on_forward is not None:
                self.on_forward(1, time.perf_counter() - t_token)
        self.tokens_drafted += len(tokens)
        self.seconds += time.perf_counter() - t
        return tokens, (torch.stack(rows) if rows else None)

    def _row(self, prediction: torch.Tensor) -> torch.Tensor:
        """A vertex's row for sample_children: its logits when greedy (top-k), else its probabilities."""
        logits = self._logits(prediction)
        return logits if self.params.greedy else probs_from_logits(logits, self.params)

    @torch.inference_mode()
    def _feed_tree(self, features: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """The nodes of a draft tree after the cached positions, as one token block (each at position length +
        depth, seeing the cached positions and its own ancestors): (features [N, hidden], the tree) -> predictions
        [N, hidden]. The block is dropped again (the cache keeps real positions only)."""
        n, dev = self.cache.length, self.model.device
        offsets = torch.tensor(tree.depths, dtype=torch.long, device=dev)
        # a tree that is still a chain (one node per depth) goes as one: a causal forward, as the levels feed chains
        out = self._forward(features, list(tree.tokens), offsets,
                            None if tree.is_chain else TokenBlock(offsets, tree.ancestry().to(dev)))
        self.cache.rollback(n)
        return out

    def propose_tree(self, ctx: list[int], committed: int, template: tuple[int, ...]
                     ) -> tuple[DraftTree, torch.Tensor | None]:
        """A draft tree in the shape of `template` (speculation.drafters.draft_tree): each depth the tree so far is
        fed as one token block, each node reading its parent's prediction as its feature; a vertex's children come
        from the LM head over its prediction."""
        t = time.perf_counter()
        root = self._catch_up(ctx, committed)
        if root is None:
            return DraftTree((), ()), None
        preds: list[torch.Tensor] = []  # of the tree's nodes as last fed

        def rows_after(tree: DraftTree, nodes: list[int]) -> list[torch.Tensor]:
            preds[:] = list(self._feed_tree(torch.stack([root if p < 0 else preds[p] for p in tree.parents]), tree))
            return [self._row(preds[n]) for n in nodes]

        tree, q, depths = draft_tree(template, self._row(root), rows_after, self.params.greedy, self.generator)
        self.syncs += depths
        self.tokens_drafted += len(tree)
        self.seconds += time.perf_counter() - t
        return tree, q

    def step(self, ctx: list[int], committed: int, limit: int) -> list[int]:
        raise NotImplementedError("a draft head drafts for a level above; it cannot be the top of a stack")

    def stats(self) -> dict:
        return {"level": self.name, "role": "draft", "tokens": self.tokens_drafted, "seconds": round(self.seconds, 4),
                "forwards": self.forwards, "host_syncs": self.syncs, "catch_up_rows": self.catch_up_rows}
