"""A speculation stack as data: levels bottom to top, and the tokens each drafts for the one above.

    ngram,streaming:528,retrieval:1024,full   gammas 3,3,4

- `full` is the target with its full KV cache: it verifies, so the output is exactly the target's;
  it is last, exactly once. `full` alone is autoregressive decoding.
- `ngram` is prompt lookup: it can only draft, so it is the bottom level, if present.
- `head` is a trained draft head (drafthead/, EAGLE's design) reading the features the levels above
  computed: it can only draft, at the bottom (`--head DIR`, default the head shipped for the embedded model).
- `streaming[:BUDGET]` (the target with a StreamingLLM cache of BUDGET = sink + window tokens),
  `retrieval[:BUDGET]` (the target with a retrieval cache keeping BUDGET tokens per layer and KV
  head), `kv4` (the target reading its KV cache at 4 bits, QuantSpec's draft: caches/quantized.py) and
  `draft` (a small model sharing the tokenizer, `--draft PATH`, full cache) draft at the bottom, or verify
  the level below and draft for the one above.
- gammas[i] is how many tokens level i drafts per verification by level i + 1; one value serves
  every boundary.
- `tree` (`--tree W0,W1,...`): the bottom level, a model, drafts a token tree for the level above
  instead of a chain (Sequoia): W0 children of the context's last token, W_d children of every node
  at depth d - 1 (children sampled without replacement; at temperature 0 the top-W).

The named methods are aliases of stacks (`METHOD_STACKS`). Budgets and paddings are computed here,
once, with named constants.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import TriforceError


@dataclass(frozen=True)
class KindGrammar:
    """What the grammar knows of a level kind: the one declaration of each kind's properties (kinds.py
    holds the classes that build them, keyed by these names; both registries are checked equal there)."""

    name: str
    usage: str  # how the grammar message names it
    draft_only: bool = False  # cannot verify (no model of its own over the sequence): the bottom level only
    budgeted: bool = False  # takes :BUDGET (tokens its cache keeps)
    rebuilt: bool = False  # built from the full cache, rebuilt by the rebuild policy
    drafts_trees: bool = True  # can draft a --tree (a model at the bottom)


KIND_GRAMMAR: dict[str, KindGrammar] = {g.name: g for g in (
    KindGrammar("ngram", "ngram (bottom only)", draft_only=True, drafts_trees=False),
    KindGrammar("head", "head (bottom only: a trained draft head, --head DIR)", draft_only=True),
    KindGrammar("streaming", "streaming[:BUDGET]", budgeted=True),
    KindGrammar("retrieval", "retrieval[:BUDGET]", budgeted=True, rebuilt=True),
    KindGrammar("h2o", "h2o[:BUDGET]", budgeted=True, rebuilt=True),
    KindGrammar("kv4", "kv4"),
    KindGrammar("draft", "draft (needs --draft PATH)"),
    KindGrammar("full", "full (last, exactly once)", drafts_trees=False),
)}
KIND_NAMES = tuple(KIND_GRAMMAR)
DRAFT_ONLY = tuple(k for k, g in KIND_GRAMMAR.items() if g.draft_only)
BUDGETED = tuple(k for k, g in KIND_GRAMMAR.items() if g.budgeted)
REBUILT = tuple(k for k, g in KIND_GRAMMAR.items() if g.rebuilt)
TREE_DRAFTERS = tuple(k for k, g in KIND_GRAMMAR.items() if g.drafts_trees)
MIN_LEVELS, MAX_LEVELS = 1, 5
GRAMMAR = (f"valid stacks: KIND[:BUDGET],...,full, bottom to top, {MIN_LEVELS} to {MAX_LEVELS} levels; kinds "
           f"{', '.join(g.usage for g in KIND_GRAMMAR.values() if g.name != 'full')}, and "
           f"{KIND_GRAMMAR['full'].usage}; --gammas N or one value per boundary; e.g. --levels "
           "ngram,retrieval:4096,full --gammas 3,4 or --levels ngram,kv4,full")

# A round feeds a cache at most gamma_top tokens past the committed sequence, plus the token fed
# with the first draft and the bonus token: every cache keeps this much room beyond its content.
ROUND_SLACK = 2
# Extra room of the capacity-bounded caches (retrieval, streaming) past a round's lookahead: rollback
# may reach back over a whole round of every level below the top.
ROLLBACK_SLACK = 8
MAX_TREE_NODES = 64  # a tree round feeds this many tokens at most (a verification of as many rows)


@dataclass(frozen=True)
class LevelSpec:
    kind: str
    budget: int | None = None  # tokens kept (streaming: sink + window; retrieval, h2o: per layer and KV head)

    def __str__(self) -> str:
        return self.kind if self.budget is None else f"{self.kind}:{self.budget}"

    @classmethod
    def parse(cls, text: str) -> LevelSpec:
        kind, _, budget = text.strip().partition(":")
        if kind not in KIND_NAMES:
            raise TriforceError(f"unknown level kind {kind!r} in --levels; {GRAMMAR}")
        if not budget:
            return cls(kind)
        if kind not in BUDGETED:
            raise TriforceError(f"level {kind!r} takes no budget (got {text!r}); {GRAMMAR}")
        try:
            value = int(budget)
        except ValueError:
            raise TriforceError(f"the budget in {text!r} is not an integer; {GRAMMAR}") from None
        if value < 1:
            raise TriforceError(f"the budget in {text!r} must be >= 1; {GRAMMAR}")
        return cls(kind, value)


@dataclass(frozen=True)
class StackSpec:
    """levels bottom to top (the last is `full`); gammas[i]: tokens level i drafts for level i + 1."""

    levels: tuple[LevelSpec, ...]
    gammas: tuple[int, ...]
    tree: tuple[int, ...] = ()  # widths per depth of the bottom level's draft tree (empty: chains)
    # adaptive: the levels and gammas are where a run starts; its planner (planner.py) then chooses, round by
    # round, which of the levels run and with which gammas, from the costs and acceptances it measures
    adaptive: bool = False

    def __str__(self) -> str:
        text = ",".join(map(str, self.levels))
        text += f" --gammas {','.join(map(str, self.gammas))}" if self.gammas else ""
        text += f" --tree {','.join(map(str, self.tree))}" if self.tree else ""
        return text + (" (adaptive: levels and gammas re-planned as it runs; --no-adapt to fix them)"
                       if self.adaptive else "")

    @property
    def tree_nodes(self) -> int:
        """Tokens in the bottom level's draft tree (0: chains)."""
        total, width = 0, 1
        for w in self.tree:
            width *= w
            total += width
        return total

    @property
    def levels_text(self) -> str:
        return ",".join(map(str, self.levels))

    @classmethod
    def parse(cls, levels: str, gammas: str | int | tuple[int, ...] | list[int] | None = None,
              default_gamma: int = 4, tree: str | tuple[int, ...] | None = None) -> StackSpec:
        """Parse `--levels` and `--gammas` (see the module docstring); TriforceError on bad input."""
        parts = [p for p in levels.split(",")]
        if any(not p.strip() for p in parts):
            raise TriforceError(f"empty level in --levels {levels!r}; {GRAMMAR}")
        specs = tuple(LevelSpec.parse(p) for p in parts)
        n = len(specs) - 1
        if gammas is None:
            values = (default_gamma,) * n
        else:
            if isinstance(gammas, str):
                try:
                    values = tuple(int(g) for g in gammas.split(","))
                except ValueError:
                    raise TriforceError(f"--gammas {gammas!r} must be integers separated by commas; {GRAMMAR}") from None
            else:
                values = (gammas,) if isinstance(gammas, int) else tuple(gammas)
            if len(values) == 1:
                values = values * n
        widths = ()
        if tree:
            try:
                widths = tuple(int(w) for w in tree.split(",")) if isinstance(tree, str) else tuple(tree)
            except ValueError:
                raise TriforceError(f"--tree {tree!r} must be integers separated by commas (children per node at "
                                    f"each depth, e.g. --tree 3,2,1)") from None
        stack = cls(specs, tuple(values), widths)
        stack.check()
        return stack

    def check(self) -> None:
        """The grammar (see GRAMMAR): raises TriforceError naming the first problem."""
        kinds = [lvl.kind for lvl in self.levels]
        if not MIN_LEVELS <= len(kinds) <= MAX_LEVELS:
            raise TriforceError(f"a stack has 1 to {MAX_LEVELS} levels, got {len(kinds)}; {GRAMMAR}")
        if kinds.count("full") != 1 or kinds[-1] != "full":
            what = "has no 'full' level" if "full" not in kinds else (
                "has 'full' more than once" if kinds.count("full") > 1 else "does not end with 'full'")
            raise TriforceError(f"the stack {self.levels_text} {what}: the target with its full cache must be "
                                f"the last level, exactly once; {GRAMMAR}")
        for i, kind in enumerate(kinds[1:], start=1):
            if kind in DRAFT_ONLY:
                raise TriforceError(f"'{kind}' can only be the bottom level (it drafts, it cannot verify), "
                                    f"found at position {i + 1} in {self.levels_text}; {GRAMMAR}")
        if len(self.gammas) != len(kinds) - 1 and not (len(kinds) == 1 and len(self.gammas) <= 1):
            raise TriforceError(f"--gammas has {len(self.gammas)} values for {len(kinds) - 1} boundaries of "
                                f"{self.levels_text}: give one value, or one per boundary; {GRAMMAR}")
        if any(g < 1 for g in self.gammas):
            raise TriforceError(f"--gammas must be >= 1, got {','.join(map(str, self.gammas))}")
        if self.tree:
            if any(w < 1 for w in self.tree):
                raise TriforceError(f"--tree widths must be >= 1, got {','.join(map(str, self.tree))}")
            if len(kinds) < 2 or kinds[0] not in TREE_DRAFTERS:
                raise TriforceError(f"--tree needs a model at the bottom of the stack to draft the tree "
                                    f"({', '.join(TREE_DRAFTERS)}), not {self.levels_text}; e.g. --levels "
                                    f"streaming,full --tree 3,2")
            if self.tree_nodes > MAX_TREE_NODES:
                raise TriforceError(f"--tree {','.join(map(str, self.tree))} has {self.tree_nodes} nodes: at most "
                                    f"{MAX_TREE_NODES} (every node is a row of the verification)")

    def check_budgets(self, max_context: int, default_budgets: dict[str, int], min_streaming: int) -> None:
        """Budgets (a level's own, else default_budgets[kind]) against the model's context and the
        StreamingLLM sink plus a minimal window."""
        for lvl in self.levels:
            if lvl.kind not in BUDGETED:
                continue
            budget = lvl.budget or default_budgets[lvl.kind]
            what = (f"the budget of {lvl}" if lvl.budget else
                    f"the {lvl.kind} level's budget (--budget {budget})" if lvl.kind in REBUILT else
                    f"the {lvl.kind} level's budget (--sink + --window = {budget})")
            if budget > max_context:
                raise TriforceError(f"{what} is larger than the model's context of {max_context} tokens: lower it "
                                    f"(a drafting cache must be smaller than the context to help)")
            if lvl.kind == "streaming" and budget < min_streaming:
                raise TriforceError(f"{what} is smaller than the StreamingLLM sink plus a minimal window "
                                    f"({min_streaming} tokens): raise it or lower --sink")

    @property
    def top_gamma(self) -> int:
        return self.gammas[-1] if self.gammas else 0

    def lookahead(self) -> int:
        """Tokens past the committed sequence a cache may hold within one round (a tree: all its nodes)."""
        return max(self.top_gamma, self.tree_nodes) + ROUND_SLACK

    def without(self, index: int) -> StackSpec:
        """The stack without level `index` (not the top); the level below it drafts for the one above
        with the removed level's gamma (the one nearer the top)."""
        levels = self.levels[:index] + self.levels[index + 1:]
        gammas = self.gammas[:max(index - 1, 0)] + self.gammas[index:] if index else self.gammas[1:]
        return replace(self, levels=levels, gammas=gammas, tree=self.tree if index else ())


