"""What a turn streams back over the wire, made from the engine's step events: text deltas
(held back where they might still become a stop string, so what is sent is always a prefix of
the final answer), tool calls apart from the content, logprob entries, and one final
`TurnResult`. The replica shim (`ReplicaServer.generate`) feeds it each event of its turn."""

from __future__ import annotations

from typing import Any

from sessionserve.errors import RequestFailedError
from sessionserve.replicas.detokenize import IncrementalText
from sessionserve.replicas.outputs import StepEvent
from sessionserve.replicas.request import RequestResult, TokenLogprob
from sessionserve.replicas.tools.parser import ToolCallParser
from sessionserve.wire import FinishReason, LogprobEntry, SamplingParams, TurnDelta, TurnResult


def merged(pieces: list[TurnDelta | TurnResult]) -> list[TurnDelta | TurnResult]:
    """Consecutive deltas as one (their tokens, text, logprobs and calls in order): what a
    stream sends when several engine steps' output goes in one message."""
    out: list[TurnDelta | TurnResult] = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, TurnDelta) and isinstance(last, TurnDelta):
            out[-1] = TurnDelta(
                last.token_ids + piece.token_ids,
                last.text + piece.text,
                last.logprobs + piece.logprobs,
                last.tool_calls + piece.tool_calls,
            )
        else:
            out.append(piece)
    return out


class TurnOutput:
    def __init__(
        self, tokenizer: Any, sampling: SamplingParams, tools: ToolCallParser | None, replica: str
    ) -> None:
        """`tools`: the parser of this model's call syntax when the turn may call tools."""
        self.tokenizer = tokenizer
        self.hold = max((len(s) - 1 for s in sampling.stop), default=0)
        self.tools = tools
        self.replica = replica
        self.answer = IncrementalText(tokenizer)  # O(new tokens) per event
        self.sent = ""
        self.done = False

    def feed(self, event: StepEvent) -> list[TurnDelta | TurnResult]:
        """What this event adds to the stream (nothing, a delta, and with the last event the
        final record). A request that failed alone raises `RequestFailedError`."""
        result = event.result
        self.done = result is not None
        if result is not None and result.finish_reason is FinishReason.ERROR:
            raise RequestFailedError(result.finish_message or "request failed")
        if event.text is None:  # else the engine decoded it already (stop strings)
            self.answer.extend(event.new_token_ids)
        if result is not None:
            text = result.text or ""
        else:
            so_far = self.answer.text if event.text is None else event.text
            text = so_far[: max(0, len(so_far) - self.hold)]
        piece, calls = text[len(self.sent) :], []
        self.sent = text
        if self.tools is not None:  # the calls apart from the content
            piece, calls = self.tools.feed(piece)
            if result is not None:
                rest, last = self.tools.finish()
                piece, calls = piece + rest, calls + last
        out: list[TurnDelta | TurnResult] = []
        if event.new_token_ids or piece or calls:
            logprobs = self._logprob_entries(event.new_logprobs)
            out.append(TurnDelta(event.new_token_ids, piece, logprobs, calls))
        if result is not None:
            out.append(self._result(result))
        return out

    def _logprob_entries(self, lps: list[TokenLogprob]) -> list[LogprobEntry]:
        tok = self.tokenizer
        return [
            (tok.decode([lp.token_id]), lp.logprob, [(tok.decode([t]), v) for t, v in lp.top])
            for lp in lps
        ]

    def _result(self, r: RequestResult) -> TurnResult:
        """The turn's final record; with tools, its content and calls apart (an answer that
        ended with calls finishes as "tool_calls", as OpenAI's do)."""
        result = TurnResult(
            finish_reason=r.finish_reason.value,
            finish_message=r.finish_message,
            text=r.text,
            output_ids=r.output_ids,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            cached_tokens=r.cached_tokens,
            cached_source=r.cached_source,
            log_base=r.log_base,  # the session's token log after this turn: cut there, then
            log_tail=r.input_ids[r.log_base :] + r.output_ids,  # this
            spec_drafted=r.spec_drafted,
            spec_accepted=r.spec_accepted,
            ttft_s=r.ttft_s,
            replica=self.replica,
        )
        if self.tools is not None:
            result.text, result.tool_calls = self.tools.content, self.tools.made
            if result.tool_calls and result.finish_reason == FinishReason.STOP:
                result.finish_reason = "tool_calls"
        return result
