"""A chat turn's input, spelled with the tokens its session already holds.

A chat-mode turn brings the whole conversation as text, tokenized afresh. The model's own
earlier answers are in it, but the model did not always write them in the tokenizer's own
(canonical) spelling: a grammar-constrained answer in particular is often written in smaller
pieces (`{"` as `{` then `"`), so the fresh tokens differ from the session's from that answer
on, and the turn would re-prefill everything after the difference. Where the session's tokens
and the fresh ones spell the same text, the turn keeps the session's (what the model saw and
wrote, as an append-mode turn does) and only the text after them is new.
"""

from __future__ import annotations

from collections.abc import Callable

CONTEXT_TOKENS = 4  # decoded before the difference (SentencePiece spells a piece by context)
MAX_TAIL_TOKENS = 4096  # bounded work: a longer difference is a different conversation


def continue_history(
    history: list[int], fresh: list[int], decode: Callable[[list[int]], str]
) -> list[int]:
    """`fresh` with its start replaced by `history` when both spell the same text there
    (else `fresh` unchanged). `decode` must keep special tokens and spaces as they are."""
    same = _common_prefix(history, fresh)
    if same == len(history) or len(history) - same > MAX_TAIL_TOKENS:
        return fresh
    start = max(0, same - CONTEXT_TOKENS)
    target = decode(history[start:])
    for end in range(same + 1, min(len(fresh), same + 2 * MAX_TAIL_TOKENS) + 1):
        text = decode(fresh[start:end])
        if text == target:
            return history + fresh[end:]
        if not target.startswith(text.rstrip("\ufffd")):  # a half character may still complete
            return fresh
    return fresh


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
