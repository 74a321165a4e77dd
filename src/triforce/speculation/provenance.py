"""Provenance: for each round of a stack's top level, which level drafted each token it commits, the draft tail the
top verifier cut, the verifier's own (bonus or residual) token, and what every verification in the round drafted
and accepted.

A token's level is the lowest level whose draft it came from: with `ngram,retrieval,full`, a token the n-gram
drafter proposed, the retrieval level accepted and the full model accepted is "ngram"; a token the retrieval level
drew itself (its bonus or residual token), then accepted by the full model, is "retrieval"; the full model's own
token ends every round that it does not cut short, and is "full". Each `Level` keeps the levels of the tokens it
returned last (`origins`), built from its drafter's, so the top's are the round's.

Cheap by construction: every id here is one the acceptance rule has already brought to the host (verify_tree's one
`.tolist()` per verification), so recording it is list work on a few ints per verification: no tensor is read and
no host synchronisation is added. The tokens are what the round would commit anyway; nothing here changes them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .tree import DraftTree


class RoundLog:
    """The verifications of the round in progress, appended to by every Level of one built stack (they share it):
    (the verifier's name, the drafted ids, how many of them it accepted), in the order they ran (a lower level's
    rounds before the verification of the level above that they drafted for). `take` hands them over after each
    round."""

    def __init__(self):
        self.verifications: list[tuple[str, tuple[int, ...], int]] = []

    def record(self, verifier: str, drafted: tuple[int, ...], accepted: int) -> None:
        self.verifications.append((verifier, drafted, accepted))

    def take(self) -> list[tuple[str, tuple[int, ...], int]]:
        out, self.verifications = self.verifications, []
        return out


def drafted_by(drafter, n: int) -> list[str]:
    """The level names of the first n tokens `drafter` returned last: a Level's record of its tokens (`origins`), or,
    for a drafter that is not a Level (n-gram lookup, a draft model drafting autoregressively, a draft head), its
    own name for every token."""
    origins = getattr(drafter, "origins", None)
    return origins[:n] if origins is not None else [drafter.name] * n


def cut_tail(tree: DraftTree, path: list[int]) -> list[int]:
    """The drafted tokens a verification rejected where it cut: a chain's tokens past the accepted prefix; for a tree,
    from the last accepted vertex down the first-ranked children (the drafter's likeliest continuation; the other
    branches were alternatives, not a cut tail)."""
    if tree.is_chain:
        return list(tree.tokens[len(path):])
    tail: list[int] = []
    kids = tree.children[path[-1] + 1 if path else 0]
    while kids:
        node = kids[0]
        tail.append(tree.tokens[node])
        kids = tree.children[node + 1]
    return tail


@dataclass
class RoundProvenance:
    """One round of the top level, as the generation committed it (a StreamChunk's `provenance`)."""

    tokens: list[int]  # the tokens the round committed (the chunk's, in order)
    levels: list[str]  # per token, the level that drafted it (the top level's own token: its name, e.g. "full")
    rejected: list[int]  # the top verifier's draft past what it accepted: the tail it cut (empty: none drafted or cut)
    bonus: int | None  # the top verifier's own token among `tokens` (its bonus or residual draw); None if cut off
    verifications: list[tuple[str, tuple[int, ...], int]]  # RoundLog's: every verification in the round
    route: str | None = None  # an adaptive stack's route for the round (routes.Route.text); None for a fixed stack
    texts: list[str] | None = None  # with a tokenizer: each token's text; together exactly the chunk's text

    def as_dict(self, decode=None) -> dict:
        """JSON-ready: the stream's `triforce` field of a chunk and `--json`'s `rounds`. `decode` (ids -> str, e.g.
        the tokenizer's) adds the rejected tail's text."""
        texts = self.texts
        out = {"tokens": [{"id": t, "level": lvl, **({"text": texts[i]} if texts is not None else {})}
                          for i, (t, lvl) in enumerate(zip(self.tokens, self.levels))],
               "rejected": self.rejected, "bonus": self.bonus,
               "drafts": [{"verifier": v, "drafted": list(d), "accepted": a} for v, d, a in self.verifications],
               "route": self.route}
        if decode is not None and self.rejected:
            out["rejected_text"] = decode(self.rejected)
        return out


def level_counts(rounds: list[dict]) -> dict[str, dict]:
    """Per verifying level, over rounds' `as_dict()`s: rounds (verifications), proposed and accepted drafts; the same
    counts as the stats' `levels` (a verification counts whatever the generation kept of its round)."""
    out: dict[str, dict] = {}
    for r in rounds:
        for d in r["drafts"]:
            c = out.setdefault(d["verifier"], {"rounds": 0, "proposed": 0, "accepted": 0})
            c["rounds"] += 1
            c["proposed"] += len(d["drafted"])
            c["accepted"] += d["accepted"]
    return out
