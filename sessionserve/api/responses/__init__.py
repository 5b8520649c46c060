"""OpenAI's Responses API over sessions: the request and its input items (`protocol.py`), the
response object and its stream events (`objects.py`), and the calls that make, store and
read responses (`service.py`).

A chain of responses linked by `previous_response_id` is one session: the new response is sent
to the session's pinned replica as a chat-mode turn over the whole conversation (the chain's
earlier inputs and outputs plus the new input), so the replica reuses the KV it still holds
and prefills only what is new. Two responses naming the same previous response fork the
conversation: each is a turn over its own full conversation, so the session rewinds to the
shared point (its KV reused) and neither branch sees the other's tokens.

Function tools work as in chat completions (the replica constrains and parses the calls): a
call is a `function_call` output item, its result comes back as a `function_call_output` input
item (through `previous_response_id`, or with the whole conversation in `input`, as agent SDKs
send it). Field names, objects and events follow OpenAI's API reference. What we do not serve
(built-in tools, files, images, reasoning options, background runs, ...) is refused with a 400
naming the field, never accepted and ignored; the published schema lists, for each such field,
only the values that mean "not used" (what SDKs send by default), so a schema-valid request is
served.
"""
