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

PEERS = ("transformers", "transformers-lookup", "transformers-assisted")


class TransformersPeer:
    def __init__(self, hf_dir, rope_theta: float, draft_dir=None):
        import transformers

        kw = {"dtype": torch.float32, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}}
        self.tf = transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), **kw).eval()
        self.draft = (transformers.AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
                      if draft_dir else None)

    def decode_ms(self, n_ctx: int, steps: int = 8) -> float:
        from .decode_step import time_transformers

        return time_transformers(None, None, n_ctx, steps, hf=self.model) * 1e3

    def continue_prompt(self, prompt: list[int], full_cache, max_new: int, temperature: float, seed: int,
                        mode: str) -> tuple[float, list[int]]:
        """ms per generated token and the tokens of `generate` continuing `prompt`.

        mode "plain" starts from our prefill (full_cache holds the prompt's first len(prompt) - 1
        tokens; checked to give ar's tokens). "lookup" and "assisted" run transformers' own prefill:
        its assisted generation from a pre-filled cache (ours or its own) diverged from greedy in
        transformers 5.23, so their time is (t(max_new tokens) - t(1 token)) / (max_new - 1)."""
        ids = torch.tensor([prompt])
        kw = dict(pad_token_id=0, do_sample=temperature > 0)
        if temperature > 0:
            kw.update(temperature=temperature, top_p=0.9, top_k=0)
        if mode == "lookup":
            kw["prompt_lookup_num_tokens"] = 10
        elif mode == "assisted":
            kw["assistant_model"] = self.draft

        def run(new: int, cache=None):
            torch.manual_seed(seed)
            with torch.inference_mode():
                t = time.perf_counter()
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                          max_new_tokens=new, min_new_tokens=new, **kw)
                return time.perf_counter() - t, out[0, len(prompt):].tolist()

        if mode == "plain":
            cache = self.tf.DynamicCache(config=self.model.config)
            n = len(prompt) - 1
            for layer in range(full_cache.n_layers):
                cache.update(full_cache.k[layer, :, :, :n], full_cache.v[layer, :, :, :n], layer)
            seconds, toks = run(max_new, cache)
            return seconds / len(toks) * 1e3, toks
        one, _ = run(1)
        seconds, toks = run(max_new)
        return (seconds - one) / max(1, len(toks) - 1) * 1e3, toks
