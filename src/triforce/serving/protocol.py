"""The OpenAI API's request fields and response shapes, for /v1/completions and /v1/chat/completions.

Parsing turns a JSON body into a `GenerationRequest` or raises `BadRequest` naming the field, which
the app answers with a 400 and OpenAI's error body. Supported: prompt / messages, max_tokens
(max_completion_tokens), temperature, top_p, top_k, seed, stop, stream, stream_options.include_usage,
n = 1, model / user (accepted, not used: one model is served), and this server's extensions top_k and stack / gammas
(a request's own speculation stack, stacks.py). Fields of the API that change
nothing at their default value (presence_penalty 0, logprobs null, echo false, ...) are accepted at
that value only; any other field is refused by name, so a client never silently gets something
other than it asked for.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..errors import TriforceError
from ..sampling import SamplingParams

MAX_STOP_STRINGS = 16


class BadRequest(Exception):
    """A 400: `message` says what is wrong and how to fix it; `param` names the field (or None)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class GenerationRequest:
    kind: str  # "completion" or "chat"
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    stack: object = None  # stacks.RequestStack: the request's own speculation stack; None: the server's


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "user", "stack", "gammas"}
_FIELDS = {"completion": _COMMON | {"prompt"}, "chat": _COMMON | {"messages", "max_completion_tokens"}}


