"""The engines users compare us with, timed on the same model, prompt and context in the bench run.

- transformers `generate`, plain: decode steps over a KV cache of the context's length (random
  contents: a step's cost does not depend on them), so no second 32K prefill is needed;
- transformers `generate` with `prompt_lookup_num_tokens` (its n-gram speculation) and, when a
  draft model is given, with `assistant_model`: these depend on the text, so they continue the real
  prompt, with transformers' own prefill (slow at long context; see continue_prompt).

Timings are ms per generated token.
"""
from __future__ import annotations

import time

import torch

from .decode_step import load_transformers, time_transformers

PEERS = ("transformers", "transformers-lookup", "transformers-assisted")


class TransformersPeer:
    def __init__(self, hf_dir, rope_theta: float, draft_dir=None):
        self.model = load_transformers(hf_dir, rope_theta)
        self.draft = load_transformers(draft_dir) if draft_dir else None

    def decode_ms(self, n_ctx: int, steps: int = 8) -> float:
        return time_transformers(self.model, n_ctx, steps) * 1e3

    def continue_prompt(self, prompt: list[int], max_new: int, temperature: float, seed: int,
                        mode: str) -> tuple[float, list[int]]:
        """ms per generated token and the tokens of `generate` continuing `prompt` with prompt lookup
        (mode "lookup") or the draft model (mode "assisted").

        These run transformers' own prefill: its assisted generation from a pre-filled cache (ours, or
        one transformers filled itself) diverged from greedy in transformers 5.23, so the time is
        (t(max_new tokens) - t(1 token)) / (max_new - 1)."""
        ids = torch.tensor([prompt])
        kw = dict(pad_token_id=0, do_sample=temperature > 0)
        if temperature > 0:
            kw.update(temperature=temperature, top_p=0.9, top_k=0)
        if mode == "lookup":
            kw["prompt_lookup_num_tokens"] = 10
        else:
            kw["assistant_model"] = self.draft

        def run(new: int):
            torch.manual_seed(seed)
            with torch.inference_mode():
                t = time.perf_counter()
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                          min_new_tokens=new, **kw)
                return time.perf_counter() - t, out[0, len(prompt):].tolist()

        one, _ = run(1)
        seconds, toks = run(max_new)
        return (seconds - one) / max(1, len(toks) - 1) * 1e3, toks
