"""What the other wire formats share with chat completions: one admission, one capture path.

    surface request --translate--> chat request --Proxy.admit--> Draft (session, prompt ids, K)
    backend tokens --decoder--> deltas --the surface's Events--> its SSE events, or its body
    Proxy.record: the same TurnRecord as a chat completion's, durable before the last byte

A surface module (`responses`, `anthropic`, `completions`) holds only its translation: its request
in, its body, events and errors out. Sessions, next states, main/side, the opt-out, the policy
version pinned at admission and the store are the chat route's, unchanged.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from clawbridge.chat.messages import AssistantMessage, Delta
from clawbridge.protocol import BackendError
from clawbridge.serving import wire
from clawbridge.serving.proxy import (
    SSE_HEADERS,
    Draft,
    Metrics,
    Proxy,
    _backend_error,
    _EventStream,
    _Prefetch,
)
from clawbridge.serving.wire import APIError
from clawbridge.store.records import new_turn_id
from clawbridge.types import Completion, TokenChunk
from starlette.requests import Request
from starlette.responses import Response


class Decoder(Protocol):
    """Completion token ids → deltas (`chat.decode.StreamDecoder`, or raw text for a plain prompt)."""

    def feed(self, token_ids: Iterable[int]) -> list[Delta]: ...
    def finish(self, finish_reason: str = "stop") -> list[Delta]: ...
    def message(self) -> AssistantMessage: ...


@dataclass(frozen=True)
class Answer:
    """One sampled answer, parsed: what a surface turns into its body or its last events."""

    completion: Completion
    message: AssistantMessage  # its finish_reason: "stop" | "length" | "tool_calls"
    prompt_tokens: int


class Events(Protocol):
    """One streamed answer in a surface's format; stateful (which item or block is open)."""

    def start(self) -> list[bytes]: ...
    def deltas(self, deltas: list[Delta], tokens: Sequence[int], logprobs: Sequence[float]) -> list[bytes]: ...
    def finish(self, answer: Answer) -> list[bytes]: ...
    def error(self, err: APIError) -> list[bytes]: ...


class Call(Protocol):
    """An admitted request of some surface: its draft, and how to answer it."""

    draft: Draft

    async def answer(self, request: Request) -> Response: ...


Admit = Callable[[Proxy, Request, bytes], Awaitable[Call]]


def reply_of(msg: AssistantMessage) -> dict[str, Any]:
    """The assistant message a turn records: the chat completion's, whatever the surface."""
    calls = [c.to_openai() for c in msg.tool_calls] or None
    return wire.assistant_message(msg.content, msg.reasoning_content, calls)


def openai_error(err: APIError) -> Response:
    return Response(wire.dumps(err.body()), status_code=err.status, media_type="application/json")


def endpoint(
    proxy: Proxy,
    metrics: Metrics,
    admit: Admit,
    *,
    error: Callable[[APIError], Response] = openai_error,
    auth: Callable[[Request], None] | None = None,
) -> Callable[[Request], Awaitable[Response]]:
    """A route over `admit`: counted, timed and authenticated as the chat route is, its errors
    in the surface's shape. The next state a request carried is kept however it ends."""
    check = auth or proxy.check_auth

    async def run(request: Request) -> Response:
        counters = proxy.counters
        counters.requests += 1
        counters.in_flight += 1
        t0 = time.perf_counter()
        status, streaming, call = 200, False, None
        try:
            check(request)
            call = await admit(proxy, request, await proxy.read_body(request))
            response = await call.answer(request)
            streaming = isinstance(response, _EventStream)  # counts itself out when it ends
            return response
        except (APIError, BackendError) as e:
            err = e if isinstance(e, APIError) else _backend_error(e)
            status = err.status
            if status >= 500:
                counters.errors_5xx += 1
            else:
                counters.errors_4xx += 1
            return error(err)
        finally:
            if not streaming:
                counters.in_flight -= 1
                if call is not None:  # a no-op once its turn was written with it
                    proxy.attach_next_state(call.draft)
            metrics.observe(status, time.perf_counter() - t0)

    return run


async def admit(
    proxy: Proxy, request: Request, chat: dict[str, Any], renamed: dict[str, str] | None = None
) -> tuple[wire.ChatRequest, Draft]:
    """A translated request through the chat route's own admission (validation, the session,
    rendering, the context check, the policy version): the body is the chat request it became.
    `renamed`: the surface's names for chat fields, so an error names the field the client sent."""
    try:
        return await proxy.admit(request, wire.dumps({k: v for k, v in chat.items() if v is not None}))
    except APIError as e:
        if renamed and e.param in renamed:
            old, e.param = e.param, renamed[e.param]
            e.message = e.message.replace(f"'{old}'", f"'{e.param}'").replace(f"{old} is", f"{e.param} is")
        raise


