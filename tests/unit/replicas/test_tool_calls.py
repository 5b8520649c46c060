"""Tool calls on a replica (replicas/tools/): the prompt tells the model of its tools, the
grammar holds every call to a tool's name and schema, and the parser splits the answer into
content and calls as it streams. The model here has random weights over a byte-level
vocabulary, sampled hot, so only the grammar keeps its calls in line."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionserve.errors import InvalidRequestError
from sessionserve.replicas.server import ReplicaServer
from sessionserve.replicas.tools.formats import (
    CLOSE,
    HERMES,
    LLAMA3_JSON,
    OPEN,
    CallSyntax,
    call_text,
    native_syntax,
    render_messages,
    tool_grammar,
)
from sessionserve.replicas.tools.parser import ToolCallParser
from sessionserve.wire import GenerateCall, SamplingParams, ToolCall, ToolSpec, ToolUse, TurnResult
from tests.models import BYTE_EOS, byte_tokenizer, tiny_model
from tests.unit.replicas.test_structured_output import SCHEMAS

ADD = ToolSpec(
    "add",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "Add two integers.",
)
ECHO = ToolSpec(
    "echo",
    {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 5}},
        "required": ["s"],
        "additionalProperties": False,
    },
)
# a template that renders tools and calls itself, in the Hermes syntax (Qwen's, in small)
HERMES_TEMPLATE = (
    "{%- if tools %}<system>Tools:{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{% endfor %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)

# Llama 3.1/3.2's JSON tool calling, in small: the answer is the call
LLAMA3_TEMPLATE = (
    "{%- if tools %}<system>Environment: ipython\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>{%- if m.tool_calls %}{% for c in m.tool_calls %}"
    '{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# ---- the parser ----
def stream(parser: ToolCallParser, text: str, cuts: list[int]):
    """Feed `text` cut at `cuts`; the content, the deltas, and the calls at the end."""
    content, deltas, last = "", [], 0
    for cut in [*sorted(cuts), len(text)]:
        piece, ds = parser.feed(text[last:cut])
        content, deltas, last = content + piece, deltas + ds, cut
    rest, ds = parser.finish()
    return content + rest, deltas + ds, parser.made


ARGS = st.dictionaries(
    st.text(min_size=1, max_size=4),
    st.one_of(st.integers(), st.text(max_size=6), st.booleans(), st.none()),
    max_size=3,
).map(lambda d: json.dumps(d, separators=(",", ":")))


@settings(max_examples=200, deadline=None)
@given(
    content=st.text(max_size=20),
    args=st.lists(ARGS, min_size=0, max_size=3),
    data=st.data(),
    syntax=st.sampled_from([HERMES, LLAMA3_JSON]),
)
def test_streamed_pieces_add_up_to_the_content_and_the_calls(content, args, data, syntax) -> None:
    """Whatever the chunking, the content deltas add up to the text before the calls and the
    argument deltas of each call to its arguments; a call's first delta has its id and name.
    (Llama 3's answer is one call or text that does not start with `{`, as its grammar has it.)"""
    calls = [ToolCall(f"c{i}", f"f{i}", a) for i, a in enumerate(args)]
    if syntax is LLAMA3_JSON:
        calls, content = calls[:1], "" if calls else content.lstrip("{")
        text = content + "".join(call_text(c, syntax) for c in calls)
    else:
        text = content + "\n".join(OPEN + call_text(c) + CLOSE for c in calls)
        if not calls and OPEN in text:
            return
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    parser = ToolCallParser(syntax)
    got, deltas, made = stream(parser, text, cuts)
    assert got == parser.content == content
    assert [(c.name, c.arguments) for c in made] == [(c.name, c.arguments) for c in calls]
    for i, call in enumerate(made):
        mine = [d for d in deltas if d.index == i]
        assert mine[0].id == call.id and mine[0].name == call.name
        assert all(d.id is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments
    assert len({c.id for c in made}) == len(made)


def test_text_that_only_looks_like_a_call_stays_text() -> None:
    parser = ToolCallParser()
    assert stream(parser, "a <tool_c", [])[0] == "a <tool_c"
    parser = ToolCallParser()
    assert stream(parser, "use <tool_caller>\nnow", [3, 9])[0] == "use <tool_caller>\nnow"


def test_a_call_cut_short_keeps_its_name_and_the_arguments_it_has() -> None:
    parser = ToolCallParser()
    content, deltas, calls = stream(parser, 'ok<tool_call>\n{"name":"f","arguments":{"a":1', [5])
    assert content == "ok"
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a":1')]
    assert "".join(d.arguments for d in deltas) == '{"a":1'


# ---- the prompt ----
def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_verbatim() -> None:
    tok = byte_tokenizer()
    assert native_syntax(tok) is None
    call = ToolCall("call_1", "add", '{"a":1,"b":2}')
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
        {"role": "tool", "content": "x", "tool_call_id": "call_9"},
    ]
    out, extra = render_messages(tok, messages, ToolUse((ADD,), "auto"))
    assert extra == {}
    for choice, function in (("required", None), ("required", "add"), ("none", None)):
        # the prompt does not depend on the tool choice: a step that changes it keeps its KV
        assert render_messages(tok, messages, ToolUse((ADD,), choice, function))[0] == out
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == OPEN + '{"name":"add","arguments":{"a":1,"b":2}}' + CLOSE
    assert out[3]["content"].count("<tool_response>") == 2 and '"name": "add"' in out[3]["content"]


def natively_rendered(template: str) -> tuple[CallSyntax | None, str]:
    """A step of an agent's history (a question, its call, the result) through `template`:
    the syntax it is recognized as, and the prompt text."""
    tok = byte_tokenizer()
    tok.chat_template = template
    call = ToolCall("call_1", "add", '{"a":1,"b":2}')
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    out, extra = render_messages(tok, messages, ToolUse((ADD,), "auto"))
    text = tok.apply_chat_template(out, tokenize=False, add_generation_prompt=True, **extra)
    return native_syntax(tok), text


def test_a_template_with_tools_renders_them_itself() -> None:
    syntax, text = natively_rendered(HERMES_TEMPLATE)
    assert syntax is HERMES
    assert '"name": "add"' in text and "Add two integers." in text  # the tools
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert text.endswith("<tool>3<assistant>")


def test_a_llama3_template_renders_tools_and_its_json_calls_itself() -> None:
    syntax, text = natively_rendered(LLAMA3_TEMPLATE)
    assert syntax is LLAMA3_JSON
    assert "Environment: ipython" in text and "Add two integers." in text
    assert '{"name": "add", "parameters": {"a": 1, "b": 2}}' in text
    # with auto, a JSON answer could not be told from a call: refused, naming the field
    with pytest.raises(InvalidRequestError) as err:
        tool_grammar(ToolUse((ADD,), "auto"), json.dumps({"type": "object"}), LLAMA3_JSON)
    assert err.value.param == "response_format"


def test_a_grammar_only_where_calls_are_possible() -> None:
    assert tool_grammar(None, None) is None
    assert tool_grammar(ToolUse((ADD,), "none"), None) is None
    named = tool_grammar(ToolUse((ADD, ECHO), "required", "echo", parallel=False), None)
    assert '"echo"' in named and '"add"' not in named and "head" not in named
    auto = tool_grammar(ToolUse((ADD,), "auto"), json.dumps({"type": "object"}))
    assert auto.startswith("%llguidance") and "start: %json" in auto


# ---- the replica ----
VOCAB = 320


def byte_replica(directory, template: str | None = None) -> ReplicaServer:
    """The random byte-level model saved in `directory` (with `template` as its chat
    template, else the byte tokenizer's own), served by a replica shim without Ray."""
    tiny_model(vocab_size=VOCAB, seed=2, eos_token_id=BYTE_EOS).save_pretrained(directory)
    tok = byte_tokenizer()
    tok.chat_template = template or tok.chat_template
    tok.save_pretrained(directory)
    return ReplicaServer(
        {
            "model": {"path": str(directory)},
            "memory_check": "every_step",
            "cache": {"page_size": 4, "num_slots": 8192, "max_rows": 16, "max_context_len": 4096},
        }
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = byte_replica(tmp_path_factory.mktemp("bytes"))
    yield srv
    srv.shutdown()


def turn(server, tool_use, seed, messages=None, session=None, max_tokens=160):
    call = GenerateCall(
        {"max_tokens": max_tokens, "temperature": 1.5, "seed": seed},
        session_id=session,
        mode="chat",
        messages=messages or [{"role": "user", "content": "Call a tool."}],
        tool_use=tool_use,
    )

    async def collect():
        return [p async for p in server.generate(call)]

    pieces = asyncio.run(collect())
    final = pieces[-1]
    assert isinstance(final, TurnResult)
    assert "".join(p.text for p in pieces[:-1]) == final.text  # content deltas add up
    for i, c in enumerate(final.tool_calls):
        assert "".join(d.arguments for p in pieces[:-1] for d in p.tool_calls if d.index == i) == (
            c.arguments
        )
    return final


def check_calls(final: TurnResult, tools: tuple[ToolSpec, ...]) -> None:
    schemas = {t.name: t.parameters for t in tools}
    for call in final.tool_calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


TOOL_SETS = st.lists(SCHEMAS, min_size=1, max_size=3).map(
    lambda schemas: tuple(ToolSpec(f"tool_{i}", s) for i, s in enumerate(schemas))
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(tools=TOOL_SETS, seed=st.integers(0, 2**31), parallel=st.booleans())
def test_required_calls_always_name_a_tool_and_validate(server, tools, seed, parallel) -> None:
    final = turn(server, ToolUse(tools, "required", parallel=parallel), seed)
    assert final.text == "" and final.tool_calls
    if parallel and final.finish_reason == "length":  # a random model may call on and on
        final.tool_calls.pop()  # the call max_tokens cut
    else:
        assert final.finish_reason == "tool_calls", final
        assert len(final.tool_calls) == 1 or parallel
    check_calls(final, tools)
    server.engine.checker.check_idle()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31))
def test_a_named_function_is_the_one_called(server, seed) -> None:
    final = turn(server, ToolUse((ADD, ECHO), "required", "echo", parallel=False), seed)
    assert [c.name for c in final.tool_calls] == ["echo"]
    check_calls(final, (ECHO,))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31))
