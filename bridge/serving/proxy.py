"""The OpenAI-compatible proxy: one request from the socket to the backend and into the store.

    validate (wire) -> tag + render (sessions, renderer) -> admit on version K -> sample / stream
    -> parse -> record the turn (durable before the last byte leaves) -> answer

A Starlette app with plain routes (no per-request dependency injection): the hop must cost about
as much as a minimal relay. Turns are written by the store's group-commit writer; the response
waits only for its own commit, so a turn whose answer a client received survives a kill -9.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import inspect
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from clawbridge.protocol import (
    Backend,
    BackendError,
    ContextLengthExceeded,
    TransientBackendError,
)
from clawbridge.chat.messages import AssistantMessage, Delta, PromptTooLong, RenderError
from clawbridge.chat.renderer import Renderer
from clawbridge.serving import wire
from clawbridge.serving.sessions import (
    TAG_HEADERS,
    Admission,
    NextState,
    Sessions,
    agent_housekeeping,
    read_tag,
)
from clawbridge.serving.wire import APIError
from clawbridge.store.episodes import NewEpisode
from clawbridge.store.records import TurnRecord, new_turn_id
from clawbridge.types import Completion, SamplingParams, TokenChunk
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from clawbridge.store import Store

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Bodies larger than this are parsed and tokenised off the event loop (an agent's usual request,
# tens of KB, renders in well under a millisecond from the prompt cache: a thread hop would cost
# more than it saves).
OFF_LOOP_BYTES = 256 * 1024


@dataclass(frozen=True)
class Prepared:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    request_params: dict[str, Any]
    prompt: list[int]


@dataclass
class ProxyHooks:
    """Where the learning loop plugs in: extra routes (e.g. POST /v1/feedback), a callback for
    every next state attached, and extra fields for the status endpoint and status line."""

    routes: list[BaseRoute] = field(default_factory=list)
    on_next_state: Callable[[NextState], Awaitable[None] | None] | None = None
    status_extra: Callable[[], dict[str, Any]] | None = None
    next_state_event: asyncio.Event = field(default_factory=asyncio.Event)
    # numeric gauges for /metrics (name -> value), read at every scrape (the learner's step metrics)
    metrics_extra: Callable[[], dict[str, float]] | None = None


@dataclass
class Counters:
    requests: int = 0
    in_flight: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    turns_recorded: int = 0
    record_failures: int = 0
    completion_tokens: int = 0


@dataclass
class Draft:
    """A request that passed validation and was admitted: everything a turn record needs."""

    id: str
    created: int
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    params: SamplingParams
    version: int
    adm: Admission
    request_params: dict[str, Any]
    logprobs: bool
    t0: float
    next_state: NextState | None = None  # for the session's previous turn, not yet written
    # the ids its turns are written under, one per choice; empty: fresh ones. A surface that
    # names its answer after its turn (a Responses API `resp_...`) chooses them at admission.
    turn_ids: Sequence[str] = ()


class Proxy:
    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        store: Store,
        renderer: Renderer,
        hooks: ProxyHooks | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store
        self.renderer = renderer
        self.hooks = hooks or ProxyHooks()
        self.sessions = Sessions(settings.default_turn_type, settings.session_idle_timeout_s)
        self.counters = Counters()
        self.model_name = settings.served_model_name or backend.model_name
        self.started = time.time()
        self._key = settings.api_key.get_secret_value().encode() if settings.api_key else None
        self._background: set[asyncio.Task[Any]] = set()

    # --- the edge ---------------------------------------------------------------------------

    async def restore_sessions(self) -> int:
        """At start: the conversations open before a restart continue (their next states
        included), rebuilt from the store's recent turns of every open, unexpired session."""
        since = datetime.now(UTC) - timedelta(seconds=self.settings.session_idle_timeout_s)
        turns = await self.store.run(self.store.open_session_turns, since)
        restored = self.sessions.restore(turns)
        if restored:
            log.info("restored %d open sessions (%d turns) from the store", restored, len(turns))
        return restored

    def check_auth(self, request: Request) -> None:
        if self._key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"Request body larger than {limit} bytes.", code="request_too_large")
        chunks, size = [], 0
        try:
            # a client that opens a body and never finishes it holds a connection: not for long
            async with asyncio.timeout(self.settings.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"Request body larger than {limit} bytes.", code="request_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(
                408, f"The request body was not received within {self.settings.body_timeout_s:g} s.",
                code="request_timeout",
            ) from None
        return b"".join(chunks)

    # --- admission --------------------------------------------------------------------------

    def prepare(self, raw: bytes, *, cache: bool = True) -> tuple[wire.ChatRequest, dict[str, Any], Prepared]:
        """Parse, validate and render: the CPU-heavy part of admission, which touches no state
        but the renderer's cache (`cache=False`: not even that, so it may run off the loop)."""
        req, ours = wire.parse_chat_request(raw)
        messages, tools, request_params = req.dicts()
        ctx = self.backend.context_length
        try:
            prompt = self.renderer.render(messages, tools, req.tool_choice, use_cache=cache, limit=ctx)
        except PromptTooLong as e:
            raise context_length_exceeded(ctx, e.tokens) from None
        except RenderError as e:
            raise APIError(400, str(e), param="messages") from None
        except RecursionError:  # bounded at the door (wire.MAX_DEPTH); never a 500
            raise APIError(400, "The request is nested too deeply.", code="invalid_value") from None
        return req, ours, Prepared(messages, tools, request_params, prompt)

    async def admit(
        self, request: Request, raw: bytes, prepare: Callable[..., tuple[wire.ChatRequest, dict[str, Any], Prepared]] | None = None
    ) -> tuple[wire.ChatRequest, Draft]:
        """Everything that can reject a request happens here, before any state changes. A large
        body is parsed and rendered on a worker thread: tokenising megabytes takes seconds, and
        on the event loop it would stall every other client (and /healthz) for as long.
        `prepare` replaces `self.prepare` where the prompt is not a chat (/v1/completions)."""
        prepare = prepare or self.prepare
        if len(raw) > OFF_LOOP_BYTES:
            req, ours, prep = await asyncio.to_thread(prepare, raw, cache=False)
        else:
            req, ours, prep = prepare(raw)
        if req.model != self.model_name:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )
        if req.stream and req.n > 1:
            raise APIError(400, "n > 1 is supported without streaming only.", param="n")
        headers = {k: v for k in TAG_HEADERS if (v := request.headers.get(k)) is not None}
        if "x-session-id" in headers:
            headers["x-session-id"] = wire.session_id(headers["x-session-id"], "X-Session-Id") or ""
        path_sid = request.path_params.get("session_id")
        if path_sid is not None:
            path_sid = wire.session_id(path_sid, "session_id")
        try:
            tag = read_tag(headers, ours, path_sid)
        except ValueError as e:
            raise APIError(400, str(e), param="turn_type") from None
        messages, tools, prompt = prep.messages, prep.tools, prep.prompt
        if not tag.session_id and agent_housekeeping(messages):  # no user is talking: side
            tag = dataclasses.replace(tag, turn_type="side")
        ctx = self.backend.context_length
        if len(prompt) >= ctx:
            raise context_length_exceeded(ctx, len(prompt))
        which = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        wanted = req.max_completion_tokens or req.max_tokens or self.settings.default_max_tokens
        if wanted > ctx:  # impossible for any prompt: refused as OpenAI refuses it
            raise APIError(
                400,
                f"{which} is too large: {wanted}. This model supports at most {ctx} completion "
                f"tokens, whereas you provided {wanted}.",
                param=which,
                code="invalid_value",
            )
        # Agents ask for generous budgets; the answer is cut at the context, not refused.
        max_tokens = min(wanted, ctx - len(prompt))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop=req.stops(),
            stop_token_ids=tuple(self.renderer.stop_token_ids),
            seed=req.seed,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        )
        adm = self.sessions.admit(tag, messages)
        draft = Draft(
            id=f"chatcmpl-{os.urandom(12).hex()}",
            created=int(time.time()),
            model=self.model_name,
            messages=messages,
            tools=tools,
            prompt_ids=prompt,
            params=params,
            version=self.backend.version,  # pinned at admission; the backend keeps it
            adm=adm,
            request_params=prep.request_params,
            logprobs=req.logprobs,
            t0=time.perf_counter(),
            next_state=adm.next_state,
        )
        return req, draft

    def attach_next_state(self, d: Draft) -> None:
        """Write the next state this request carried for its session's previous turn (once).
        Called just before this request's own turn is written, so both share one commit of the
        group-commit writer (an attach at admission would commit alone and compete with the
        render for the interpreter); or, when the request ends without a turn, at its end."""
        ns, d.next_state = d.next_state, None
        if ns is not None:
            self._spawn(self._attach(ns))

    async def settle(self) -> None:
        """Wait until the writes this proxy started in the background (next states attached
        after a response went out) are done: a reader right after a response sees them."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _attach(self, ns: NextState) -> None:
        try:
            await self.store.attach_next_state_async(ns.turn_id, list(ns.messages))
        except Exception:
            log.exception("could not attach the next state of %s", ns.turn_id)
            return
        self.hooks.next_state_event.set()
        if self.hooks.on_next_state is not None:
            res = self.hooks.on_next_state(ns)
            if asyncio.iscoroutine(res):
                await res

    # --- capture ----------------------------------------------------------------------------

    async def record(
        self,
        d: Draft,
        comps: Sequence[Completion],
        replies: Sequence[dict[str, Any]],
        finishes: Sequence[str],
        ttft_ms: float | None,
    ) -> None:
        """Write one turn per choice and wait for the commit; then the session learns the reply.
        A store failure is logged and counted, never turned into a failed answer."""
        total_ms = (time.perf_counter() - d.t0) * 1000
        recs = [
            TurnRecord(
                session_id=d.adm.session_id,
                messages=d.messages,
                tools=d.tools,
                prompt_ids=tuple(d.prompt_ids),
                completion_ids=c.tokens,
                logprobs=c.logprobs,
                top_logprobs=c.top_logprobs,
                version=c.version,
                finish_reason=fin,
                response=reply,
                request_params=d.request_params,
                sampling=d.params,
                turn_type=d.adm.turn_type,
                tagged=not d.adm.untagged,
                train=d.adm.train,
                session_source=d.adm.source,
                ttft_ms=ttft_ms,
                total_ms=total_ms,
                id=d.turn_ids[i] if i < len(d.turn_ids) else new_turn_id(),
            )
            for i, (c, reply, fin) in enumerate(zip(comps, replies, finishes, strict=True))
        ]
        self.attach_next_state(d)
        try:
            if len(recs) == 1:
                await self.store.record_turn_async(recs[0])
            else:
                await asyncio.gather(*(self.store.record_turn_async(r) for r in recs))
            self.counters.turns_recorded += len(recs)
        except Exception:
            self.counters.record_failures += len(recs)
            log.exception("could not record turn(s) of %s", d.id)
        if len(recs) > 1 and d.adm.turn_type == "main" and d.adm.train:
            await self._open_choice_group(d, [r.id for r in recs])
        self.sessions.complete(d.adm, [r.id for r in recs], replies)
        if d.adm.done:
            await self.close_session(d.adm.session_id, "client")

    async def _open_choice_group(self, d: Draft, turn_ids: list[str]) -> None:
        """The n choices of one request are a group (its id is the completion's id): each is an
        episode of one turn, addressed by its turn id, trained once the client reports outcomes
        (`POST /v1/episodes/{turn_id}/outcome`) and closes the group or they time out."""
        eps = [NewEpisode(id=tid, session_id=d.adm.session_id, turn_id=tid) for tid in turn_ids]
        try:
            await self.store.run(self.store.open_group, d.id, eps, {"choices_of": d.id})
        except Exception:
            log.exception("could not open the group of %s", d.id)

    async def close_session(self, session_id: str, reason: str) -> bool:
        known = self.sessions.close(session_id)
        try:
            await self.store.close_session_async(session_id, reason)
        except Exception:
            log.exception("could not close session %s", session_id)
        return known

    # --- answering --------------------------------------------------------------------------

    def choice(self, d: Draft, c: Completion, index: int) -> tuple[dict[str, Any], dict[str, Any], str]:
        msg = self.renderer.parse(list(c.tokens), c.finish_reason, d.params.stop)
        reply = wire.assistant_message(msg.content, msg.reasoning_content, _tool_calls(msg))
        fin = msg.finish_reason
        choice: dict[str, Any] = {
            "index": index,
            "message": reply,
            "logprobs": self.logprobs(c.tokens, c.logprobs, c.top_logprobs) if d.logprobs else None,
            "finish_reason": fin,
        }
        return choice, reply, fin

    def logprobs(self, tokens: Sequence[int], lps: Sequence[float], top: Any) -> dict[str, Any]:
        dec = self.renderer.decode
        texts = [dec([t]) for t in tokens]
        alts = None
        if top:
            alts = [[(dec([a.token_id]), a.logprob) for a in row] for row in top]
        return wire.logprobs_content(texts, list(lps), alts)

    async def sample(self, d: Draft, n: int, request: Request | None = None) -> list[Completion]:
        """The n completions of a non-streamed answer. The client may leave while they are
        generated: then generation stops for nobody (as a stream's does) and ClientDisconnect is
        raised, so nothing is recorded (no answer was delivered)."""
        sampling = asyncio.ensure_future(self.backend.sample(d.prompt_ids, d.params, n=n, version=d.version))
        if request is None:
            return await sampling
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait((sampling, gone), return_when=asyncio.FIRST_COMPLETED)
        if not sampling.done():
            sampling.cancel()
            with contextlib.suppress(BaseException):
                await sampling
            raise ClientDisconnect()
        gone.cancel()
        return await sampling

    async def complete(self, d: Draft, n: int, request: Request | None = None) -> Response:
        if not d.turn_ids:  # chosen now so every choice can name the turn it is stored as
            d.turn_ids = [new_turn_id() for _ in range(n)]
        comps = await self.sample(d, n, request)
        choices, replies, finishes = [], [], []
        for i, c in enumerate(comps):
            ch, reply, fin = self.choice(d, c, i)
            ch["turn_id"] = d.turn_ids[i]  # for feedback, or an outcome when n > 1 (a group)
            choices.append(ch)
            replies.append(reply)
            finishes.append(fin)
        await self.record(d, comps, replies, finishes, ttft_ms=None)
        ntok = sum(len(c.tokens) for c in comps)
        self.counters.completion_tokens += ntok
        body = wire.completion_body(
            d.id, d.model, choices, wire.usage(len(d.prompt_ids), ntok), d.created,
            fingerprint=f"policy@v{d.version}",
        )
        return Response(wire.dumps(body), media_type="application/json",
                        headers={"X-Turn-Id": ",".join(d.turn_ids)})

    async def stream(self, d: Draft, include_usage: bool) -> Response:
        if not d.turn_ids:  # named before the first byte: the header tells the client its turn
            d.turn_ids = [new_turn_id()]
        chunks = self.backend.sample_stream(d.prompt_ids, d.params, version=d.version)
        # The first chunk is awaited before the status line goes out, so a backend that refuses
        # the prompt still gets a proper 4xx; the first token is what a client waits for anyway.
        try:
            first = await anext(aiter(chunks))
        except StopAsyncIteration:
            first = TokenChunk((), (), d.version, "stop")
        return _EventStream(
            self._events(d, chunks, first, include_usage),
            on_close=lambda: self._stream_closed(d, chunks),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, "X-Turn-Id": d.turn_ids[0]},
        )

    async def _stream_closed(self, d: Draft, chunks: AsyncIterator[TokenChunk]) -> None:
        """However a stream's response ended — answered, failed, or the client gone, even before
        the first byte when the event generator never ran: count it out, keep the next state it
        carried (a no-op once its own turn was recorded with it), and close the backend's stream
        so the engine stops generating for nobody (a no-op once the generator closed it)."""
        self.counters.in_flight -= 1
        self.attach_next_state(d)
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _events(
        self, d: Draft, chunks: AsyncIterator[TokenChunk], first: TokenChunk, include_usage: bool
    ) -> AsyncIterator[bytes]:
        fp = f"policy@v{d.version}"

        def event(delta: dict[str, Any] | None, **kw: Any) -> bytes:
            return wire.chunk_bytes(d.id, d.model, d.created, delta, fingerprint=fp, **kw)

        ttft_ms = (time.perf_counter() - d.t0) * 1000
        feed = _Prefetch(chunks)
        tokens: list[int] = []
        lps: list[float] = []
        tops: list[Any] = []
        decoder = self.renderer.stream(d.params.stop)
        pending_lp = 0  # tokens whose logprobs were not yet sent with a delta
        finish: str | None = None
        version = first.version
        # One write per backend chunk: the events a chunk produces leave together (the role event
        # with the first token's), so the socket sees one send where it would see several.
        out = [event({"role": "assistant", "content": ""})]
        try:
            chunk: TokenChunk | None = first
            while chunk is not None:
                tokens.extend(chunk.tokens)
                lps.extend(chunk.logprobs)
                if chunk.top_logprobs:
                    tops.extend(chunk.top_logprobs)
                pending_lp += len(chunk.tokens)
                for delta in decoder.feed(chunk.tokens):
                    lp = None
                    if d.logprobs and pending_lp:
                        lp = self._tail_logprobs(tokens, lps, tops, pending_lp)
                        pending_lp = 0
                    out.append(event(_delta(delta), logprobs=lp))
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                    break
                if out:
                    yield b"".join(out)
                    out = []
                chunk = await feed.next()
            for delta in decoder.finish(finish or "stop"):
                out.append(event(_delta(delta)))
        except BackendError as e:
            yield b"".join([*out, wire.error_event(_backend_error(e))])
            return
        finally:
            await feed.aclose()
        comp = Completion(
            tokens=tuple(tokens),
            logprobs=tuple(lps),
            finish_reason=finish or "stop",  # type: ignore[arg-type]
            version=version,
            top_logprobs=tuple(tops) if tops else None,
        )
        msg = decoder.message()  # the same tool-call ids the client was streamed
        reply = wire.assistant_message(msg.content, msg.reasoning_content, _tool_calls(msg))
        await self.record(d, [comp], [reply], [msg.finish_reason], ttft_ms)
        self.counters.completion_tokens += len(tokens)
        lp = self._tail_logprobs(tokens, lps, tops, pending_lp) if d.logprobs and pending_lp else None
        out.append(event({}, finish_reason=msg.finish_reason, logprobs=lp))
        if include_usage:
            out.append(event(None, usage=wire.usage(len(d.prompt_ids), len(tokens))))
        out.append(wire.DONE)
        yield b"".join(out)

    def _tail_logprobs(self, tokens: list[int], lps: list[float], tops: list[Any], k: int) -> dict[str, Any]:
        return self.logprobs(tokens[-k:], lps[-k:], tops[-k:] if tops else None)

    def model_card(self) -> dict[str, Any]:
        """The /v1/models entry. `max_model_len` (vLLM's name) and `suggested_max_tokens` let a
        client plan its prompts and budget for this server (`clawbridge openclaw install` does):
        a CPU engine suggests a short budget, since every token costs a decode step there."""
        suggested = getattr(self.backend, "suggested_max_tokens", None) or self.settings.default_max_tokens
        return {
            "id": self.model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "clawbridge",
            "max_model_len": self.backend.context_length,
            "suggested_max_tokens": min(int(suggested), self.backend.context_length),
        }

    async def status(self) -> dict[str, Any]:
        c = self.counters
        out: dict[str, Any] = {
            "model": self.model_name,
            "backend": self.backend.name,
            "version": self.backend.version,
            "uptime_s": round(time.time() - self.started, 1),
            "requests": c.requests,
            "in_flight": c.in_flight,
            "errors_4xx": c.errors_4xx,
            "errors_5xx": c.errors_5xx,
            "turns_recorded": c.turns_recorded,
            "record_failures": c.record_failures,
            "completion_tokens": c.completion_tokens,
            "sessions_open": len(self.sessions),
            "turn_counts": dict(self.sessions.counts),
        }
        try:
            out["store"] = asdict(await self.store.run(self.store.stats))
        except Exception as e:  # the status page must work while the store is unhappy
            out["store"] = {"error": str(e)}
        if self.hooks.status_extra is not None:
            out["extra"] = self.hooks.status_extra()
        return out


class _Prefetch:
    """A backend's token stream pulled by a task of its own. `next()` returns the next chunk
    merged with every chunk that arrived behind it while the previous events were being sent, so
    a burst of tokens (a batching engine's step, a fast backend) leaves in one write; a token that
    arrives alone is passed on as soon as it arrives, as before."""

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
        if hasattr(self._chunks, "aclose"):
            await self._chunks.aclose()


def _merge(a: TokenChunk, b: TokenChunk) -> TokenChunk:
    top = (a.top_logprobs or ()) + (b.top_logprobs or ()) if a.top_logprobs or b.top_logprobs else None
    return TokenChunk(a.tokens + b.tokens, a.logprobs + b.logprobs, b.version, b.finish_reason, top)


class _EventStream(StreamingResponse):
    """SSE whose event generator is closed as soon as the response ends, however it ends. A
    client that disconnects makes the next send fail; Starlette then leaves the generator
    suspended for the garbage collector. Closing it here runs its `finally` at once: the
    backend's stream is closed, so the engine stops generating for nobody, and the turn, whose
    answer was not fully sent, is not recorded (that happens only after the last event is built).
    `on_close` then runs once, however the response ended (`Proxy._stream_closed`)."""

    def __init__(self, content: Any, *, on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                await body.aclose()
            await self._on_close()


def context_length_exceeded(ctx: int, tokens: int) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {ctx} tokens. However, your messages "
        f"resulted in {tokens} tokens. Please reduce the length of the messages.",
        param="messages",
        code="context_length_exceeded",
    )


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its body was read: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _tool_calls(msg: AssistantMessage) -> list[dict[str, Any]] | None:
    return [c.to_openai() for c in msg.tool_calls] if msg.tool_calls else None


def _delta(d: Delta) -> dict[str, Any]:
    if d.tool_call is not None:
        return {"tool_calls": [d.tool_call.to_openai()]}
    if d.reasoning_content is not None:
        return {"reasoning_content": d.reasoning_content}
    return {"content": d.content}


def _backend_error(e: Exception) -> APIError:
    if isinstance(e, ContextLengthExceeded):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, TransientBackendError):
        return APIError(503, f"The backend is temporarily unavailable: {e}", type="server_error")
    log.error("backend error: %s", e)
    return APIError(500, "The backend failed while answering this request.", type="server_error")


class _ExtraGauges:
    """A Prometheus collector over a hook's numbers, read at scrape time."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        for name, value in self.read().items():
            yield GaugeMetricFamily(f"clawbridge_{name}", name.replace("_", " "), value=float(value))

    def describe(self) -> list[Any]:
        return []  # values appear at scrape time; nothing to check at registration


class Metrics:
    """Prometheus exposition on a registry of its own (several apps may live in one process)."""

    def __init__(self, proxy: Proxy) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self._by_status: dict[int, Any] = {}
        self.requests = Counter(
            "clawbridge_requests", "Chat completion requests by status", ["status"], registry=self.registry
        )
        self.latency = Histogram(
            "clawbridge_request_seconds", "Time to the response headers (stream) or body",
            registry=self.registry,
        )
        c = proxy.counters
        for name, doc, fn in (
            ("clawbridge_in_flight", "Requests being answered", lambda: c.in_flight),
            ("clawbridge_turns_recorded", "Turns committed to the store", lambda: c.turns_recorded),
            ("clawbridge_record_failures", "Turns the store failed to write", lambda: c.record_failures),
            ("clawbridge_completion_tokens", "Tokens generated", lambda: c.completion_tokens),
            ("clawbridge_sessions_open", "Sessions being tracked", lambda: len(proxy.sessions)),
            ("clawbridge_policy_version", "Newest policy version", lambda: proxy.backend.version),
        ):
            Gauge(name, doc, registry=self.registry).set_function(fn)
        if proxy.hooks.metrics_extra is not None:
            self.registry.register(_ExtraGauges(proxy.hooks.metrics_extra))

    def observe(self, status: int, seconds: float) -> None:
        child = self._by_status.get(status)
        if child is None:  # `labels()` costs a lock and a tuple lookup: once per status
            child = self._by_status[status] = self.requests.labels(str(status))
        child.inc()
        self.latency.observe(seconds)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# --- routes ---------------------------------------------------------------------------------


def _json(obj: Any, status: int = 200) -> Response:
    return Response(wire.dumps(obj), status_code=status, media_type="application/json")


def create_app(
    settings: Settings,
    backend: Backend,
    store: Store,
    hooks: ProxyHooks | None = None,
    renderer: Renderer | None = None,
    surfaces: Sequence[Callable[[Proxy, Metrics], Sequence[BaseRoute]]] = (),
) -> Starlette:
    """The ASGI app. `hooks.routes` are mounted beside the OpenAI routes; each of `surfaces`
    gives the routes of another wire format over the same admission and capture
    (`clawbridge.server.SURFACES`: /v1/responses, /v1/messages, /v1/completions)."""
    if renderer is None:
        renderer = Renderer(backend.tokenizer())
    proxy = Proxy(settings, backend, store, renderer, hooks)
    metrics = Metrics(proxy)

    async def chat(request: Request) -> Response:
        proxy.counters.requests += 1
        proxy.counters.in_flight += 1
        t0 = time.perf_counter()
        status = 200
        streaming = False
        d: Draft | None = None
        try:
            proxy.check_auth(request)
            req, d = await proxy.admit(request, await proxy.read_body(request))
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                resp = await proxy.stream(d, include_usage)
                streaming = True  # the response counts itself out when it ends (_stream_closed)
                return resp
            return await proxy.complete(d, req.n, request)
        except APIError as e:
            status = e.status
            raise
        except BackendError as e:
            err = _backend_error(e)
            status = err.status
            raise err from None
        finally:
            if not streaming:
                proxy.counters.in_flight -= 1
                if d is not None:  # failed before its turn was written
                    proxy.attach_next_state(d)
            metrics.observe(status, time.perf_counter() - t0)

    async def models(request: Request) -> Response:
        proxy.check_auth(request)
        return _json(
            {
                "object": "list",
                "data": [proxy.model_card()],
            }
        )

    async def healthz(request: Request) -> Response:
        return _json({"status": "ok", "version": backend.version})

    async def status(request: Request) -> Response:
        proxy.check_auth(request)
        return _json(await proxy.status())

    async def session_done(request: Request) -> Response:
        proxy.check_auth(request)
        sid = request.path_params["sid"]
        known = await proxy.close_session(sid, "client")
        return _json({"id": sid, "object": "session", "done": True, "known": known})

    async def prometheus(request: Request) -> Response:
        proxy.check_auth(request)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        if exc.status >= 500:
            proxy.counters.errors_5xx += 1
        else:
            proxy.counters.errors_4xx += 1
        return _json(exc.body(), exc.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        proxy.counters.errors_4xx += 1
        code = "not_found" if exc.status_code == 404 else None
        return _json(wire.error_body(str(exc.detail), "invalid_request_error", None, code), exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientDisconnect):  # the client left; no error of ours, nobody to answer
            log.info("client left during %s", request.url.path)
            return Response(status_code=499)
        proxy.counters.errors_5xx += 1
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return _json(wire.error_body("The server had an error while processing your request.", "server_error"), 500)

    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/s/{session_id}/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/s/{session_id}/v1/models", models, methods=["GET"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/v1/sessions/{sid}/done", session_done, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        *(route for surface in surfaces for route in surface(proxy, metrics)),
        *(hooks.routes if hooks else []),
    ]
    app = _App(
        chat,
        routes=routes,
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error},
    )
    # `/v1/chat/completions/` is a 404 like any unknown path, not a 307 to the route: a redirect
    # of a POST sends the body twice and most clients do not follow it anyway.
    app.router.redirect_slashes = False
    app.state.proxy = proxy
    return app


class _App(Starlette):
    """Starlette, with `POST /v1/chat/completions` dispatched before the middleware stack.

    Every request to the other routes passes the error middleware, the exception middleware, the
    router and a route match: a coroutine frame each, about a tenth of a short chat request's
    CPU. The chat route goes straight to its endpoint, and its errors to the same handlers the
    stack would pick (APIError, HTTPException, anything else)."""

    def __init__(self, chat: Callable[[Request], Awaitable[Response]], **kw: Any) -> None:
        super().__init__(**kw)
        self._chat = chat

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions" or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            response = await self._chat(request)
        except Exception as exc:
            response = await self._handle(request, exc)
        await response(scope, receive, send)

    async def _handle(self, request: Request, exc: Exception) -> Response:
        handlers = self.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers:
                response = handlers[cls](request, exc)
                return await response if inspect.isawaitable(response) else response
        raise exc
