"""Constrained decoding (replicas/grammar.py): with a JSON schema, every answer that ends
parses and validates against it, whatever the model (here random weights over a byte-level
vocabulary, sampled hot, so that only the mask keeps them in line), batched beside
unconstrained requests, in a session, with a drafter on; a schema that cannot be served is a
400 before any KV is taken."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionserve.errors import InvalidRequestError
from sessionserve.wire import FinishReason, SamplingParams
from tests.models import BYTE_EOS, byte_tokenizer, random_drafter, tiny_engine, tiny_model

VOCAB = 320  # 256 bytes, EOS, and unused ids the mask must keep out too
TOKENIZER = byte_tokenizer()
PROMPT = TOKENIZER("Answer in JSON:", add_special_tokens=False).input_ids


def model(layers: int = 2):
    return tiny_model(vocab_size=VOCAB, seed=2, eos_token_id=BYTE_EOS, num_hidden_layers=layers)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(model(), tokenizer=TOKENIZER, page_size=4)


def constrained(schema: dict, seed: int, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=kw.pop("max_tokens", 120),
        temperature=1.5,
        seed=seed,
        json_schema=json.dumps(schema),
        **kw,
    )


# small schemas whose answers are short, so that random models finish them
LEAVES = st.sampled_from(
    [
        {"type": "boolean"},
        {"type": "null"},
        {"enum": ["red", "green", 3, None]},
        {"type": "integer", "minimum": -5, "maximum": 300},
        {"type": "string", "maxLength": 6},
        {"type": "string", "pattern": "^[a-c]{1,3}$"},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    ]
)
SCHEMAS = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=5), LEAVES, min_size=1, max_size=4
).map(
    lambda props: {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }
)


def test_objects_that_list_their_keys_are_closed_to_them(engine) -> None:
    """A schema that lists an object's properties and says nothing of others gets answers
    with those keys only (`closed_objects`, as xgrammar's strict mode in vLLM and SGLang):
    JSON Schema would allow any other key, and a hot random model takes that up until
    max_tokens cuts its JSON off. Saying what else an object takes keeps it open."""
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    seeds = range(6)
    answers = [engine.generate([PROMPT], constrained(person, seed))[0] for seed in seeds]
    for r in answers:
        assert r.finish_reason is FinishReason.STOP, (r.finish_reason, r.text)
        assert set(json.loads(r.text)) == {"name", "age"}
    # open on purpose: extra keys, each an integer, are the schema's to allow
    extra = {**person, "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}
    widened = [engine.generate([PROMPT], constrained(extra, s))[0] for s in range(12)]
    keys = [set(json.loads(r.text)) for r in widened if r.finish_reason is FinishReason.STOP]
    assert any(k > {"name", "age"} for k in keys), [r.text for r in widened]
    engine.checker.check_idle()


def test_closing_objects_leaves_what_the_schema_says_of_other_keys() -> None:
    """Closed at any depth and in anyOf branches; left as written where the schema speaks of
    other keys (additionalProperties, patternProperties, $ref) or where parts constrain the
    same object (allOf, if/then/else, not, dependentSchemas); a property named like a keyword
    is a property, not a keyword."""
    from sessionserve.replicas.grammar import closed_objects

    leaf = {"type": "string"}
    nested = {"type": "object", "properties": {"x": leaf}}
    schema = {
        "type": "object",
        "properties": {"properties": nested, "items": {"type": "array", "items": nested}},
        "$defs": {"d": nested},
        "anyOf": [nested, {"type": "object"}],
    }
    closed = closed_objects(schema)
    shut = {**nested, "additionalProperties": False}
    assert closed == {
        **schema,
        "properties": {"properties": shut, "items": {"type": "array", "items": shut}},
        "$defs": {"d": shut},
        "anyOf": [shut, {"type": "object"}],  # a free-form object stays free
        "additionalProperties": False,
    }
    for open_ in (
        {**nested, "additionalProperties": {"type": "integer"}},
        {**nested, "patternProperties": {"^y": leaf}},
        {**nested, "$ref": "#/$defs/d"},
        {"allOf": [nested, {"properties": {"y": leaf}}]},
        {**nested, "allOf": [{"properties": {"y": leaf}}]},
        {**nested, "if": nested, "then": {"properties": {"y": leaf}, "required": ["y"]}},
        {**nested, "dependentSchemas": {"x": {"properties": {"y": leaf}}}},
    ):
        assert closed_objects(open_) == open_
    # `not` says what the object is not: the object is closed, what it is not stays as written
    assert closed_objects({**nested, "not": nested}) == {**shut, "not": nested}
    assert "additionalProperties" not in nested  # the caller's schema is left as it was


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_every_finished_answer_validates(engine, schema, seed) -> None:
    free = SamplingParams(max_tokens=12, temperature=1.5, seed=seed)
    results = engine.generate([PROMPT, PROMPT, PROMPT], constrained(schema, seed)) + [
        engine.generate([PROMPT], free)[0]
    ]
    for r in results[:3]:
        assert r.finish_reason is FinishReason.STOP, (r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), schema)  # ended as the JSON did
    engine.checker.check_idle()


def test_constrained_and_free_requests_share_a_batch(engine) -> None:
    """The mask touches only its own row: a free request's tokens are the same with or
    without a constrained neighbour."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    free = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    alone = engine.generate([PROMPT], free)[0]
    rids = [engine.submit(PROMPT, constrained(schema, 5)), engine.submit(PROMPT, free)]
    engine.run_until_idle()
    with_json, beside = (engine.take_result(r) for r in rids)
    assert beside.output_ids == alone.output_ids
    assert json.loads(with_json.text)["a"] in (True, False)


def test_a_session_turn_is_constrained_and_its_history_kept(engine) -> None:
    schema = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1, "maxItems": 2}
    sid = engine.open_session()
    first = engine.generate([PROMPT], constrained(schema, 3), session_id=sid)[0]
    second = engine.generate([PROMPT], constrained(schema, 4), session_id=sid)[0]
    for r in (first, second):
        jsonschema.validate(json.loads(r.text), schema)
    assert second.cached_tokens > len(PROMPT)  # the session held the first turn
    engine.close_session(sid)
    engine.checker.check_idle()