def test_auto_answers_in_text_or_in_valid_calls(server, seed) -> None:
    final = turn(server, ToolUse((ADD, ECHO), "auto"), seed, max_tokens=40)
    assert OPEN not in final.text
    if final.finish_reason == "tool_calls":
        check_calls(final, (ADD, ECHO))
    server.engine.checker.check_idle()


def test_an_agent_loop_in_a_session_prefills_only_the_tool_result(server) -> None:
    """Each step's history is the last step's tokens, the call written back verbatim: the
    session reuses all of it and prefills only the tool result."""
    tools = ToolUse((ADD, ECHO), "required", parallel=False)
    messages = [{"role": "user", "content": "Add 1 and 2."}]
    first = turn(server, tools, 7, messages, session="agent-1")
    for step in range(3):
        (call,) = first.tool_calls
        messages += [
            {"role": "assistant", "content": first.text, "tool_calls": [call]},
            {"role": "tool", "content": f"result {step}", "tool_call_id": call.id},
        ]
        nxt = turn(server, tools, step, messages, session="agent-1")
        assert nxt.cached_source == "session"
        assert nxt.cached_tokens >= first.log_len - 1  # the whole last step
        assert nxt.prompt_tokens - nxt.cached_tokens < 100  # the result block (~90 bytes)
        check_calls(nxt, tools.tools)
        first = nxt
    server.engine.close_session("agent-1")
    server.engine.checker.check_idle()


