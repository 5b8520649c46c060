"""A fake of what a streaming replica call returns, and a client reading an SSE stream, for
the ingress's tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class PieceStream:
    """A replica's stream of pieces (an exception among them is raised in its turn), each
    after `delay` seconds; `cancelled` records a cancel (a client disconnect)."""

    def __init__(self, pieces: list[object], delay: float = 0.0) -> None:
        self.pieces, self.delay, self.cancelled = list(pieces), delay, False

    async def __anext__(self) -> object:
        await asyncio.sleep(self.delay)
        piece = self.pieces.pop(0)
        if isinstance(piece, Exception):
            raise piece
        return piece

    def cancel(self) -> None:
        self.cancelled = True


async def read(chunks: AsyncIterator[str], take: int | None = None) -> list[str]:
    """What a client reads of `chunks`: all, or the first `take`, then it goes away."""
    out = []
    async for chunk in chunks:
        out.append(chunk)
        if take is not None and len(out) == take:
            await chunks.aclose()  # the client went away
            break
    return out
