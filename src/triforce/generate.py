"""Prefill and plain autoregressive generation (the `ar` method and the baseline of every speedup)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .errors import TriforceError
from .kv import KVCache
from .model import Transformer
from .sampling import SamplingParams, make_generator


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
            progress: bool = False) -> torch.Tensor | None:
    """Feed ids [B, N] in chunks (bounded attention memory); -> fp32 logits of the last token [B, V]
    (None when N == 0: a one-token prompt leaves nothing to prefill before the first draft)."""
    from tqdm.auto import tqdm

    n = ids.shape[1]
    logits = None
    with tqdm(total=n, desc="prefill", unit="tok", disable=not progress or n <= chunk_size, leave=False) as bar:
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = model(ids[:, start:end], cache, last=1)
            bar.update(end - start)
    return None if logits is None else logits[:, -1]


def generate(model: Transformer, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
             *, method: str = "ar", config=None, draft_model: Transformer | None = None,
             eos_ids: tuple[int, ...] = (), seed: int | None = 0, progress: bool = False,
             shared_prefill=None, on_tokens=None) -> GenerationResult:
    """Generate with `method` (see spec/methods.py). Every method gives the target's output exactly:
    the same tokens as `ar` at temperature 0, the same distribution when sampling.
    `shared_prefill` (spec.methods.SharedPrefill of this prompt) skips the full prefill.
    `on_tokens(list[int])` is called with the tokens committed by each round, as they are accepted
    (streaming); together they are exactly `result.tokens`."""
    from .spec.methods import Decoder, SpecConfig

    if prompt and isinstance(prompt[0], (list, tuple)):
        raise TriforceError("batch size 1 only for now: pass one prompt (a list of token ids)")
    check_request(len(prompt), max_new_tokens, model.cfg.max_context)
    config = config or SpecConfig()
    gen = make_generator(seed, model.device)
    t0 = time.perf_counter()
    dec = Decoder(method, model, params, config, gen, len(prompt), max_new_tokens, draft_model, shared_prefill)
    dec.prefill(list(prompt), progress)
    t1 = time.perf_counter()
    seq = list(prompt)
    eos = set(eos_ids)
    finish = "length"
    with torch.inference_mode():
        while finish == "length" and len(seq) - len(prompt) < max_new_tokens:
            limit = max_new_tokens - (len(seq) - len(prompt))
            before = len(seq)
            for t in dec.top.step(seq, len(seq), limit):
                seq.append(t)
                if t in eos:
                    finish = "eos"  # tokens drafted past EOS are dropped: AR would have stopped here
                    break
            if on_tokens is not None:
                on_tokens(seq[before:])
            dec.after_commit(seq, len(seq))
    t2 = time.perf_counter()
    return GenerationResult(seq[len(prompt):], len(prompt), t1 - t0, t2 - t1, finish, method, dec.stats())


def generate_ar(model: Transformer, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                **kwargs) -> GenerationResult:
    """Plain autoregressive decoding: the baseline of every speedup."""
    return generate(model, prompt, max_new_tokens, params, method="ar", **kwargs)
