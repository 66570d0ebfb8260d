"""The one serving pipeline: every wire format's request goes through the same endpoint,
admission, sampling loop and capture; a format only translates.

    Endpoint: auth -> read body -> the format's admit (its schema, then Proxy.admit) -> Call
    Call.answer: complete() (sample n, parse, record)  or  stream() (the one streaming loop)
    stream: backend tokens --Prefetch--> decoder --> deltas --the format's Events--> its SSE bytes
    Proxy.record: one TurnRecord per answer, durable before the last byte leaves
    the request's end (however it ends): counted out, the next state it carried kept

A wire format module (`chat_completions`, `responses`, `anthropic`, `completions`) holds only its
translation: its request in, its body, `Events` and errors out. Sessions, next states, main/side,
the opt-out, the policy version pinned at admission and the store are the proxy's, unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from clawbridge.chat.messages import AssistantMessage, Delta
from clawbridge.protocol import BackendError
from clawbridge.serving import wire
from clawbridge.serving.errors import SERVER_ERROR, backend_error
from clawbridge.serving.streaming import SSE_HEADERS, EventStream, Prefetch
from clawbridge.serving.wire import APIError
from clawbridge.store.records import new_turn_id
from clawbridge.types import Completion, TokenChunk
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

if TYPE_CHECKING:
    from clawbridge.serving.metrics import Metrics
    from clawbridge.serving.proxy import Draft, Proxy

log = logging.getLogger(__name__)


class Decoder(Protocol):
    """Completion token ids → deltas (`chat.decode.StreamDecoder`, or raw text for a plain prompt)."""

    def feed(self, token_ids: Iterable[int]) -> list[Delta]: ...
    def finish(self, finish_reason: str = "stop") -> list[Delta]: ...
    def message(self) -> AssistantMessage: ...


@dataclass(frozen=True)
class Answer:
    """One sampled answer, parsed: what a wire format turns into its body or its last events."""

    completion: Completion
    message: AssistantMessage  # its finish_reason: "stop" | "length" | "tool_calls"
    prompt_tokens: int


class Events(Protocol):
    """One streamed answer in a wire format's events; stateful (which item or block is open).
    `deltas` gets the deltas the decoder made of the tokens sampled since its last call (and
    those tokens, their logprobs and top alternatives): a token whose text the decoder holds
    back (an incomplete UTF-8 sequence, a possible tag start) shows with a later delta."""

    def start(self) -> list[bytes]: ...
    def deltas(
        self, deltas: list[Delta], tokens: Sequence[int], logprobs: Sequence[float], top: Sequence[Any] | None = None
    ) -> list[bytes]: ...
    def finish(self, answer: Answer) -> list[bytes]: ...
    def error(self, err: APIError) -> list[bytes]: ...


class Call(Protocol):
    """An admitted request of some wire format: its draft, and how to answer it."""

    draft: Draft

    async def answer(self, proxy: Proxy, request: Request) -> Response: ...


Admit = Callable[["Proxy", Request, bytes], Awaitable[Call]]


def openai_error(err: APIError) -> Response:
    return Response(wire.dumps(err.body()), status_code=err.status, media_type="application/json")


class Endpoint:
    """A wire format's route, a raw ASGI app: counted, timed and authenticated as every other,
    its errors in the format's shape (`error`). However the request ends (answered, refused,
    failed, or the client gone mid-stream), it is counted out and the next state it carried is
    kept, once, after its response."""

    def __init__(
        self,
        proxy: Proxy,
        metrics: Metrics,
        admit: Admit,
        *,
        error: Callable[[APIError], Response] = openai_error,
        auth: Callable[[Request], None] | None = None,
    ) -> None:
        self.proxy, self.metrics, self.admit, self.error = proxy, metrics, admit, error
        self.auth = auth or proxy.check_auth

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        proxy = self.proxy
        counters = proxy.counters
        counters.requests += 1
        counters.in_flight += 1
        t0 = time.perf_counter()
        call: Call | None = None
        try:
            request = Request(scope, receive, send)
            try:
                self.auth(request)
                call = await self.admit(proxy, request, await proxy.read_body(request))
                response = await call.answer(proxy, request)
            except (APIError, BackendError) as e:
                err = e if isinstance(e, APIError) else backend_error(e)
                counters.error(err.status)
                response = self.error(err)
            except ClientDisconnect:  # the client left; no error of ours, nobody to answer
                log.info("client left during %s", scope["path"])
                response = Response(status_code=499)
            except Exception:
                counters.error(500)
                log.exception("unhandled error on %s", scope["path"])
                response = self.error(APIError(500, SERVER_ERROR, type="server_error"))
            self.metrics.observe(response.status_code, time.perf_counter() - t0)
            await response(scope, receive, send)
        finally:
            counters.in_flight -= 1
            if call is not None:  # a no-op once its turn was written with it
                proxy.attach_next_state(call.draft)


def parse_body(raw: bytes) -> dict[str, Any]:
    """A wire format's JSON body, bounded in depth before anything walks it."""
    body = wire.json_object(raw)
    wire.check_depth(body)
    return body


