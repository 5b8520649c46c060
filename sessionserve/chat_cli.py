"""`sessionserve chat`: an interactive terminal chat over one streaming session.

Talks to a running server (`make serve`) with the official OpenAI client; after each answer it
shows the turn's time to first token and how many prompt tokens the session's KV saved.
"""

from __future__ import annotations

import time
import uuid

# where a turn's reused prompt tokens came from (the answer's `session.cached_source`)
REUSED_FROM = {
    "session": " from the session",
    "radix": " from the prefix cache (shared with other requests)",
    "host": " from the session, copied back from host memory",
    "none": "",
}


def run_chat(base_url: str, model: str | None, max_tokens: int, session_id: str | None) -> int:
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="unused")
    try:
        model = model or client.models.list().data[0].id
    except openai.APIConnectionError:
        print(f"cannot reach {base_url}: start the server first (`make serve`)")
        return 1
    sid = session_id or f"chat-{uuid.uuid4().hex[:8]}"
    httpx.post(f"{base_url.rstrip('/')}/v1/sessions", json={"session_id": sid}, timeout=30)
    print(f"model {model}, session {sid}. Empty line or Ctrl-D to quit.")
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        t0, ttft, parts, usage, source = time.monotonic(), None, [], None, None
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-session-id": sid},
        )
        print("assistant> ", end="", flush=True)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            source = (chunk.model_extra or {}).get("session", {}).get("cached_source", source)
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft or time.monotonic() - t0
                    parts.append(choice.delta.content)
                    print(choice.delta.content, end="", flush=True)
        messages.append({"role": "assistant", "content": "".join(parts)})
        cached = usage.prompt_tokens_details.cached_tokens if usage else 0
        prompt = usage.prompt_tokens if usage else 0
        print(
            f"\n   [TTFT {1000 * (ttft or 0):.0f} ms, prompt {prompt} tokens, "
            f"{cached} reused{REUSED_FROM.get(source or 'none', f' ({source})')}]"
        )
    httpx.delete(f"{base_url.rstrip('/')}/v1/sessions/{sid}", timeout=30)
    print("session closed")
    return 0
