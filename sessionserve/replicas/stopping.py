"""When a request's answer is complete: EOS, stop tokens, stop strings, max_tokens, context,
or a constrained answer's grammar (its JSON complete).

Sets `finish_reason` and `finished_len` (output tokens that belong to the answer). A stop
string's text is cut from the answer, but the token that completed it stays in the token
history (and so in a session's KV): the model did see it.
"""

from __future__ import annotations

from typing import Any

from sessionserve.replicas.detokenize import IncrementalText
from sessionserve.replicas.request import Request
from sessionserve.wire import FinishReason


class StopChecker:
    def __init__(self, tokenizer: Any | None, max_context_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len

    def check(self, req: Request) -> bool:
        """Call after each appended token or accepted run; True once finished. With several
        new tokens (a verified run), the earliest end among them wins, so a stop string
        completed before an EOS in the same run ends the answer where a one-token-at-a-time
        decode would have."""
        p, out = req.sampling, req.output_ids
        start, req.stop_checked = req.stop_checked, len(out)
        end: tuple[FinishReason, int] | None = None
        for i in range(start, len(out)):
            t = out[i]
            if (t in req.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids:
                end = (FinishReason.STOP, i + 1)
            elif i + 1 >= p.max_tokens or len(req.input_ids) + i + 1 >= self.max_context_len:
                end = (FinishReason.LENGTH, i + 1)
            if end is not None:
                break
        if p.stop and self.tokenizer is not None:
            text = req.stop_text = req.stop_text or IncrementalText(self.tokenizer)
            seen = len(text.text)
            if text.extend(out[len(text.ids) :]):  # only the new text (and what a stop
                # string could span into it) is searched: O(new tokens) per step
                tail = text.text[max(0, seen - max(len(s) for s in p.stop) + 1) :]
                if any(s in tail for s in p.stop):
                    at = self._stop_string_end(req)
                    if end is None or at <= end[1]:
                        end = (FinishReason.STOP, at)
        if end is None and req.grammar is not None and req.grammar.is_stopped():
            end = (FinishReason.STOP, len(out))  # the JSON is complete
        return end is not None and self._finish(req, *end)

    def _stop_string_end(self, req: Request) -> int:
        """Fewest output tokens whose text contains a stop string (a bisection: a longer
        prefix's text contains a shorter one's)."""
        lo, hi = 1, len(req.output_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            text = self.tokenizer.decode(req.output_ids[:mid], skip_special_tokens=True)
            if any(s in text for s in req.sampling.stop):
                hi = mid
            else:
                lo = mid + 1
        return hi

    @staticmethod
    def _finish(req: Request, reason: FinishReason, finished_len: int) -> bool:
        req.finish_reason = reason
        req.finished_len = finished_len
        return True


def answer_text(tokenizer: Any | None, req: Request) -> str | None:
    """The answer's text: special tokens skipped, cut before the first stop string."""
    if tokenizer is None:
        return None
    text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
    cut = min((text.find(s) for s in req.sampling.stop if s in text), default=-1)
    return text[:cut] if cut >= 0 else text
