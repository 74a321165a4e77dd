"""A head's acceptance against its target on held-out text: the bench's genres (corpus.GENRES), which training
never reads (data.py), at a short and a long context, greedy and sampled."""
from __future__ import annotations

from tqdm.auto import tqdm

from ..corpus import genre_tokens
from ..generate import generate
from ..model import Transformer
from ..sampling import SamplingParams
from ..speculation.settings import SpecConfig
from ..speculation.state import PrefilledPrompt

EVAL_GENRES = ("prose", "code", "dialogue")


def acceptance(model: Transformer, tokenizer, head_dir, *, contexts=(512, 4096), temperatures=(0.0, 0.6),
               genres=EVAL_GENRES, new_tokens: int = 96, gamma: int = 4, seed: int = 0, progress: bool = False
               ) -> list[dict]:
    """Per (genre, context, temperature): the head's acceptance per drafted token and by draft position, drafting
    `gamma` tokens per round for the full target (stack head,full)."""
    config = SpecConfig(head=str(head_dir), adapt=False, ngram_shortcut=0.0, gamma=gamma)  # the head's drafts alone
    rows = []
    cells = [(g, c, t) for g in genres for c in contexts for t in temperatures]
    prefilled = None
    for genre, context, temperature in tqdm(cells, desc="acceptance on held-out text", disable=not progress):
        prompt = genre_tokens(tokenizer, genre, context)
        if prefilled is None or prefilled.head != prompt[:-1]:  # one prefill per prompt, for every temperature
            prefilled = PrefilledPrompt(model, prompt, context + new_tokens + 2 * gamma + 16)
        res = generate(model, prompt, new_tokens, SamplingParams(temperature=temperature), stack="head,full",
                       config=config, seed=seed, prefilled=prefilled)
        full, head = res.stats["levels"][0], res.stats["levels"][-1]
        rows.append({"genre": genre, "context": context, "temperature": temperature,
                     "acceptance": full["acceptance_rate"], "by_position": full.get("acceptance_by_position"),
                     "tokens_per_round": full["tokens_per_round"],
                     "ms_per_drafted_token": round(1e3 * head["seconds"] / max(head["tokens"], 1), 3)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| genre | context | T | acceptance per drafted token | by position | tokens per round |",
             "|---|---:|---:|---:|---|---:|"]
    for r in rows:
        pos = ", ".join(f"{a:.2f}" for a in (r["by_position"] or []))
        lines.append(f"| {r['genre']} | {r['context']} | {r['temperature']} | {r['acceptance']} | {pos} | "
                     f"{r['tokens_per_round']} |")
    return "\n".join(lines)
