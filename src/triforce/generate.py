"""Prefill and plain autoregressive generation (the `ar` method and the baseline of every speedup)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .errors import TriforceError
from .kv import KVCache
from .model import Transformer
from .sampling import SamplingParams, make_generator, probs_from_logits, sample


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    finish_reason: str  # "eos" or "length"
    method: str = "ar"
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def check_request(n_prompt: int, max_new_tokens: int, max_context: int) -> None:
    if n_prompt == 0:
        raise TriforceError("the prompt is empty: give some text with --prompt, --prompt-file or --demo-tokens")
    if max_new_tokens < 1:
        raise TriforceError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if n_prompt + max_new_tokens > max_context:
        raise TriforceError(
            f"the prompt ({n_prompt} tokens) plus --max-new-tokens ({max_new_tokens}) exceeds the context of "
            f"{max_context} tokens: shorten the prompt, lower --max-new-tokens, or raise --max-context "
            f"(only as far as the model's RoPE scaling supports)"
        )


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, ids: torch.Tensor, chunk_size: int = 512,
            progress: bool = False) -> torch.Tensor:
    """Feed ids [B, N] in chunks (bounded attention memory); -> fp32 logits of the last token [B, V]."""
    from tqdm.auto import tqdm

    n = ids.shape[1]
    logits = None
    with tqdm(total=n, desc="prefill", unit="tok", disable=not progress or n <= chunk_size, leave=False) as bar:
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = model(ids[:, start:end], cache, last_only=True)
            bar.update(end - start)
    return logits[:, -1]


@torch.inference_mode()
def generate_ar(model: Transformer, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                *, eos_ids: tuple[int, ...] = (), seed: int | None = 0, cache: KVCache | None = None,
                prefill_chunk: int = 512, progress: bool = False) -> GenerationResult:
    """Plain autoregressive decoding of `prompt` (batch size 1)."""
    check_request(len(prompt), max_new_tokens, model.cfg.max_context)
    device = model.device
    if cache is None:
        cache = model.new_cache(len(prompt) + max_new_tokens)
    gen = make_generator(seed, device)
    t0 = time.perf_counter()
    logits = prefill(model, cache, torch.tensor([prompt], device=device), prefill_chunk, progress)
    t1 = time.perf_counter()
    out: list[int] = []
    finish = "length"
    eos = set(eos_ids)
    token = torch.empty(1, 1, dtype=torch.long, device=device)
    while True:
        if params.greedy:
            nxt = logits.argmax(-1)
        else:
            nxt = sample(probs_from_logits(logits, params), gen)
        t = int(nxt)
        out.append(t)
        if t in eos:
            finish = "eos"
            break
        if len(out) >= max_new_tokens:
            break
        token[0, 0] = t
        logits = model(token, cache)[:, -1]
    t2 = time.perf_counter()
    return GenerationResult(out, len(prompt), t1 - t0, t2 - t1, finish, "ar")
