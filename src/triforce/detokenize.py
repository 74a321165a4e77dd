"""Text deltas of a growing token sequence, for streaming output.

A character may be split across tokens (byte-level BPE): decoding a prefix then shows U+FFFD at
its end. The delta is held back until the character is complete, so the concatenated deltas equal
the decoding of the whole sequence.
"""
from __future__ import annotations


class TextDeltas:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self.printed = 0  # characters of the decoded text already returned

    def push(self, tokens: list[int]) -> str:
        """Add tokens; -> the new complete text (possibly "")."""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip)
        end = len(text)
        while end > self.printed and text[end - 1] == "\ufffd":
            end -= 1  # an incomplete character: wait for the token that completes it
        delta = text[self.printed:end]
        self.printed = end
        return delta

    def finish(self) -> str:
        """The rest of the text (an incomplete character at the very end included)."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip)
        delta = text[self.printed:]
        self.printed = len(text)
        return delta
