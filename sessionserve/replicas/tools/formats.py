"""How a model is told about tools, how it writes a call, and the grammar that holds it to it.

Two call syntaxes (`CallSyntax`), each a model family's own:

- Hermes's (Qwen 2.5 and 3, Hermes 2/3 and many fine-tunes are trained on it), several calls
  in one answer as blocks separated by a newline:

      <tool_call>
      {"name":"get_weather","arguments":{"city":"Paris"}}
      </tool_call>

- Llama 3.1/3.2's JSON tool calling: the answer is one call, `{"name":"get_weather",
  "parameters":{"city":"Paris"}}` (a text answer never starts with `{`).

Two ways to put tools in the prompt:

- native: a chat template that renders tools and calls itself in one of these syntaxes (its
  source uses `tools` and `<tool_call>`, or Llama 3's `Environment: ipython` and
  `"parameters"`) gets them through `apply_chat_template(tools=...)`, the calls of earlier
  answers as `tool_calls` with their arguments parsed, tool results as `tool` messages.
- generic: any other template (the default SmolLM2-135M-Instruct's has no tool support) gets
  the tool list and the Hermes syntax in the system message, earlier calls written in the syntax in
  the assistant's text (byte for byte what the model wrote, so a session's KV of that answer
  is reused), and tool results as a user message of `<tool_response>` blocks. llama.cpp's
  generic tool-call handling is the precedent: a model is never sent a prompt silently
  missing its tools.

Either way the answer is constrained by a grammar (`tool_grammar`, llguidance's Lark dialect):
with `tool_choice` "required" or a named function it is one or more calls and nothing else;
with "auto" it is free text (or the JSON answer a `response_format` asks for), and once the
model writes `<tool_call>` the call must follow, with a name of the tools and arguments valid
for that tool's schema. A call therefore always parses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sessionserve.errors import InvalidRequestError
from sessionserve.replicas.grammar import closed_objects
from sessionserve.wire import ToolCall, ToolSpec, ToolUse

SEPARATOR = "\n"  # between two calls of one answer
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
# the grammar's JSON has a fixed layout (no free whitespace), as for response_format
FIXED_LAYOUT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class CallSyntax:
    """How a model family writes a call."""

    open: str  # what starts a call ("": the answer itself is the call)
    close: str  # what ends it
    args_key: str  # the arguments' key in the call object
    parallel: bool  # several calls in one answer


HERMES = CallSyntax("<tool_call>\n", "\n</tool_call>", "arguments", parallel=True)
LLAMA3_JSON = CallSyntax("", "", "parameters", parallel=False)
OPEN, CLOSE = HERMES.open, HERMES.close


def native_syntax(tokenizer: Any) -> CallSyntax | None:
    """The call syntax the tokenizer's chat template renders tools in (None: it has no tool
    support we know, so the generic format is used)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "Environment: ipython" in template and '"parameters"' in template:
        return LLAMA3_JSON
    return None


def call_syntax(tokenizer: Any) -> CallSyntax:
    """The syntax this tokenizer's model writes calls in (the generic format's is Hermes's)."""
    return native_syntax(tokenizer) or HERMES


def call_text(call: ToolCall, syntax: CallSyntax = HERMES) -> str:
    """A call as the grammar has the model write it (arguments verbatim)."""
    return f'{{"name":{json.dumps(call.name)},"{syntax.args_key}":{call.arguments}}}'


def calls_text(calls: list[ToolCall]) -> str:
    return SEPARATOR.join(OPEN + call_text(c) + CLOSE for c in calls)


def _function(tool: ToolSpec) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.name}
    if tool.description:
        fn["description"] = tool.description
    fn["parameters"] = tool.parameters
    return {"type": "function", "function": fn}


