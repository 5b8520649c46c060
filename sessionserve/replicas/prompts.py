"""A turn's input as token ids: chat messages through the model's chat template (with tools,
rendered as `replicas/tools/formats.py` says), or a prompt's text tokenized as it is. One place
for it: the served replica (`ReplicaServer.generate`) and the in-process demo (`cli.py`) build
their prompts the same way."""

from __future__ import annotations

from typing import Any

from sessionserve.errors import InvalidRequestError
from sessionserve.replicas.tools.formats import render_messages
from sessionserve.wire import ToolUse


def chat_input_ids(
    tokenizer: Any, model_name: str, messages: list[dict[str, Any]], tools: ToolUse | None = None
) -> list[int]:
    """The conversation through the chat template, ending with the assistant's turn opened.
    A 400 for a base model (no template) or messages the template rejects."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            f"messages: {model_name} is a base model with no chat template, so it cannot take "
            "chat messages; send a prompt to /v1/completions",
            param="messages",
        )
    extra: dict[str, Any] = {}
    if tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages, extra = render_messages(tokenizer, messages, tools)
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
        )
    except Exception as e:  # a template that rejects the roles or order
        raise InvalidRequestError(f"messages: {e}", param="messages") from None
    return list(ids)


def prompt_ids(tokenizer: Any, prompt: str | list[int] | None, starts: bool = False) -> list[int]:
    """A completion prompt's ids: given ids as they are; text with the tokenizer's special
    tokens where it `starts` a sequence (a plain request, a session's first turn: Gemma's
    tokenizer puts its BOS first, without which the model writes noise), without them where
    it follows a session's tokens (an append turn's new text)."""
    if isinstance(prompt, list):
        return list(prompt)
    return tokenizer(prompt or "", add_special_tokens=starts).input_ids
