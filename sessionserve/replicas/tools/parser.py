"""An answer's text, as it streams, split into its content and its tool calls.

The grammar (formats.py) has a call written in its model's syntax with a fixed JSON layout
(`<tool_call>\n{"name":"f","arguments":{...}}\n</tool_call>`, or Llama 3's whole answer
`{"name":"f","parameters":{...}}`), so a call streams as OpenAI streams one: its id and name as
soon as the name is complete, then its arguments text piece by piece (the pieces add up to the
final arguments exactly). Text that may still turn out to be the start of a call is held back,
as a possible stop string is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from sessionserve.replicas.tools.formats import HERMES, SEPARATOR, CallSyntax
from sessionserve.wire import ToolCall, ToolCallDelta


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

    def __init__(self, syntax: CallSyntax = HERMES) -> None:
        self.syntax = syntax
        self.name = re.compile(rf'\{{"name":("(?:[^"\\]|\\.)*"),"{syntax.args_key}":')
        self.next = SEPARATOR + syntax.open  # what starts a call after a call
        self.pending = ""  # text not yet given out
        self.calls: list[_Call] = []
        self.in_call = False
        self.after_call = False  # a call just closed: a newline may begin the next
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.pending += text
        if not self.syntax.open:
            return self._feed_whole_answer()
        content, deltas = "", []
        opener, close = self.syntax.open, self.syntax.close
        while True:
            if self.in_call:
                end = self.pending.find(close)
                call = self.calls[-1]
                call.body = self.pending if end < 0 else self.pending[:end]
                deltas += self._progress(call, "closed" if end >= 0 else "open")
                if end < 0:
                    break
                self.pending, self.in_call = self.pending[end + len(close) :], False
                self.after_call = True
                continue
            start = self.pending.find(opener)
            if start >= 0:
                before = self.pending[:start]
                if not (self.after_call and before == SEPARATOR):  # the calls' separator
                    content += before
                self.pending = self.pending[start + len(opener) :]
                self.calls.append(_Call(len(self.calls), new_call_id()))
                self.in_call, self.after_call = True, False
                continue
            if self.after_call and self.next.startswith(self.pending):
                break  # maybe the next call: wait
            keep = _partial_suffix(self.pending, opener)
            content += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep :]
            self.after_call = self.after_call and not content
            break
        self.content += content
        return content, deltas

    def _feed_whole_answer(self) -> tuple[str, list[ToolCallDelta]]:
        """A syntax whose call is the whole answer: an answer that starts with `{` is a call
        (the grammar keeps text answers from starting so), anything else is content."""
        if not self.calls and not self.content:
            if not self.pending:
                return "", []
            if self.pending.startswith("{"):
                self.calls.append(_Call(0, new_call_id()))
                self.in_call = True
        if self.in_call:
            call = self.calls[-1]
            call.body = self.pending
            return "", self._progress(call, "open")
        content, self.pending = self.pending, ""
        self.content += content
        return content, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the answer: the content held back and the last call deltas (a call
        cut short by max_tokens gives the arguments it has)."""
        content, deltas = "", []
        if self.in_call:
            call = self.calls[-1]
            deltas = self._progress(call, "cut" if self.syntax.close else _ended(call.body))
        elif not (self.after_call and self.next.startswith(self.pending)):
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

    def _progress(self, call: _Call, state: str) -> list[ToolCallDelta]:
        """The deltas of `call` since the last ones. `state`: "open" (more may come),
        "closed" (its body is complete) or "cut" (the answer ended inside it)."""
        out = []
        if call.name is None:
            match = self.name.match(call.body)
            if match is None:
                return self._whole(call) if state == "closed" else out
            call.name, call.args_start = json.loads(match.group(1)), match.end()
            out.append(ToolCallDelta(call.index, "", id=call.id, name=call.name))
        if state == "closed":  # the body ends with the call object's own `}`
            end = len(call.body) - 1
        elif state == "open":  # hold back what may be that `}` and the closing tag's start
            end = len(call.body) - _partial_suffix(call.body, self.syntax.close) - 1
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

    def _whole(self, call: _Call) -> list[ToolCallDelta]:
        try:
            obj = json.loads(call.body)
            name, args = obj["name"], json.dumps(obj.get(self.syntax.args_key, {}))
        except (ValueError, KeyError, TypeError):
            return []  # not a call: nothing to report (its text stays out of the content)
        call.name, call.body, call.args_start, call.sent = name, args, 0, len(args)
        return [ToolCallDelta(call.index, args, id=call.id, name=name)]


def _ended(body: str) -> str:
    """ "closed" if `body` is a whole JSON value (the answer ended with its call), else "cut"."""
    try:
        json.loads(body)
    except ValueError:
        return "cut"
    return "closed"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
