"""An answer's text, as it streams, split into its content and its tool calls.

The grammar (formats.py) has a call written as `<tool_call>\n{"name":"f","arguments":{...}}\n
</tool_call>` with a fixed JSON layout, so a call streams as OpenAI streams one: its id and
name as soon as the name is complete, then its arguments text piece by piece (the pieces add up
to the final arguments exactly). Text that may still turn out to be the start of a call is held
back, as a possible stop string is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from sessionserve.replicas.tools.formats import CLOSE, OPEN, SEPARATOR
from sessionserve.wire import ToolCall, ToolCallDelta

NAME = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')
NEXT = SEPARATOR + OPEN


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Call:
    index: int
    id: str
    body: str = ""  # the JSON text so far
    name: str | None = None
    args_start: int = 0  # where the arguments begin in `body` (once the name is known)
    sent: int = 0  # arguments characters streamed


class ToolCallParser:
    """Feed it the answer's text deltas; it returns content deltas and call deltas."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet given out
        self.calls: list[_Call] = []
        self.in_call = False
        self.after_call = False  # a call just closed: a newline may begin the next
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.pending += text
        content, deltas = "", []
        while True:
            if self.in_call:
                end = self.pending.find(CLOSE)
                call = self.calls[-1]
                call.body = self.pending if end < 0 else self.pending[:end]
                deltas += self._progress(call, "closed" if end >= 0 else "open")
                if end < 0:
                    break
                self.pending, self.in_call, self.after_call = (
                    self.pending[end + len(CLOSE) :],
                    False,
                    True,
                )
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                before = self.pending[:start]
                if not (self.after_call and before == SEPARATOR):  # the calls' separator
                    content += before
                self.pending = self.pending[start + len(OPEN) :]
                self.calls.append(_Call(len(self.calls), new_call_id()))
                self.in_call, self.after_call = True, False
                continue
            if self.after_call and NEXT.startswith(self.pending):
                break  # maybe the next call: wait
            keep = _partial_suffix(self.pending, OPEN)
            content += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep :]
            self.after_call = self.after_call and not content
            break
        self.content += content
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the answer: the content held back and the last call deltas (a call
        cut short by max_tokens gives the arguments it has)."""
        content, deltas = "", []
        if self.in_call:
            deltas = self._progress(self.calls[-1], "cut")
        elif not (self.after_call and NEXT.startswith(self.pending)):
            content = self.pending
            self.content += content
        self.pending, self.in_call = "", False  # a second finish() adds nothing
        return content, deltas

    @property
    def made(self) -> list[ToolCall]:
        """The calls so far, each with the arguments streamed for it."""
        return [
            ToolCall(c.id, c.name, c.body[c.args_start : c.args_start + c.sent])
            for c in self.calls
            if c.name is not None
        ]

    @staticmethod
    def _progress(call: _Call, state: str) -> list[ToolCallDelta]:
        """The deltas of `call` since the last ones. `state`: "open" (more may come),
        "closed" (its body is complete) or "cut" (the answer ended inside it)."""
        out = []
        if call.name is None:
            match = NAME.match(call.body)
            if match is None:
                return ToolCallParser._whole(call) if state == "closed" else out
            call.name, call.args_start = json.loads(match.group(1)), match.end()
            out.append(ToolCallDelta(call.index, "", id=call.id, name=call.name))
        if state == "closed":  # the body ends with the call object's own `}`
            end = len(call.body) - 1
        elif state == "open":  # hold back what may be that `}` and the closing tag's start
            end = len(call.body) - _partial_suffix(call.body, CLOSE) - 1
        else:
            end = len(call.body)
        piece = call.body[call.args_start + call.sent : max(end, call.args_start + call.sent)]
        if piece:
            call.sent += len(piece)
            if out:
                out[0] = ToolCallDelta(call.index, piece, id=call.id, name=call.name)
            else:
                out.append(ToolCallDelta(call.index, piece))
        return out

    @staticmethod
    def _whole(call: _Call) -> list[ToolCallDelta]:
        try:
            obj = json.loads(call.body)
            name, args = obj["name"], json.dumps(obj.get("arguments", {}))
        except (ValueError, KeyError, TypeError):
            return []  # not a call: nothing to report (its text stays out of the content)
        call.name, call.body, call.args_start, call.sent = name, args, 0, len(args)
        return [ToolCallDelta(call.index, args, id=call.id, name=name)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
