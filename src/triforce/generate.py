"""Generation with any speculation stack: the round loop, as a stream of accepted tokens.

    for chunk in generate_stream(model, prompt, 128, stack="ngram,retrieval:1024,full", tokenizer=tok):
        print(chunk.text, end="")

`generate()` is the same loop, collected. Every stack gives the target's output exactly: the same
tokens as `ar` at temperature 0, the same distribution when sampling.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .detokenize import TextDeltas
from .errors import TriforceError
from .execution.runner import DIRECT, ModelRunner
from .model import Transformer
from .sampling import SamplingParams, make_generator
from .speculation.builder import BuiltStack
from .speculation.provenance import RoundProvenance
from .speculation.settings import SpecConfig
from .speculation.stack import StackSpec, method_stack
from .speculation.state import PrefilledPrompt


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    finish_reason: str  # "eos", "stop" (a stop string) or "length"
    method: str = "ar"  # the method name, or the stack's levels when given as a stack
    stats: dict = field(default_factory=dict)
    text: str | None = None  # with a tokenizer: the generated text (up to a stop string, excluded)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else float("nan")


@dataclass
class StreamChunk:
    tokens: list[int]  # tokens committed by one round (in order; together: result.tokens)
    text: str = ""  # their text, complete characters only (with a tokenizer)
    # which level drafted each token, the draft tail the top verifier cut, the round's verifications
    # (speculation/provenance.py; its `texts`, with a tokenizer, are `text` split over the tokens)
    provenance: RoundProvenance | None = None


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


def resolve_stack(stack: StackSpec | str | None, method: str | None, config: SpecConfig) -> tuple[StackSpec, str]:
    """-> (the stack to run, its name for results): `stack` (a spec or a --levels string, gammas
    from config.gamma) wins over `method` (a named stack)."""
    if stack is not None:
        spec = StackSpec.parse(stack, None, config.gamma) if isinstance(stack, str) else stack
        return spec, spec.levels_text
    method = method or "ar"
    return method_stack(method, config.gamma, config.gamma_draft, config.draft, adaptive=config.adapt), method


class _StopText:
    """Decoded text of the generated tokens, cut at the first stop string; holds back a tail that
    may still become a stop string, and an incomplete UTF-8 character."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.deltas, self.stop = TextDeltas(tokenizer), stop
        self.text = ""  # all complete text so far
        self.sent = 0  # characters of it already yielded
        self.stopped = False
        self.mark = 0  # len(text) at the last take: where the tokens pushed since then start
        self.ends: list[int] = []  # per token pushed since the last take, len(text) after it

    def push(self, token: int) -> None:
        self.text += self.deltas.push([token])
        if self.stop:
            hits = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
        self.ends.append(len(self.text))

    def take_pieces(self, final: bool = False) -> tuple[str, list[str]]:
        """take(), and that text split over the tokens pushed since the last take (the page marks each token's
        text by its level): each token gets the characters it completed. Characters held back from an earlier round
        (a possible stop string's start) go to this round's first token, and the decoder's final flush to its last,
        so the pieces always join to exactly the text taken."""
        a = self.sent
        out = self.take(final)
        b = self.sent

        def clip(x: int) -> int:
            return min(max(x, a), b)
        bounds = [clip(x) for x in [self.mark] + self.ends]
        pieces = [self.text[s:e] for s, e in zip(bounds, bounds[1:])]
        if pieces:
            pieces[0] = self.text[a:bounds[0]] + pieces[0]
            pieces[-1] += self.text[bounds[-1]:b]
        self.mark, self.ends = len(self.text), []
        return out, pieces

    def take(self, final: bool = False) -> str:
        if final and not self.stopped:
            self.text += self.deltas.finish()
        end = len(self.text)
        if not final and not self.stopped:
            for s in self.stop:  # hold back a suffix that is a prefix of a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out = self.text[self.sent:end]
        self.sent = end
        return out