def test_parameters_the_grammar_engine_refuses_are_a_400_naming_tools(server) -> None:
    bad = ToolSpec("bad", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(InvalidRequestError) as err:
        turn(server, ToolUse((bad,), "required"), 0)
    assert err.value.param == "tools"
    server.engine.checker.check_idle()


def test_with_a_drafter_a_tool_call_is_not_speculated_and_still_validates() -> None:
    from tests.models import random_drafter, tiny_engine

    target = tiny_model(vocab_size=VOCAB, seed=2, eos_token_id=BYTE_EOS, num_hidden_layers=1)
    engine = tiny_engine(target, tokenizer=byte_tokenizer(), drafter=random_drafter, num_drafts=3)
    grammar = tool_grammar(ToolUse((ADD, ECHO), "required", parallel=False), None)
    prompt = byte_tokenizer()("Call a tool:", add_special_tokens=False).input_ids
    sampling = SamplingParams(max_tokens=120, temperature=1.5, seed=3, lark_grammar=grammar)
    for r in engine.generate([prompt, prompt], sampling):
        assert r.spec_drafted == 0
        _, _, (call,) = stream(ToolCallParser(), r.text, [])
        jsonschema.validate(
            json.loads(call.arguments), {"add": ADD, "echo": ECHO}[call.name].parameters
        )
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert engine.generate([prompt], free)[0].spec_drafted > 0  # the drafter runs for others
    engine.checker.check_idle()


@pytest.fixture(scope="module")
def llama3_server(tmp_path_factory):
    """The same random model with a Llama 3 style template: its calls are whole answers."""
    srv = byte_replica(tmp_path_factory.mktemp("llama3"), LLAMA3_TEMPLATE)
    assert srv.tool_syntax is LLAMA3_JSON
    yield srv
    srv.shutdown()


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(tools=TOOL_SETS, seed=st.integers(0, 2**31))
def test_llama3_calls_are_whole_answers_that_validate(llama3_server, tools, seed) -> None:
    final = turn(llama3_server, ToolUse(tools, "required"), seed)
    assert final.finish_reason == "tool_calls" and final.text == ""
    assert len(final.tool_calls) == 1  # its syntax has one call an answer
    check_calls(final, tools)
    llama3_server.engine.checker.check_idle()


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31))
def test_llama3_auto_answers_text_or_a_call(llama3_server, seed) -> None:
    final = turn(llama3_server, ToolUse((ADD, ECHO), "auto"), seed, max_tokens=40)
    if final.tool_calls:
        assert final.text == "" and final.finish_reason in ("tool_calls", "length")
        if final.finish_reason == "tool_calls":
            check_calls(final, (ADD, ECHO))
    else:
        assert not final.text.startswith("{")
    llama3_server.engine.checker.check_idle()
