"""Property tests (Hypothesis) of the stack grammar (speculation/stack.py).

- Every valid stack, generated from the grammar (kinds, budgets, gammas, trees), prints as the text of
  `--levels ... --gammas ... --tree ...`, and that text parses back to the same spec.
- Any text given as --levels, --gammas and --tree either parses into a stack that passes the grammar's
  check (and then round-trips too) or raises TriforceError: never another exception.

The profile is fixed (conftest.py: derandomized, a bounded number of examples), so CI is deterministic.
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triforce.errors import TriforceError
from triforce.speculation.stack import (BUDGETED, DRAFT_ONLY, KIND_NAMES, MAX_LEVELS, MAX_TREE_NODES, LevelSpec,
                                        StackSpec)

MIDDLE = [k for k in KIND_NAMES if k not in DRAFT_ONLY and k != "full"]  # kinds that may verify and draft
MODELS_AT_BOTTOM = MIDDLE  # a tree needs a model at the bottom


def split_text(text: str) -> tuple[str, str | None, str | None]:
    """str(StackSpec) -> the values of --levels, --gammas and --tree, as the CLI would take them."""
    head, _, tree = text.partition(" --tree ")
    levels, _, gammas = head.partition(" --gammas ")
    return levels, gammas or None, tree or None


def parse_text(text: str) -> StackSpec:
    levels, gammas, tree = split_text(text)
    return StackSpec.parse(levels, gammas, tree=tree)


@st.composite
def level(draw, kinds) -> str:
    kind = draw(st.sampled_from(kinds))
    if kind in BUDGETED and draw(st.booleans()):
        return f"{kind}:{draw(st.integers(1, 1 << 20))}"
    return kind


@st.composite
def tree_widths(draw) -> tuple[int, ...]:
    widths: list[int] = []
    nodes, width = 0, 1
    for _ in range(draw(st.integers(1, 4))):
        w = draw(st.integers(1, 4))
        if nodes + width * w > MAX_TREE_NODES:
            break
        width *= w
        nodes += width
        widths.append(w)
    return tuple(widths) or (1,)


@st.composite
def valid_stack(draw) -> tuple[str, str | None, str | None]:
    """(--levels, --gammas, --tree) of a valid stack, from the grammar."""
    n = draw(st.integers(1, MAX_LEVELS))
    bottom_kinds = MIDDLE + list(DRAFT_ONLY)
    levels = [draw(level(bottom_kinds))] if n > 1 else []
    levels += [draw(level(MIDDLE)) for _ in range(n - 2)] + ["full"]
    boundaries = n - 1
    gammas = None
    if boundaries and draw(st.booleans()):
        count = draw(st.sampled_from([1, boundaries]))
        gammas = ",".join(str(draw(st.integers(1, 16))) for _ in range(count))
    tree = None
    if n > 1 and levels[0].split(":")[0] in MODELS_AT_BOTTOM and draw(st.booleans()):
        tree = ",".join(map(str, draw(tree_widths())))
    return ",".join(levels), gammas, tree


@given(valid_stack())
def test_valid_stacks_print_and_parse_back(args):
    levels, gammas, tree = args
    spec = StackSpec.parse(levels, gammas, tree=tree)
    assert len(spec.levels) == len(levels.split(",")) and spec.levels[-1] == LevelSpec("full")
    assert len(spec.gammas) == len(spec.levels) - 1
    text = str(spec)
    again = parse_text(text)
    assert again == spec, (text, again)
    assert str(again) == text


# text built from the grammar's own pieces, shuffled and broken, and plain random text
PIECES = st.sampled_from(list(KIND_NAMES) + [",", ":", " ", "", "-", "0", "1", "4", "99999999999999999999", "x", "full",
                                         "ngram", "1.5", "+2", "\u0663", "_", "\x00", "tree", "--gammas"])
FRAGMENT = st.one_of(st.lists(PIECES, max_size=12).map("".join), st.text(max_size=30))
NUMBERS = st.one_of(st.none(), st.lists(st.one_of(st.integers(-3, 70).map(str), PIECES), max_size=8).map(",".join),
                    st.text(max_size=12))


def checked(levels, gammas, tree):
    """StackSpec.parse, where the only allowed failure is a TriforceError."""
    try:
        return StackSpec.parse(levels, gammas, tree=tree)
    except TriforceError as e:
        assert str(e), "an empty message"
        return None


@given(FRAGMENT, NUMBERS, NUMBERS)
def test_any_text_parses_or_raises_triforce_error(levels, gammas, tree):
    spec = checked(levels, gammas, tree)
    if spec is not None:  # it was valid after all: it passes the grammar and round-trips
        spec.check()
        assert parse_text(str(spec)) == spec


@given(st.lists(st.sampled_from(KIND_NAMES), min_size=0, max_size=7), NUMBERS, NUMBERS)
def test_any_sequence_of_kinds_parses_or_raises_triforce_error(kinds, gammas, tree):
    spec = checked(",".join(kinds), gammas, tree)
    if spec is not None:
        assert kinds[-1] == "full" and kinds.count("full") == 1 and 1 <= len(kinds) <= MAX_LEVELS
        assert not any(k in DRAFT_ONLY for k in kinds[1:])
        assert parse_text(str(spec)) == spec


@pytest.mark.parametrize("levels,gammas,tree", [
    ("full", None, "1"), ("ngram,full", None, "2"), ("streaming,full", None, "8,8"), ("streaming,full", "0", None),
    ("streaming:0,full", None, None), ("kv4:3,full", None, None), ("full,full", None, None), ("", None, None),
    ("streaming,full", "1,2", None), ("streaming,full", None, "1,,2"), ("retrieval:1e3,full", None, None),
])
def test_examples_of_invalid_stacks(levels, gammas, tree):
    with pytest.raises(TriforceError):
        StackSpec.parse(levels, gammas, tree=tree)