def _zero(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


def _off(v) -> bool:
    return v is None or v is False or v == 0 and not isinstance(v, float)


# field -> (accepted only when, what that value is): the API's no-op values of what this server does not do
_NEUTRAL = {
    "presence_penalty": (_zero, "0"),
    "frequency_penalty": (_zero, "0"),
    "repetition_penalty": (lambda v: v is None or v == 1, "1"),
    "logit_bias": (lambda v: v is None or v == {}, "null or {}"),
    "logprobs": (_off, "null or false"),
    "top_logprobs": (_off, "null or 0"),
    "echo": (lambda v: v is None or v is False, "false"),
    "best_of": (lambda v: v is None or v == 1, "1"),
    "suffix": (lambda v: v is None or v == "", "null"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, '{"type": "text"}'),
    "tools": (lambda v: v is None or v == [], "null or []"),
    "tool_choice": (lambda v: v is None or v == "none", '"none"'),
    "functions": (lambda v: v is None or v == [], "null or []"),
    "parallel_tool_calls": (lambda v: True, "any"),
    "store": (lambda v: v is None or v is False, "false"),
    "metadata": (lambda v: True, "any"),
    "service_tier": (lambda v: True, "any"),
    # SGLang's and vLLM's extensions, which sglang-router / vllm-router add to every request they forward
    "no_stop_trim": (lambda v: v is None or v is False, "false"),
    "ignore_eos": (lambda v: v is None or v is False, "false"),
    "skip_special_tokens": (lambda v: v is None or v is True, "true"),
    "return_hidden_states": (lambda v: v is None or v is False, "false"),
    "continue_final_message": (lambda v: v is None or v is False, "false"),
    "separate_reasoning": (lambda v: True, "any"),  # no reasoning parser: nothing to separate
    "stream_reasoning": (lambda v: True, "any"),
    "include_reasoning": (lambda v: True, "any"),
}


def parse(kind: str, body, tokenizer, default_max_tokens: int, max_context: int,
          choose_stack=None) -> GenerationRequest:
    """A JSON body of /v1/completions (kind "completion") or /v1/chat/completions ("chat") -> the
    request, its prompt tokenized; BadRequest for anything invalid or unsupported. `choose_stack`
    (stacks.StackChooser): reads the `stack` / `gammas` fields; None: a server that takes no per-request stack."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if choose_stack is None and ("stack" in body or "gammas" in body):
        name = "stack" if "stack" in body else "gammas"
        raise BadRequest(f"'{name}' is not supported by this server (a request's own stack needs one engine: not "
                         f"with --replicas)", name)
    for name, value in body.items():
        if name in _FIELDS[kind]:
            continue
        if name in _NEUTRAL:
            ok, allowed = _NEUTRAL[name]
            if not ok(value):
                raise BadRequest(f"'{name}' is not supported by this server (only {allowed})", name)
            continue
        raise BadRequest(f"unsupported field '{name}' for {'/v1/chat/completions' if kind == 'chat' else '/v1/completions'}"
                         f" (supported: {', '.join(sorted(_FIELDS[kind] - {'user'}))})", name)
    n = body.get("n")
    if n is not None and (_int(n, "n") != 1):
        raise BadRequest("only n=1 is supported (one completion per request)", "n")
    stack = choose_stack(body.get("stack"), body.get("gammas")) if choose_stack is not None else None
    if kind == "chat":
        prompt = chat_prompt(body.get("messages"), tokenizer)
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        prompt = completion_prompt(body.get("prompt"), tokenizer)
        max_name = "max_tokens"
    room = max_context - len(prompt)
    if room < 1:
        raise BadRequest(f"this model's maximum context is {max_context} tokens and the prompt has {len(prompt)}: "
                         f"shorten it", "messages" if kind == "chat" else "prompt", "context_length_exceeded")
    max_tokens = body.get(max_name)
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    else:
        max_tokens = _int(max_tokens, max_name)
        if max_tokens < 1:
            raise BadRequest(f"'{max_name}' must be >= 1, got {max_tokens}", max_name)
        if max_tokens > room:
            raise BadRequest(f"this model's maximum context is {max_context} tokens: the prompt has {len(prompt)} and "
                             f"'{max_name}' is {max_tokens}; lower '{max_name}' to at most {room}", max_name,
                             "context_length_exceeded")
    temperature = _number(body.get("temperature"), "temperature", default=1.0)  # the API's default
    top_p = _number(body.get("top_p"), "top_p", default=1.0)
    top_k = body.get("top_k")
    top_k = 0 if top_k is None else _int(top_k, "top_k")
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    try:
        params = SamplingParams(temperature, top_p, top_k)
    except TriforceError as e:  # "--top-p must be in (0, 1], got 2.0": name the field as the API does
        flag = str(e).split()[0]
        field = flag.removeprefix("--").replace("-", "_")
        raise BadRequest(str(e).replace(flag, f"'{field}'", 1), field) from None
    seed = body.get("seed")
    if seed is not None:
        seed = _int(seed, "seed")
        if not 0 <= seed < 2 ** 63:
            raise BadRequest(f"'seed' must be in [0, 2^63), got {seed}", "seed")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("'stream_options' is only allowed with \"stream\": true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise BadRequest("'stream_options' supports only include_usage", "stream_options")
        include_usage = bool(options.get("include_usage"))
    return GenerationRequest(kind, prompt, max_tokens, params, seed, _stop(body.get("stop")), bool(stream), include_usage,
                             stack)


def completion_prompt(prompt, tokenizer) -> list[int]:
    """prompt: a string, a list of token ids, or a one-element list of either (batch size 1)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", "prompt")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)  # (once: a fast tokenizer counts its vocabulary at each len: an 8K prompt 3 ms more)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise BadRequest(f"'prompt' holds token ids outside the vocabulary [0, {vocab})", "prompt")
        return list(prompt)
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("one prompt per request (batch size 1): send the prompts as separate requests", "prompt")
    raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")


_ROLES = ("system", "developer", "user", "assistant")


def chat_prompt(messages, tokenizer) -> list[int]:
    """The model's chat template over `messages`, with the generation prompt, tokenized as
    `triforce generate --chat` does."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role of {', '.join(_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise BadRequest(f"messages[{i}]: unsupported field(s) {', '.join(sorted(extra))}", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template: use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template's own check (jinja raise_exception), e.g. role order
        raise BadRequest(f"the model's chat template refused these messages: {e}", "messages") from None
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise BadRequest(f"'{name}' must be an integer, got {v!r}", name)
    return int(v)


def _number(v, name: str, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise BadRequest(f"'{name}' must be a number, got {v!r}", name)
    return float(v)


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    return tuple(s for s in stop if s)


# ---- responses ---------------------------------------------------------------------------------

class ResponseShape:
    """The ids and shapes of one request's response objects (non-streamed, or its chunks)."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish: str, usage: dict, extra: dict) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": None}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage, "triforce": extra}

    def chunk(self, text: str | None = None, finish: str | None = None, *, role: bool = False,
              extra: dict | None = None, usage: dict | None = None) -> dict:
        """A streamed chunk: text, or the final one (finish reason, the triforce field), or with
        usage only (no choices: stream_options.include_usage)."""
        if self.kind == "chat":
            head = self._head("chat.completion.chunk")
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        else:
            head = self._head("text_completion")
            choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
        out = {**head, "choices": [] if usage is not None else choices}
        if usage is not None:
            out["usage"] = usage
        if extra is not None:
            out["triforce"] = extra
        return out