def reply_of(msg: AssistantMessage) -> dict[str, Any]:
    """The assistant message a turn records: the chat completion's, whatever the format."""
    calls = [c.to_openai() for c in msg.tool_calls] or None
    return wire.assistant_message(msg.content, msg.reasoning_content, calls)


async def complete(
    proxy: Proxy, d: Draft, request: Request, n: int = 1, decoder: Callable[[], Decoder] | None = None
) -> list[Answer]:
    """Sample, parse and record (one turn per answer, committed before this returns). A client
    that leaves meanwhile stops the generation and nothing is recorded."""
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


async def stream(
    proxy: Proxy, d: Draft, events: Events, decoder: Decoder | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """Stream one answer as `events` formats it; the turn is recorded before the last event."""
    chunks = proxy.backend.sample_stream(d.prompt_ids, d.params, version=d.version)
    # The first chunk is awaited before the status line goes out, so a backend that refuses the
    # prompt still gets a proper 4xx; the first token is what a client waits for anyway.
    try:
        first = await anext(aiter(chunks))
    except StopAsyncIteration:
        first = TokenChunk((), (), d.version, "stop")
    dec = decoder or proxy.renderer.stream(d.params.stop)
    return EventStream(_events(proxy, d, chunks, first, events, dec), source=chunks,
                       headers={**SSE_HEADERS, **(headers or {})})


async def _events(
    proxy: Proxy, d: Draft, chunks: AsyncIterator[TokenChunk], first: TokenChunk, events: Events,
    dec: Decoder,
) -> AsyncIterator[bytes]:
    ttft_ms = (time.perf_counter() - d.t0) * 1000
    feed = Prefetch(chunks)
    tokens: list[int] = []
    lps: list[float] = []
    tops: list[Any] = []
    finish: str | None = None
    # One write per backend chunk: the events a chunk produces leave together (the opening
    # events with the first token's), so the socket sees one send where it would see several.
    out = events.start()
    try:
        chunk: TokenChunk | None = first
        while chunk is not None:
            tokens.extend(chunk.tokens)
            lps.extend(chunk.logprobs)
            if chunk.top_logprobs:
                tops.extend(chunk.top_logprobs)
            out += events.deltas(dec.feed(chunk.tokens), chunk.tokens, chunk.logprobs, chunk.top_logprobs)
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
                break
            if out:
                yield b"".join(out)
                out = []
            chunk = await feed.next()
        out += events.deltas(dec.finish(finish or "stop"), (), ())
    except BackendError as e:
        yield b"".join([*out, *events.error(backend_error(e))])
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
    msg = dec.message()  # the same tool-call ids the client was streamed
    await proxy.record(d, [comp], [reply_of(msg)], [msg.finish_reason], ttft_ms)
    proxy.counters.completion_tokens += len(tokens)
    out += events.finish(Answer(comp, msg, len(d.prompt_ids)))
    yield b"".join(out)


def turn_hex(d: Draft) -> str:
    """Give the draft's turn an id of our choosing and return its hex part: a format names its
    answer after it (`resp_<hex>`, `msg_<hex>`), so an answer id leads to the stored turn."""
    tid = new_turn_id()
    d.turn_ids = (tid,)
    return tid.removeprefix("turn-")


def token_logprobs(proxy: Proxy, tokens: Sequence[int], lps: Sequence[float], top: Any) -> list[dict[str, Any]]:
    """OpenAI's per-token logprob entries (token, logprob, bytes, top_logprobs)."""
    return list(proxy.logprobs(tokens, lps, top)["content"])
