"""Training data for a draft head: text the target itself generates, with its features.

Prompts come from text the bench never reads (corpus.py's genres are held out): Python standard library
modules other than corpus.CODE_MODULES (their code, and their docstrings as prose), chat requests built from
a few instructions and topics, and random tokens. The target continues each at a temperature between 0.5
and 1.0; every token it reads or writes keeps its feature (the final norm's output), which is all a head
trains on (the target's next-token distribution is its LM head over that feature).

Shards are made in batches of equal-length prompts and written atomically, each from its own seed, so an
interrupted run resumes at the first missing shard and makes the same data.
"""
from __future__ import annotations

import ast
import os
import random
import sysconfig
from pathlib import Path

import torch

from ..caches import new_cache
from ..corpus import CODE_MODULES
from ..model import Transformer

TEMPERATURES = (0.5, 0.7, 1.0)
PROMPT_KINDS = ("chat", "code", "chat", "docs", "chat", "random")  # each shard's prompts are of one kind, in turn
PROMPT_TOKENS = 48  # code and docs prompts; chat prompts are as long as their request
RANDOM_PROMPT_TOKENS = 16

INSTRUCTIONS = (
    "Write a short story about {}.", "Explain {} to a beginner.", "Write a Python function related to {}.",
    "Give me a list of facts about {}.", "Write a dialogue between two friends about {}.",
    "Summarize the history of {}.", "Write a poem about {}.", "What are the pros and cons of {}?",
    "Write a blog post about {}.", "Describe {} in detail.", "Write a letter to a colleague about {}.",
    "Write C code that has something to do with {}.", "Write an essay on {}.", "Answer questions about {}.",
)
TOPICS = (
    "the ocean", "machine learning", "a lost cat", "the Roman empire", "coffee", "climbing a mountain",
    "sorting algorithms", "a city at night", "gardening", "the moon landing", "friendship", "databases",
    "a rainy day", "chess", "renewable energy", "a haunted house", "linear algebra", "cooking pasta",
    "the immune system", "a train journey", "volcanoes", "music theory", "a robot learning to paint",
    "the stock market", "birds", "operating systems", "a detective", "photosynthesis", "space travel",
    "medieval castles", "web servers", "a birthday party", "the French revolution", "rivers", "compilers",
    "a small village", "electric cars", "dreams", "the internet", "winter", "regular expressions", "tea",
)


def training_modules() -> list[Path]:
    """Standard library source files a head may train on: every top-level module but the bench's code genre."""
    root = Path(sysconfig.get_paths()["stdlib"])
    held_out = set(CODE_MODULES)
    return [p for p in sorted(root.glob("*.py")) if p.stem not in held_out and not p.stem.startswith("_")]


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 300:
                out.append(doc)
    return out


class PromptSource:
    """Prompts of each kind, drawn with a seeded random.Random (shard by shard)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        files = training_modules()
        self.code = [tokenizer(p.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"] for p in files]
        self.code = [c for c in self.code if len(c) > 4 * PROMPT_TOKENS]
        docs = [d for p in files for d in _docstrings(p)]
        self.docs = [t for t in (tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs)
                     if len(t) > PROMPT_TOKENS]
        self.chat_by_length: dict[int, list[list[int]]] = {}
        for instruction in INSTRUCTIONS:
            for topic in TOPICS:
                ids = self._chat(instruction.format(topic))
                self.chat_by_length.setdefault(len(ids), []).append(ids)
        self.vocab_size = len(tokenizer)

    def _chat(self, request: str) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                           tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(request + "\n", add_special_tokens=False)["input_ids"]

    def batch(self, kind: str, n: int, rng: random.Random) -> list[list[int]]:
        """n prompts of one kind and one length."""
        if kind == "chat":
            lengths = [k for k, v in self.chat_by_length.items() if len(v) >= 4]
            length = rng.choice(sorted(lengths))
            return [list(rng.choice(self.chat_by_length[length])) for _ in range(n)]
        if kind == "random":
            return [[rng.randrange(self.vocab_size) for _ in range(RANDOM_PROMPT_TOKENS)] for _ in range(n)]
        pool = self.code if kind == "code" else self.docs
        out = []
        for _ in range(n):
            ids = rng.choice(pool)
            start = rng.randrange(0, len(ids) - PROMPT_TOKENS)
            out.append(ids[start:start + PROMPT_TOKENS])
        return out


@torch.inference_mode()
def generate_shard(model: Transformer, prompts: list[list[int]], new_tokens: int, temperature: float,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The target continues a batch of equal-length prompts -> {"tokens": [B, S] int32, "features": [B, S,
    hidden] bf16}, S = prompt + new_tokens: the features of every token (the last one's included)."""
    B, P = len(prompts), len(prompts[0])
    saved = model.kv_dtype
    model.kv_dtype = "fp32"  # batched attention takes PyTorch's kernels, which run fp32 caches fastest
    try:
        cache = new_cache(model, P + new_tokens + 1, batch=B)
    finally:
        model.kv_dtype = saved
    ids = torch.tensor(prompts, device=model.device)
    logits, feats = model(ids, cache, last=1, hidden=True)
    tokens, features = [ids], [feats.to(torch.bfloat16)]
    for _ in range(new_tokens):
        probs = torch.softmax(logits[:, -1] / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        logits, feats = model(nxt, cache, last=1, hidden=True)
        tokens.append(nxt)
        features.append(feats.to(torch.bfloat16))
    return {"tokens": torch.cat(tokens, 1).to(torch.int32), "features": torch.cat(features, 1)}


def save_atomic(obj, path: Path) -> None:
    """torch.save to a temporary name, then renamed: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def shard_kind(index: int) -> str:
    return PROMPT_KINDS[index % len(PROMPT_KINDS)]


def shard_temperature(index: int) -> float:
    return TEMPERATURES[(index // len(PROMPT_KINDS)) % len(TEMPERATURES)]
