"""OpenAI response and stream-chunk bodies, built from what a replica streams back.

A replica yields `TurnDelta`s and one `TurnResult` (sessionserve/wire.py); `Reply` turns them
into `chat.completion` / `text_completion` objects or SSE chunks.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from sessionserve.api.protocol import now
from sessionserve.wire import LogprobEntry, ToolCallDelta, TurnDelta, TurnResult, new_id

Kind = Literal["chat", "completion"]


def usage(*finals: TurnResult) -> dict[str, Any]:
    """OpenAI's usage object, of one answer or of a request's choices (`n`: the prompt once,
    the completions summed). With speculative decoding, the drafts the model kept and threw
    away are reported in OpenAI's predicted-output fields (the closest existing meaning)."""
    first = finals[0]
    completion = sum(f.completion_tokens for f in finals)
    body = {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }
    drafted = sum(f.spec_drafted for f in finals)
    if drafted:
        accepted = sum(f.spec_accepted for f in finals)
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return body


def session_info(final: TurnResult) -> dict[str, Any]:
    """Our non-standard `session` object: where the cached tokens came from and who answered
    (on a whole answer, and on the last chunk of a stream)."""
    return {
        "cached_source": final.cached_source,
        "replica": final.replica,
        "ingress": final.ingress,
    }


def _chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    def one(tok: str, lp: float) -> dict[str, Any]:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

    return {
        "content": [
            {**one(t, lp), "top_logprobs": [one(a, b) for a, b in top]} for t, lp, top in entries
        ]
    }


def _completion_logprobs(entries: list[LogprobEntry], offset: int) -> dict[str, Any]:
    offsets, pos = [], offset
    for t, _, _ in entries:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


def _call_delta(c: ToolCallDelta) -> dict[str, Any]:
    """A `delta.tool_calls` element: the first of a call has its id, type and name."""
    out: dict[str, Any] = {"index": c.index}
    if c.id is not None:
        out |= {"id": c.id, "type": "function"}
    out["function"] = {"arguments": c.arguments} | ({"name": c.name} if c.name else {})
    return out


class Reply:
    def __init__(self, kind: Kind, model: str, want_logprobs: bool) -> None:
        self.kind, self.model, self.want_logprobs = kind, model, want_logprobs
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = now()
        self.text_len = 0
        self.index = 0  # the choice this reply's chunks are of

    def choice(self, index: int) -> Reply:
        """The chunks of choice `index` of the same answer (`n` > 1: same id and time)."""
        other = Reply(self.kind, self.model, self.want_logprobs)
        other.id, other.created, other.index = self.id, self.created, index
        return other

    def _logprobs(self, entries: list[LogprobEntry], offset: int) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return (
            _chat_logprobs(entries)
            if self.kind == "chat"
            else _completion_logprobs(entries, offset)
        )

    # ---- whole response ----
    def response(
        self, text: str, logprobs: list[LogprobEntry], final: TurnResult
    ) -> dict[str, Any]:
        return self.choices_response([(text, logprobs, final)])

    def choices_response(
        self, answers: list[tuple[str, list[LogprobEntry], TurnResult]]
    ) -> dict[str, Any]:
        """The whole response of one answer or of several choices (`n`), in choice order."""
        finals = [final for _, _, final in answers]
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(i, *answer) for i, answer in enumerate(answers)],
            "usage": usage(*finals),
            "session": session_info(finals[0]),
        }

    def _choice(
        self, index: int, text: str, logprobs: list[LogprobEntry], final: TurnResult
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": final.finish_reason,
            "logprobs": self._logprobs(logprobs, 0),
        }
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if final.tool_calls:  # as OpenAI: no content (null) beside calls unless it has some
                message["content"] = text or None
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in final.tool_calls
                ]
            choice["message"] = message
        else:
            choice["text"] = text
        return choice

    # ---- stream ----
    def _chunk(
        self,
        delta_text: str | None,
        finish: str | None,
        logprobs: dict[str, Any] | None,
        session: dict[str, Any] | None = None,
        role: bool = False,
        calls: list[ToolCallDelta] | None = None,
    ) -> str:
        choice: dict[str, Any] = {
            "index": self.index,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta_text is not None and (delta_text or not calls):
                delta["content"] = delta_text
            if calls:
                delta["tool_calls"] = [_call_delta(c) for c in calls]
            choice["delta"] = delta
        else:
            choice["text"] = delta_text or ""
        return self._stream_object([choice], **({"session": session} if session else {}))

    def _stream_object(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._sse(
            {
                "id": self.id,
                "object": kind,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        )

    def opening(self) -> str | None:
        return self._chunk("", None, None, role=True) if self.kind == "chat" else None

    def delta(self, piece: TurnDelta) -> str | None:
        if not piece.text and not piece.logprobs and not piece.tool_calls:
            return None
        logprobs = self._logprobs(piece.logprobs, self.text_len)
        out = self._chunk(piece.text, None, logprobs, calls=piece.tool_calls)
        self.text_len += len(piece.text)
        return out

    def finish_chunk(self, final: TurnResult) -> str:
        """A choice's finish chunk alone (`n` > 1: the last chunk comes after all of them)."""
        return self._chunk(None if self.kind == "chat" else "", final.finish_reason, None)

    def last_chunk(self, finals: list[TurnResult], include_usage: bool) -> str:
        """After the choices' finish chunks: their usage (when asked for) and the `session`
        object (choice 0's), in a chunk with no choices."""
        extra = {"usage": usage(*finals)} if include_usage else {}
        return self._stream_object([], **extra, session=session_info(finals[0]))

    def closing(self, final: TurnResult, include_usage: bool) -> list[str]:
        """The finish chunk, the usage chunk when asked for, then [DONE]. The last chunk
        before [DONE] carries the `session` object, as a non-streamed answer does."""
        if include_usage:
            out = [self.finish_chunk(final), self.last_chunk([final], include_usage)]
        else:
            text = None if self.kind == "chat" else ""
            out = [self._chunk(text, final.finish_reason, None, session_info(final))]
        return [*out, "data: [DONE]\n\n"]

    @staticmethod
    def _sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj)}\n\n"