class GenerationStream:
    """Iterate for StreamChunks as rounds are accepted; `result` once the iteration has ended."""

    def __init__(self, model: Transformer, prompt: list[int], max_new_tokens: int,
                 params: SamplingParams = SamplingParams(), *, stack: StackSpec | str | None = None,
                 method: str | None = None, config: SpecConfig | None = None,
                 draft_model: Transformer | None = None, eos_ids: tuple[int, ...] = (),
                 stop: tuple[str, ...] | list[str] = (), tokenizer=None, seed: int | None = 0,
                 progress: bool = False, prefilled: PrefilledPrompt | None = None, force_route=None,
                 runner: ModelRunner = DIRECT):
        if prompt and isinstance(prompt[0], (list, tuple)):
            raise TriforceError("batch size 1 only for now: pass one prompt (a list of token ids)")
        stop = tuple(s for s in stop if s)
        if stop and tokenizer is None:
            raise TriforceError("stop strings need the tokenizer (tokenizer=...) to see the text")
        check_request(len(prompt), max_new_tokens, model.cfg.max_context)
        self.config = config or SpecConfig()
        self.stack, self.name = resolve_stack(stack, method, self.config)
        self.model, self.prompt, self.max_new_tokens, self.params = model, list(prompt), max_new_tokens, params
        self.draft_model, self.eos, self.seed, self.progress = draft_model, set(eos_ids), seed, progress
        self.prefilled, self.force_route, self.runner = prefilled, force_route, runner
        self.text = _StopText(tokenizer, stop) if tokenizer is not None else None
        self.result: GenerationResult | None = None
        self.levels: BuiltStack | None = None  # the generation's levels, once it has started (BuiltStack.release)

    def __iter__(self):
        gen = make_generator(self.seed, self.model.device)
        t0 = time.perf_counter()
        levels = self.levels = BuiltStack(self.stack, self.model, self.params, self.config, gen, len(self.prompt),
                                          self.max_new_tokens, self.draft_model, self.prefilled, self.force_route,
                                          self.runner)
        levels.prefill(self.prompt, self.progress)
        t1 = time.perf_counter()
        seq, n0 = list(self.prompt), len(self.prompt)
        finish = "length"
        decode_seconds = 0.0
        with torch.inference_mode():
            while finish == "length" and len(seq) - n0 < self.max_new_tokens:
                t = time.perf_counter()
                limit = self.max_new_tokens - (len(seq) - n0)
                before = len(seq)
                for tok in levels.top.step(seq, len(seq), limit):
                    seq.append(tok)
                    if self.text is not None:
                        self.text.push(tok)
                        if self.text.stopped:
                            finish = "stop"  # tokens past a stop string are dropped
                            break
                    if tok in self.eos:
                        finish = "eos"  # tokens drafted past EOS are dropped: AR would have stopped here
                        break
                levels.after_commit(seq, len(seq))
                done = finish != "length" or len(seq) - n0 >= self.max_new_tokens
                text, pieces = self.text.take_pieces(final=done) if self.text is not None else ("", None)
                provenance = levels.provenance(seq[before:], pieces)
                decode_seconds += time.perf_counter() - t  # the consumer's time between rounds is not ours
                yield StreamChunk(seq[before:], text, provenance)
        self.result = GenerationResult(seq[n0:], n0, t1 - t0, decode_seconds, finish, self.name, levels.stats(),
                                       self.text.text if self.text is not None else None)


def generate_stream(model: Transformer, prompt: list[int], max_new_tokens: int,
                    params: SamplingParams = SamplingParams(), **kwargs) -> GenerationStream:
    """A GenerationStream (see GenerationStream for the keyword arguments)."""
    return GenerationStream(model, prompt, max_new_tokens, params, **kwargs)


def generate(model: Transformer, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
             **kwargs) -> GenerationResult:
    """Generate with a stack (`stack=` a StackSpec or a --levels string such as
    "ngram,retrieval:1024,full") or a named method (`method=`: ar, triforce, retrieval, streaming,
    ngram, draft; default ar). Keywords: config (SpecConfig), draft_model, eos_ids, stop (strings;
    needs tokenizer), tokenizer (fills result.text), seed, progress, prefilled (a PrefilledPrompt
    of this prompt: skips the full prefill), runner (how the forwards run, execution/runner.py: a server's batches
    them with other requests')."""
    stream = GenerationStream(model, prompt, max_new_tokens, params, **kwargs)
    for _ in stream:
        pass
    return stream.result


def generate_ar(model: Transformer, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                **kwargs) -> GenerationResult:
    """Plain autoregressive decoding: the baseline of every speedup."""
    return generate(model, prompt, max_new_tokens, params, method="ar", **kwargs)
