"""Server-sent events: the backend's token stream pulled ahead of the writes, and the response
that closes everything it opened however it ends. Every wire format streams through these two."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from clawbridge.serving import wire
from clawbridge.types import TokenChunk
from starlette.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(event: str | None, obj: Any) -> bytes:
    """One SSE event; `event` None: a bare `data:` line (OpenAI's formats)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + wire.dumps(obj) + b"\n\n"


class Prefetch:
    """A backend's token stream pulled by a task of its own. `next()` returns the next chunk
    merged with every chunk that arrived behind it while the previous events were being sent, so
    a burst of tokens (a batching engine's step, a fast backend) leaves in one write; a token that
    arrives alone is passed on as soon as it arrives."""

    def __init__(self, chunks: AsyncIterator[TokenChunk]) -> None:
        self._chunks = chunks
        self._items: deque[TokenChunk | BaseException | None] = deque()
        self._ready = asyncio.Event()
        self._task = asyncio.ensure_future(self._pull())

    async def _pull(self) -> None:
        try:
            async for chunk in self._chunks:
                self._put(chunk)
                if chunk.finish_reason is not None:
                    break
            self._put(None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # BackendError and kin: raised to the reader in order
            self._put(e)

    def _put(self, item: TokenChunk | BaseException | None) -> None:
        self._items.append(item)
        self._ready.set()

    async def next(self) -> TokenChunk | None:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        while item is not None and item.finish_reason is None and self._items:
            nxt = self._items[0]
            if not isinstance(nxt, TokenChunk):
                break
            self._items.popleft()
            item = _merge(item, nxt)
        return item

    async def aclose(self) -> None:
        """Stop pulling (the backend's stream sees the cancellation: the engine stops) and close."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await close(self._chunks)


def _merge(a: TokenChunk, b: TokenChunk) -> TokenChunk:
    top = (a.top_logprobs or ()) + (b.top_logprobs or ()) if a.top_logprobs or b.top_logprobs else None
    return TokenChunk(a.tokens + b.tokens, a.logprobs + b.logprobs, b.version, b.finish_reason, top)


async def close(chunks: AsyncIterable[Any]) -> None:
    """Close an async iterator that can be closed (a no-op when it already was)."""
    aclose: Callable[[], Awaitable[None]] | None = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


class EventStream(StreamingResponse):
    """SSE whose event generator, and the backend stream under it, are closed as soon as the
    response ends, however it ends. A client that disconnects makes the next send fail; Starlette
    then leaves the generator suspended for the garbage collector. Closing it here runs its
    `finally` at once, so the engine stops generating for nobody, and the turn, whose answer was
    not fully sent, is not recorded (that happens only after the last event is built). The
    backend's stream is closed here too: a client gone before the first byte (an ASGI server whose
    `send` fails then) leaves a generator that never ran, so never closed it."""

    def __init__(self, content: AsyncIterator[bytes], *, source: AsyncIterator[Any], **kw: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kw)
        self._source = source

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close(self.body_iterator)
            await close(self._source)