# ---- the prompt ----
def render_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tool_use: ToolUse | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra `apply_chat_template` arguments for a conversation with tools
    (in the request, or calls and results in its history)."""
    tools = list(tool_use.tools) if tool_use else []
    if native_syntax(tokenizer) is not None:
        extra = {"tools": [_function(t) for t in tools]} if tools else {}
        return [_native(m) for m in messages], extra
    return _generic(messages, tool_use), {}


def _native(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {
        **message,
        "tool_calls": [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _parsed(c.arguments)},
            }
            for c in calls
        ],
    }


def _parsed(arguments: str) -> Any:
    """Arguments as templates take them (a dict); text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _generic(messages: list[dict[str, Any]], tool_use: ToolUse | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the results
    if tool_use and tool_use.tools:
        instructions = generic_instructions(tool_use)
        if messages and messages[0]["role"] in ("system", "developer"):
            first, messages = messages[0], messages[1:]
            instructions = f"{first['content'] or ''}\n\n{instructions}"
        out.append({"role": "system", "content": instructions})
    results = False  # the last message is a user message of tool results
    for m in messages:
        if m["role"] == "tool":
            block = json.dumps(
                {"name": names.get(m.get("tool_call_id", ""), ""), "content": m["content"]}
            )
            text = RESPONSE_OPEN + block + RESPONSE_CLOSE
            if results:  # one user message for a run of results
                out[-1]["content"] += SEPARATOR + text
            else:
                out.append({"role": "user", "content": text})
            results = True
            continue
        calls = m.get("tool_calls") or []
        names.update((c.id, c.name) for c in calls)
        content = (m.get("content") or "") + (calls_text(calls) if calls else "")
        out.append({"role": m["role"], "content": content})
        results = False
    return out


def generic_instructions(tool_use: ToolUse) -> str:
    """The system message's part that tells a model without tool support about the tools.
    It depends on the tools alone, not on `tool_choice` (the grammar enforces that): an agent
    that changes its tool choice between steps keeps its prompt's prefix, and its KV."""
    listing = "\n".join(json.dumps(_function(t)) for t in tool_use.tools)
    return (
        "You can call these functions:\n"
        f"{listing}\n"
        "To call one, write exactly:\n"
        f'{OPEN}{{"name":"<function name>","arguments":<its arguments as a JSON object>}}{CLOSE}\n'
        f"A result comes back in a {RESPONSE_OPEN.strip()} block. Call a function when it "
        "helps; otherwise answer in text."
    )


# ---- the grammar ----
def tool_grammar(
    tool_use: ToolUse | None, answer_schema: str | None, syntax: CallSyntax = HERMES
) -> str | None:
    """The Lark grammar an answer with `tool_use` must follow (None: no constraint from the
    tools, only `answer_schema`'s if any). `answer_schema`: the JSON schema text a text
    answer must satisfy (response_format), for "auto"."""
    if tool_use is None or not tool_use.tools or tool_use.choice == "none":
        return None
    tools = [t for t in tool_use.tools if tool_use.function in (None, t.name)]
    schema = {"anyOf": [_call_schema(t, syntax) for t in tools], "x-guidance": FIXED_LAYOUT}
    auto = tool_use.choice == "auto" and tool_use.function is None
    if not syntax.open:  # the answer is one call, or text that does not start with `{`
        if auto and answer_schema:
            raise InvalidRequestError(
                "response_format: with tool_choice auto this model's calls (a JSON object as "
                "the whole answer) cannot be told from a JSON answer; choose none or required",
                "response_format",
            )
        start = ["start: TEXT | call" if auto else "start: call", "TEXT: /([^{](.|\\n)*)?/"]
        call = f"call: %json {json.dumps(schema)}"
        return "\n".join(["%llguidance {}", *start, call])
    open_, close = json.dumps(syntax.open), json.dumps(syntax.close)
    parallel = tool_use.parallel and syntax.parallel
    calls = f"call ({json.dumps(SEPARATOR + syntax.open)} call)*" if parallel else "call"
    if auto:
        answer = f"%json {_fixed(answer_schema)}" if answer_schema else "TEXT"
        start = [f"start: {answer} | head {calls}", f"head[lazy]: TEXT {open_}"]
    else:
        start = [f"start: {open_} {calls}"]
    return "\n".join(
        [
            "%llguidance {}",
            *start,
            f"call: %json {json.dumps(schema)} {close}",
            "TEXT: /(.|\\n)*/",
        ]
    )


def _call_schema(tool: ToolSpec, syntax: CallSyntax) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            syntax.args_key: closed_objects(tool.parameters) if tool.parameters else ANY_OBJECT,
        },
        "required": ["name", syntax.args_key],
        "additionalProperties": False,
    }


ANY_OBJECT = {"type": "object"}


def _fixed(schema_text: str) -> str:
    schema = closed_objects(json.loads(schema_text))
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": FIXED_LAYOUT}
    return json.dumps(schema)