def parse_body(raw: bytes) -> dict[str, Any]:
    """A surface's JSON body, bounded in depth before anything walks it."""
    body = wire.json_object(raw)
    wire.check_depth(body)
    return body


async def complete(
    proxy: Proxy, d: Draft, request: Request, n: int = 1, decoder: Callable[[], Decoder] | None = None
) -> list[Answer]:
    """Sample, parse and record (one turn per answer, committed before this returns). A client
    that leaves meanwhile stops the generation and nothing is recorded, as for chat."""
    comps = await proxy.sample(d, n, request)
    answers = []
    for c in comps:
        dec = decoder() if decoder else proxy.renderer.stream(d.params.stop)
        dec.feed(c.tokens)
        dec.finish(c.finish_reason)
        answers.append(Answer(c, dec.message(), len(d.prompt_ids)))
    await proxy.record(
        d, comps, [reply_of(a.message) for a in answers], [a.message.finish_reason for a in answers],
        ttft_ms=None,
    )
    proxy.counters.completion_tokens += sum(len(c.tokens) for c in comps)
    return answers


async def stream(proxy: Proxy, d: Draft, events: Events, decoder: Decoder | None = None) -> Response:
    """Stream one answer as `events` formats it; the turn is recorded before the last event."""
    chunks = proxy.backend.sample_stream(d.prompt_ids, d.params, version=d.version)
    # As for chat: the first chunk comes before the status line, so a refusal is a proper 4xx.
    try:
        first = await anext(aiter(chunks))
    except StopAsyncIteration:
        first = TokenChunk((), (), d.version, "stop")
    dec = decoder or proxy.renderer.stream(d.params.stop)
    return _EventStream(
        _events(proxy, d, chunks, first, events, dec),
        on_close=lambda: proxy._stream_closed(d, chunks),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def _events(
    proxy: Proxy, d: Draft, chunks: AsyncIterator[TokenChunk], first: TokenChunk, events: Events,
    dec: Decoder,
) -> AsyncIterator[bytes]:
    ttft_ms = (time.perf_counter() - d.t0) * 1000
    feed = _Prefetch(chunks)
    tokens: list[int] = []
    lps: list[float] = []
    tops: list[Any] = []
    finish: str | None = None
    out = events.start()
    try:
        chunk: TokenChunk | None = first
        while chunk is not None:
            tokens.extend(chunk.tokens)
            lps.extend(chunk.logprobs)
            if chunk.top_logprobs:
                tops.extend(chunk.top_logprobs)
            out += events.deltas(dec.feed(chunk.tokens), chunk.tokens, chunk.logprobs)
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
                break
            if out:
                yield b"".join(out)
                out = []
            chunk = await feed.next()
        out += events.deltas(dec.finish(finish or "stop"), (), ())
    except BackendError as e:
        yield b"".join([*out, *events.error(_backend_error(e))])
        return
    finally:
        await feed.aclose()
    comp = Completion(
        tokens=tuple(tokens),
        logprobs=tuple(lps),
        finish_reason=finish or "stop",  # type: ignore[arg-type]
        version=first.version,
        top_logprobs=tuple(tops) if tops else None,
    )
    msg = dec.message()
    await proxy.record(d, [comp], [reply_of(msg)], [msg.finish_reason], ttft_ms)
    proxy.counters.completion_tokens += len(tokens)
    out += events.finish(Answer(comp, msg, len(d.prompt_ids)))
    yield b"".join(out)


def turn_hex(d: Draft) -> str:
    """Give the draft's turn an id of our choosing and return its hex part: a surface names its
    answer after it (`resp_<hex>`, `msg_<hex>`), so an answer id leads to the stored turn."""
    tid = new_turn_id()
    d.turn_ids = (tid,)
    return tid.removeprefix("turn-")


def token_logprobs(proxy: Proxy, tokens: Sequence[int], lps: Sequence[float], top: Any) -> list[dict[str, Any]]:
    """OpenAI's per-token logprob entries (token, logprob, bytes, top_logprobs)."""
    return list(proxy.logprobs(tokens, lps, top)["content"])


def sse(event: str | None, obj: Any) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + wire.dumps(obj) + b"\n\n"