def test_greedy_within_the_mask_is_the_masked_argmax(engine) -> None:
    """temperature 0 picks the best allowed token: the same answer every time."""
    schema = {"enum": ["yes", "no", "maybe"]}
    p = SamplingParams(max_tokens=20, temperature=0, json_schema=json.dumps(schema))
    texts = {r.text for r in engine.generate([PROMPT] * 3, p)}
    assert len(texts) == 1 and json.loads(texts.pop()) in schema["enum"]


def test_a_constrained_request_is_not_speculated_and_still_validates() -> None:
    target = model(layers=1)
    engine = tiny_engine(target, tokenizer=TOKENIZER, drafter=random_drafter, num_drafts=3)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = engine.generate([PROMPT, PROMPT], constrained(schema, 9))  # room to close the object
    plain = engine.generate([PROMPT], free)[0]
    for r in out:
        assert r.spec_drafted == 0 and r.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(r.text), schema)
    assert plain.spec_drafted > 0  # the drafter runs for the others
    engine.checker.check_idle()


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ("{not json", "the schema is not JSON"),
        (json.dumps({"type": "frobnicate"}), "frobnicate"),
        (json.dumps({"type": "string", "pattern": "(("}), "regex"),
    ],
)
def test_a_schema_that_cannot_be_served_is_a_400_and_takes_no_kv(engine, schema, why) -> None:
    with pytest.raises(InvalidRequestError, match=why) as err:
        engine.submit(PROMPT, SamplingParams(json_schema=schema))
    assert err.value.param == "response_format"
    assert engine.in_flight() == []
    engine.checker.check_idle()


def test_a_vocabulary_that_cannot_write_json_is_refused_clearly() -> None:
    engine = tiny_engine(tiny_model())  # the word tokenizer: `w5 w6`, no `{`
    with pytest.raises(InvalidRequestError, match="tokenizer cannot be constrained") as err:
        engine.submit([5, 6], SamplingParams(json_schema='{"type": "object"}'))
    assert err.value.param == "response_format"
    engine.checker.check_idle()


def test_retraction_and_chunked_prefill_keep_the_matcher_in_step() -> None:
    """A retracted request re-prefills its answer so far and samples on: its matcher must
    neither miss nor repeat a token (every third step retracts one)."""
    engine = tiny_engine(model(), tokenizer=TOKENIZER, page_size=4, prefill=5, retract_every=3)
    schema = {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 6}
    results = engine.generate([PROMPT] * 4, constrained(schema, 21))
    assert sum(r.retractions for r in results) > 0
    for r in results:
        assert r.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(r.text), schema)
    engine.checker.check_idle()
