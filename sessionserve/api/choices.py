"""`n` > 1: several choices for one request, each a turn of its own, merged into one answer.

OpenAI's `n` samples several answers to one prompt (pass@k evaluations, best-of picking).
Each choice is a sessionless request to a replica: with a `seed`, choice i samples with
seed + i, so the whole answer repeats; the prompt's KV is shared through the radix cache once
the first choice has prefilled it. A session turn takes one choice: the session's next turn
continues one answer, and it would not be clear which. No HTTP here: the routes
(`api/ingress.py`) hand over the turns (`TurnTransport`) and the bodies (`Reply`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from sessionserve.api.chat_replies import Reply
from sessionserve.api.errors import response_for
from sessionserve.api.turns import TurnStream, TurnTransport, own_request
from sessionserve.errors import InvalidRequestError
from sessionserve.wire import SEED_RANGE, GenerateCall, TurnDelta, TurnResult

SESSION_CHOICES = (
    "n: a session turn takes one choice (n = 1), since the session's next turn continues "
    "one answer; ask for n > 1 without a session"
)
Opened = tuple[TurnStream, TurnDelta | TurnResult]


def check_choices(n: int, session_named: bool) -> None:
    """Before the turn's session is looked up or opened: n > 1 names no session."""
    if n > 1 and session_named:
        raise InvalidRequestError(SESSION_CHOICES, param="n")


def choice_calls(call: GenerateCall, n: int) -> list[GenerateCall]:
    """The `n` calls of a sessionless request (`check_choices`): choice i samples with the
    request's seed + i (wrapped into the seed range), or unseeded as it came."""
    seed = call.sampling.seed
    calls = []
    for i in range(n):
        sampling = call.sampling
        if seed is not None and i:
            sampling = sampling.model_copy(update={"seed": _shifted(seed, i)})
        calls.append(replace(call, sampling=sampling))
    return calls


def _shifted(seed: int, i: int) -> int:
    low, high = SEED_RANGE
    return (seed + i - low) % (high - low + 1) + low


async def open_choices(
    turns: TurnTransport, calls: list[GenerateCall], owner_id: str | None
) -> list[Opened]:
    """Start every choice and wait for each one's first piece; if one cannot start, the
    others are cancelled and its error raised (a 4xx is the same for all of them)."""
    opened = await asyncio.gather(
        *(own_request(turns.open(call, owner_id)) for call in calls), return_exceptions=True
    )
    failed = [o for o in opened if isinstance(o, BaseException)]
    if failed:
        for o in opened:
            if not isinstance(o, BaseException):
                o[0].cancel()
        raise failed[0]
    return opened  # type: ignore[return-value]


async def collect_choices(
    turns: TurnTransport, opened: list[Opened]
) -> list[tuple[str, list, TurnResult]]:
    """Every choice's whole answer (`TurnTransport.collect`), in choice order; if one fails,
    the others are cancelled on their replicas and its error raised."""
    try:
        return list(await asyncio.gather(*(turns.collect(s, first) for s, first in opened)))
    except BaseException:
        for stream, _ in opened:
            stream.cancel()
        raise


async def relay_choices(
    opened: list[Opened], reply: Reply, stamp: Any, include_usage: bool
) -> AsyncIterator[str]:
    """The choices' server-sent events, each delta as it comes with its choice's index: every
    choice's opening, deltas and finish chunk, then one usage chunk (when asked for) and
    [DONE]. A failure mid-stream is told in-band and ends the others; a client that goes away
    cancels every choice still running."""
    replies = [reply.choice(i) for i in range(len(opened))]
    queue: asyncio.Queue[tuple[int, str | TurnResult | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: TurnStream, piece: TurnDelta | TurnResult) -> None:
        try:
            while not isinstance(piece, TurnResult):
                chunk = replies[i].delta(piece)
                if chunk:
                    await queue.put((i, chunk))
                piece = await stream.__anext__()
            await queue.put((i, piece))
        except Exception as e:  # noqa: BLE001 - told to the client in-band
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s, first)) for i, (s, first) in enumerate(opened)]
    finals: dict[int, TurnResult] = {}
    try:
        for r in replies:
            if (chunk := r.opening()) is not None:
                yield chunk
        while len(finals) < len(opened):
            i, item = await queue.get()
            if isinstance(item, BaseException):
                yield Reply._sse(json.loads(response_for(item).body))
                yield "data: [DONE]\n\n"
                return
            if isinstance(item, TurnResult):
                finals[i] = stamp(item)
                yield replies[i].finish_chunk(finals[i])
            else:
                yield item
        yield reply.last_chunk([finals[i] for i in range(len(opened))], include_usage)
        yield "data: [DONE]\n\n"
    finally:
        for i, task in enumerate(tasks):
            task.cancel()
            if i not in finals:  # still running: the client went away or another failed
                opened[i][0].cancel()
