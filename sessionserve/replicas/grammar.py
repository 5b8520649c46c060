"""Structured output: a request's JSON schema becomes a token mask on its logits.

llguidance (chosen over xgrammar by `benchmarks/grammar.py`: no heavy dependencies, faster
compiles; masking a batch of 8 costs ~2% of a CPU decode step) compiles the schema against the
model's tokenizer into a matcher. Before each of the request's samples the matcher fills a
bitmask of the tokens the grammar allows next and the sampler sees only those (`apply_masks`);
each sampled token is then consumed, and the answer ends when its JSON is complete
(`stopping.py`), so an answer that ends always parses and validates. Compiled matchers are
cached by schema text and copied per request. A schema that cannot be compiled is a 400 naming
`response_format`, raised before the request takes any KV. Tool calls are constrained the same
way by a Lark grammar (replicas/tools/formats.py), whose errors name `tools`. Speculation skips
constrained requests (their drafts would have to pass the mask too): they decode one token a
step.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from sessionserve.errors import InvalidRequestError
from sessionserve.wire import SamplingParams

CACHED_SCHEMAS = 64  # compiled grammars kept (least recently used dropped first)
# JSON's layout is fixed (no free whitespace): with free whitespace a model can pad an answer
# with blank lines until max_tokens and never finish it
JSON_LAYOUT = {"whitespace_flexible": False}


# where a schema keeps its subschemas (JSON Schema 2020-12 and draft 7), for `closed_objects`:
# whole schemas of other instances (a property's value, an item, a definition) ...
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = (
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "propertyNames",
)
# ... and parts that constrain the same instance as their parent, each listing some keys only
PART_LISTS = ("allOf",)
PART_VALUES = ("if", "then", "else", "not")
PART_MAPS = ("dependentSchemas",)
# an object with one of these says what else it takes, or takes keys its parts add
OPEN_ENDED = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "$ref",
    "allOf",
    "if",
    "then",
    "else",
    "dependentSchemas",
)


def closed_objects(schema: Any, part: bool = False) -> Any:
    """`schema` with each object that lists its `properties` closed to them
    (`additionalProperties: false`) where it does not say what else it takes. JSON Schema lets
    such an object carry any other key, and a small model takes that up: asked for
    {name, age}, SmolLM2-135M added keys until max_tokens cut its JSON off. xgrammar, the
    default grammar engine of vLLM and SGLang, closes them too (its strict mode); an answer
    still validates against the schema as written. Left open: `part`s (under `allOf`, `if`,
    `then`, `else`, `not`, `dependentSchemas`: each lists only some of the instance's keys),
    objects that have such parts, and objects beside a `$ref`."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for keys, is_part in ((SCHEMA_MAPS, False), (PART_MAPS, True)):
        for key in keys:
            if isinstance(out.get(key), dict):
                out[key] = {name: closed_objects(sub, is_part) for name, sub in out[key].items()}
    for keys, is_part in ((SCHEMA_LISTS, False), (PART_LISTS, True)):
        for key in keys:
            if isinstance(out.get(key), list):
                out[key] = [closed_objects(sub, is_part) for sub in out[key]]
    for keys, is_part in ((SCHEMA_VALUES, False), (PART_VALUES, True)):
        for key in keys:
            if key in out:
                out[key] = closed_objects(out[key], is_part)
    lists_keys = isinstance(out.get("properties"), dict)
    if lists_keys and not part and not any(key in out for key in OPEN_ENDED):
        out["additionalProperties"] = False
    return out


class Grammars:
    """Compiles schemas for one tokenizer; `matcher(schema)` is a request's own matcher."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`vocab_size`: the logits' width (it may exceed the tokenizer's)."""
        import llguidance.hf

        self._compiled: OrderedDict[tuple[bool, str], Any] = OrderedDict()
        self.info, self.unusable = None, None
        try:
            self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        except Exception as e:  # a tokenizer llguidance cannot map to bytes
            self.unusable = f"this model's tokenizer cannot be constrained ({e})"

    def for_sampling(self, sampling: SamplingParams) -> Any | None:
        """The request's own matcher (None: unconstrained); a 400 if it cannot be built."""
        if sampling.lark_grammar is not None:
            return self.matcher(sampling.lark_grammar, lark=True)
        if sampling.json_schema is not None:
            return self.matcher(sampling.json_schema)
        return None

    def matcher(self, text: str, lark: bool = False) -> Any:
        """A fresh matcher at the start of `text`: a JSON schema, or with `lark` a Lark grammar
        (tool calls); a 400 if it cannot be compiled."""
        param = "tools" if lark else "response_format"
        if self.info is None:
            raise _unusable(self.unusable, param)
        key = (lark, text)
        template = self._compiled.get(key)
        if template is None:
            template = self._compile(text, lark, param)
            self._compiled[key] = template
            if len(self._compiled) > CACHED_SCHEMAS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return template.deep_copy()

    def _compile(self, text: str, lark: bool, param: str) -> Any:
        from llguidance import LLMatcher

        try:
            if lark:
                grammar = LLMatcher.grammar_from_lark(text)
            else:
                schema = closed_objects(json.loads(text))
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except json.JSONDecodeError as e:
            raise _unusable(f"the schema is not JSON ({e})", param) from None
        except Exception as e:  # a schema llguidance refuses
            raise _unusable(str(e), param) from None
        matcher = LLMatcher(self.info, grammar)
        if matcher.is_error():
            raise _unusable(matcher.get_error(), param)
        if not any(matcher.compute_bitmask()):  # a vocabulary without `{`, say
            raise _unusable("no token of this model's vocabulary can start such an answer", param)
        return matcher


def apply_masks(logits: torch.Tensor, matchers: list[Any | None]) -> None:
    """Mask, in place, each row of `logits` [N, V] that has a matcher to the tokens its
    grammar allows next (-inf elsewhere)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:  # before the import: a step without grammars needs no grammar engine
        return
    import llguidance.torch as lt

    vocab = logits.shape[-1]
    bitmask = lt.allocate_token_bitmask(len(rows), vocab)  # [R, ceil(V / 32)] int32
    for j, i in enumerate(rows):
        lt.fill_next_token_bitmask(matchers[i], bitmask, j)
    # unpacked here, not with llguidance's apply_token_bitmask_inplace: that one is a
    # torch.compile kernel, tens of seconds to build on a CPU replica's first request
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool().to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def consume(matcher: Any, token: int) -> None:
    """Advance `matcher` past a sampled token (the mask allowed it, so this cannot fail
    unless the grammar engine disagrees with itself)."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused token {token}: {matcher.get_error()}")


def _unusable(reason: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param}: constrained decoding cannot serve this request: {reason}", param=param
    )
