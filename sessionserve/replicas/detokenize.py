"""Incremental detokenization: a growing answer's text in O(new tokens) per step.

Decoding the whole answer again on every token costs O(n) per token, O(n^2) per answer. Here
each step decodes only a short window: the tokens since the last emitted boundary, with a few
tokens before it as context (tokenizers such as SentencePiece decode a token differently at
the start of a string), and emits the text past what that context already produced. A token
that ends inside a multi-byte character decodes to U+FFFD; the text waits for the bytes that
complete it, so no delta ever carries half a character.
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # tokens before the new ones, decoded as context


class IncrementalText:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start: context tokens already emitted
        self._read = 0  # tokens whose text is emitted
        self.decoded_tokens = 0  # tokens passed to decode (what the O(new) claim is about)

    def extend(self, new_ids: list[int]) -> str:
        """Append tokens; returns the text they complete (may be "" while a character is
        split across tokens)."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.text += delta
        self._prefix = max(self._read, len(self.ids) - CONTEXT_TOKENS)
        self._read = len(self.ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        self.decoded_tokens += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
