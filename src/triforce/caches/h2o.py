"""H2O (Heavy-Hitter Oracle, Zhang et al. 2023), the seed talk's third KV policy, as a drafting cache.

H2O keeps, per layer and KV head, the keys that have drawn the most attention so far (the "heavy hitters")
plus a window of the most recent tokens. Here it is built the way the retrieval cache is (it subclasses it:
the same storage, appends, O(1) rollback to the build point, rebuild policy), choosing single positions by
accumulated attention instead of chunks by mean key:

  * the attention weights softmax(q k^T * scale) of the last OBSERVED queries the full cache recorded
    (its last forward's, at most 64: after prefill the prompt's last tokens, after a verification round
    its tokens), each over the keys it sees (causal), summed over those queries and over the query heads
    that share the KV head (GQA);
  * kept: the `recent` newest positions, and the highest-scoring others up to `budget` tokens in all, the
    same count for every layer and head (attention sinks are kept when they draw attention, as H2O finds
    they do);
  * a context that fits in the budget is kept whole.

Exactness does not depend on the choice: the full level verifies. (H2O proper accumulates the attention of
every decoding step and evicts as it goes; rebuilding from an observation window, as SnapKV does, needs
no attention weights from the compiled attention kernels and keeps rollback O(1).)
"""
from __future__ import annotations

import torch

from ..errors import TriforceError
from .retrieval import RetrievalCache

OBSERVED = 64  # recorded queries whose attention is accumulated at a build
SCORE_BLOCK = 16  # queries scored at once (bounds the [Hq, block, N] attention weights held)


class H2OCache(RetrievalCache):
    # No CUDA graph: its selection reads attention scores, eagerly. Its forwards are the retrieval cache's, so on the
    # CPU they take the one call through every layer (slot_layout) all the same.
    FIXED_SLOTS = False

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, budget: int, recent: int = 64,
                 scale: float | None = None, **kw):
        if budget <= recent:
            raise TriforceError(f"H2O budget {budget} is too small: it must exceed the {recent} recent tokens it "
                                f"always keeps (raise the budget or lower --recent)")
        super().__init__(n_layers, n_kv_heads, head_dim, budget=budget, chunk_size=1, recent=recent, **kw)
        self.scale = head_dim ** -0.5 if scale is None else scale

    def select(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """keys [B, Hkv, N, D], queries [B, Hq, Tq, D] of positions N - Tq .. N - 1 -> kept positions
        [B, Hkv, budget] (ascending): the `recent` newest and the heaviest hitters of the last OBSERVED
        queries."""
        B, Hkv, N, D = keys.shape
        if N <= self.budget:
            return torch.arange(N, device=keys.device).expand(B, Hkv, N)
        queries = queries[:, :, -OBSERVED:]
        Tq, g = queries.shape[2], queries.shape[1] // Hkv
        kf = keys.float()
        weight = torch.zeros(B, Hkv, N, device=keys.device)
        for t0 in range(0, Tq, SCORE_BLOCK):
            q = queries[:, :, t0:t0 + SCORE_BLOCK].float().reshape(B, Hkv, -1, D)  # rows (group head, token)
            n = q.shape[2] // g
            s = (q @ kf.transpose(-1, -2)) * self.scale  # [B, Hkv, g * n, N]
            pos = N - Tq + t0 + torch.arange(n, device=keys.device).repeat(g)  # each row's position
            s.masked_fill_(torch.arange(N, device=keys.device) > pos[:, None], float("-inf"))
            weight += torch.softmax(s, dim=-1).sum(dim=2)
        older = N - self.recent
        top = weight[..., :older].topk(self.budget - self.recent, dim=-1).indices.sort(dim=-1).values
        tail = torch.arange(older, N, device=keys.device).expand(B, Hkv, self.recent)
        return torch.cat([top, tail], dim=-1)
