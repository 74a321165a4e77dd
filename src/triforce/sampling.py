"""From logits to the distribution we sample from, and the seeded draws.

Temperature 0 is greedy decoding expressed as a distribution: a one-hot vector on the argmax. The
speculative acceptance rule applied to one-hot distributions is exactly "accept iff the argmax
matches", so greedy needs no separate code path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import TriforceError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k

    def __post_init__(self):
        if not (self.temperature >= 0) or self.temperature != self.temperature:
            raise TriforceError(f"--temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise TriforceError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise TriforceError(f"--top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (fp32) after temperature, top-k and top-p."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # keep a token if the mass strictly before it (in descending order) is < top_p (the top token is
        # always kept). Sorting a 262K-token vocabulary per row costs milliseconds: the top k candidates
        # decide it whenever their mass reaches top_p (every token after them then has mass before it
        # >= top_p, so it is dropped either way), k from TOP_P_CANDIDATES in turn; otherwise the whole row
        # is sorted.
        sorted_p = order = None
        for k in TOP_P_CANDIDATES:
            if k >= probs.shape[-1]:
                break
            top, top_order = probs.topk(k, dim=-1)
            if not bool((top.sum(-1) < params.top_p).any()):
                sorted_p, order = top, top_order
                break
        if sorted_p is None:
            sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# Candidate counts tried in turn: for the embedded model at T=0.6, top-p 0.9, the top 128 hold the mass in every
# row of a Shakespeare passage (the top 64 in 98%); topk(128) over its 49K vocabulary took 0.025 ms per row, topk(1024)
# 0.47 (AMD Zen 5): 1.4 ms of a 5-token verification's 31.
TOP_P_CANDIDATES = (128, 1024)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] (non-negative rows with a positive sum; they need not be normalised) -> token
    ids [...] (long), drawn with `generator`: one uniform per row, inverse CDF. A token of probability
    0 is never drawn (its CDF step is empty); a one-hot row always gives its token. The CDF is summed
    in float64 so that small probabilities keep their mass. (torch.multinomial took 0.9 ms per
    49K-token row here, this about 0.03.)"""
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.double().cumsum(-1)
    u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device, dtype=torch.float64)
    out = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=flat.shape[-1] - 1).squeeze(-1)
    return out.view(probs.shape[:-1])


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


class Scores:
    """A model's next-token verdict after the context and after each drafted node: row 0 after the context, row
    i + 1 after node i. Greedy, `ids` [n + 1]: each row's argmax (a one-hot distribution is its argmax, so greedy
    verification compares ids). Sampling, `probs` [n + 1, V]: fp32 distributions after temperature, top-k and
    top-p. Exactly one of the two is set."""

    def __init__(self, ids: torch.Tensor | None = None, probs: torch.Tensor | None = None):
        assert (ids is None) != (probs is None)
        self.ids, self.probs = ids, probs

    @property
    def greedy(self) -> bool:
        return self.ids is not None

    @property
    def device(self) -> torch.device:
        return (self.ids if self.probs is None else self.probs).device

    def __len__(self) -> int:
        return len(self.ids if self.probs is None else self.probs)

    def __getitem__(self, rows) -> Scores:
        """These rows (an index list, a slice)."""
        return Scores(ids=self.ids[rows]) if self.probs is None else Scores(probs=self.probs[rows])

    def token(self, row: int, generator: torch.Generator | None) -> int:
        """The next token after `row`: its argmax when greedy, else a sample of its distribution."""
        return int(self.ids[row]) if self.probs is None else int(sample(self.probs[row], generator))