METHODS = ("ar", "triforce", "retrieval", "streaming", "ngram", "draft", "quantspec", "sequoia")
# sequoia's tree (widths per depth): 10 nodes, depth 3; not yet chosen by `triforce tune` (docs/trees.md)
SEQUOIA_TREE = (2, 2, 1)


def method_stack(method: str, gamma: int = 4, gamma_draft: int = 3, bottom: str = "ngram",
                 budget: int | None = None, adaptive: bool = False) -> StackSpec:
    """The stack of a named method (see METHOD_DOC); `bottom` is triforce's bottom drafter (ngram,
    streaming or draft), `budget` an explicit retrieval budget (default: SpecConfig.budget); `adaptive`: the
    triforce stack re-planned as it runs (StackSpec.adaptive; the other methods are fixed stacks)."""
    r = f"retrieval:{budget}" if budget else "retrieval"
    stacks = {
        "ar": ("full", ()),
        "ngram": ("ngram,full", (gamma,)),
        "streaming": ("streaming,full", (gamma,)),
        "draft": ("draft,full", (gamma,)),
        "retrieval": (f"{r},full", (gamma,)),
        "quantspec": ("kv4,full", (gamma,)),
        "triforce": (f"{bottom},{r},full", (gamma_draft, gamma)),
        "sequoia": ("streaming,full", (gamma,)),
    }
    if method not in stacks:
        raise TriforceError(f"unknown method {method!r}: choose one of {', '.join(stacks)}, or give --levels")
    levels, gammas = stacks[method]
    stack = StackSpec.parse(levels, gammas or None, gamma, SEQUOIA_TREE if method == "sequoia" else None)
    return replace(stack, adaptive=True) if adaptive and method == "triforce" else stack


METHOD_DOC = {
    "ar": "full: the target with its full cache, autoregressive",
    "ngram": "ngram,full: prompt lookup",
    "streaming": "streaming,full: the target with a StreamingLLM cache (the paper's naive policy)",
    "draft": "draft,full: a small model (--draft PATH)",
    "retrieval": "retrieval,full: the target with a retrieval cache (TriForce without hierarchy)",
    "triforce": "DRAFTER,retrieval,full: TriForce (DRAFTER from --draft: ngram, head, streaming or a model)",
    "sequoia": "streaming,full --tree 2,2,1: token trees drafted by the target with a StreamingLLM cache",
    "quantspec": "kv4,full: QuantSpec, the target reading its KV cache at 4 bits (docs/quantized_kv.md)",
}
