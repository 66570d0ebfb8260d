"""The proxy: what every wire format shares, from an admitted request to its stored turn.

    a wire format's request --validate (its own schema)--> Ask (a chat request, its field names)
    --Proxy.admit: tag + render (sessions, renderer), pin version K--> Draft
    --pipeline: sample / stream, parse--> Proxy.record: the turn, durable before the last byte

The proxy holds the state the routes share (sessions, counters, the store's writes in flight);
`pipeline` is the one loop that answers, each wire format (`chat_completions`, `responses`,
`anthropic`, `completions`) only its translation, `app` the ASGI app. Turns are written by the
store's group-commit writer; the response waits only for its own commit, so a turn whose answer a
client received survives a kill -9.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from clawbridge.chat.messages import PromptTooLong, RenderError
from clawbridge.chat.renderer import Renderer
from clawbridge.protocol import Backend, NamesItsDtype, SuggestsMaxTokens
from clawbridge.serving import instructing, users, wire
from clawbridge.serving.durable import Durable, Handler, SpoolConfig
from clawbridge.serving.errors import context_length_exceeded
from clawbridge.serving.sessions import (
    TAG_HEADERS,
    Admission,
    Lookup,
    NextState,
    SessionOfAnotherUser,
    Sessions,
    TurnTag,
    agent_housekeeping,
    read_tag,
)
from clawbridge.serving.wire import APIError
from clawbridge.store.continuation import Continuation
from clawbridge.store.records import DEFAULT_USER, JSONObject, TurnRecord, new_turn_id
from clawbridge.store.writer import unavailable
from clawbridge.types import Completion, SamplingParams
from starlette.requests import ClientDisconnect, Request
from starlette.routing import BaseRoute

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from clawbridge.store import Store

log = logging.getLogger(__name__)
# Bodies larger than this are parsed and tokenised off the event loop (an agent's usual request,
# tens of KB, renders in well under a millisecond from the prompt cache: a thread hop costs more).
OFF_LOOP_BYTES = 256 * 1024
T = TypeVar("T")


@dataclass
class ProxyHooks:
    """Where the learning loop plugs in: extra routes (e.g. POST /v1/feedback), a callback for
    every next state attached (the learner's wake-up), and extra fields for the status endpoint,
    the status line and /metrics."""

    routes: list[BaseRoute] = field(default_factory=list)
    on_next_state: Callable[[NextState], Awaitable[None] | None] | None = None
    status_extra: Callable[[], dict[str, Any]] | None = None
    # numeric gauges for /metrics (name -> value), read at every scrape (the learner's step metrics)
    metrics_extra: Callable[[], dict[str, float]] | None = None
    # how a spool replays the writes of other kinds that routes spool (a feedback)
    spool_handlers: Mapping[str, Handler] = field(default_factory=dict)


@dataclass
class Counters:
    requests: int = 0
    in_flight: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    turns_recorded: int = 0
    turns_spooled: int = 0  # written to the spool while the store could not take them
    record_failures: int = 0  # neither stored nor spooled: lost
    completion_tokens: int = 0

    def error(self, status: int) -> None:
        """Count an error answered with `status`."""
        if status >= 500:
            self.errors_5xx += 1
        else:
            self.errors_4xx += 1


@dataclass(frozen=True)
class Ask:
    """A request that passed its wire format's validation, in chat terms: what admission reads,
    whatever format it came in. `names` maps a chat field to the name the client's format gives
    it, so an error names the field the client sent; `prompt`: token ids taken as they are (a
    plain prompt), not rendered from `messages`."""

    req: wire.ChatRequest  # the sampling fields: model, n, stream, the budget, temperature, ...
    keys: dict[str, Any]  # clawbridge's session keys found in the body
    messages: list[dict[str, Any]]  # what is rendered and recorded
    tools: list[dict[str, Any]] | None
    request_params: dict[str, Any]
    size: int  # of the body in bytes: a large one is rendered off the event loop
    names: Mapping[str, str] = field(default_factory=dict)
    prompt: list[int] | None = None

    @classmethod
    def of(
        cls, req: wire.ChatRequest, keys: dict[str, Any], size: int, *,
        names: Mapping[str, str] | None = None, api: Mapping[str, Any] | None = None,
    ) -> Ask:
        """A chat request as it is rendered and recorded; `api`: what the turn records about the
        wire format it came in (e.g. `{"api": "responses"}`)."""
        messages, tools, params = req.dicts()
        return cls(req, keys, messages, tools, {**params, **(api or {})}, size, names or {})

    def name(self, chat_field: str) -> str:
        return self.names.get(chat_field, chat_field)


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
    # the ids its turns are written under, one per choice; empty: fresh ones. A wire format that
    # names its answer after its turn (a Responses API `resp_...`) chooses them at admission.
    turn_ids: Sequence[str] = ()
    instruction: str | None = None  # the user's standing preferences in its prompt (`instructing`)


class Proxy:
    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        store: Store,
        renderer: Renderer,
        hooks: ProxyHooks | None = None,
        *,
        spool: SpoolConfig,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store
        self.renderer = renderer
        self.hooks = hooks or ProxyHooks()
        self.sessions = Sessions(settings.serving.default_turn_type, settings.serving.session_idle_timeout_s)
        self.counters = Counters()
        self.model_name = settings.serving.served_model_name or backend.model_name
        self.started = time.time()
        self.keys = users.Keys.of(settings)  # who each API key is, whom a request names (`serving.users`)
        self.check_auth = self.keys.check  # the caller of a request by its key; a 401 without one
        self._background: set[asyncio.Task[Any]] = set()
        # the store's writes, or the spool while the store cannot take them (`durable`)
        self.durable = Durable(store, spool, landed=self._landed)
        self.durable.handlers.update(self.hooks.spool_handlers)
        self.standing = instructing.Standing(settings.serving.instant_preferences)  # the root sets its source
        self.lineages: users.UserVersions | None = None  # each user's own version (the root sets it)

    def version_for(self, user: str | None) -> int:  # what `user`'s request is served by: their own adapter's
        return self.backend.version if self.lineages is None else self.lineages.serving(user)

    # --- the edge ---------------------------------------------------------------------------

    async def restore_sessions(self) -> int:
        """At start: open conversations continue across a restart, rebuilt from the store's recent turns."""
        since = datetime.now(UTC) - timedelta(seconds=self.settings.serving.session_idle_timeout_s)
        turns = await self.store.run(self.store.open_session_turns, since)
        restored = self.sessions.restore(turns)
        if restored:
            log.info("restored %d open sessions (%d turns) from the store", restored, len(turns))
        return restored

    async def check_owner(self, request: Request, session_id: str) -> None:
        """For a route acting on a session: a user's key, or a request naming its user, reaches
        only that user's sessions; the operator naming nobody reaches every session."""
        user = self.keys.named(request)
        if user is not None and await self.session_owner(session_id) not in (None, user):
            raise users.not_yours(session_id)

    async def session_owner(self, session_id: str) -> str | None:
        """The user of a session, as this process or, for a session it does not hold open, the
        store knows it (None: a new session, or the store cannot say now)."""
        return self.sessions.owner(session_id) or await self.ask_store(self.store.session_user, session_id)

    async def ask_store(self, fn: Callable[..., T], *args: Any) -> T | None:
        """`fn(*args)` on the store; None when it cannot say (this proxy spools: the store is behind
        its memory, or down; or it did not answer in time): what this process knows decides then."""
        if self.durable.spooling:
            return None
        try:
            async with asyncio.timeout(self.durable.cfg.write_timeout_s):
                return await self.store.run(fn, *args)
        except Exception as e:  # the store unreachable is reported once, by the writes that spool
            log.log(logging.DEBUG if unavailable(e) else logging.ERROR,
                    "could not ask the store (%s); using this process's memory", fn.__name__, exc_info=True)
            return None

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.serving.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"Request body larger than {limit} bytes.", code="request_too_large")
        chunks, size = [], 0
        try:
            # a client that opens a body and never finishes it holds a connection: not for long
            async with asyncio.timeout(self.settings.serving.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"Request body larger than {limit} bytes.", code="request_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(
                408, f"The request body was not received within {self.settings.serving.body_timeout_s:g} s.",
                code="request_timeout",
            ) from None
        return b"".join(chunks)

    # --- admission --------------------------------------------------------------------------

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` for a body of `size` bytes: on a worker thread when the body is large.
        Parsing and tokenising megabytes takes seconds; on the event loop it would stall every
        other client (and /healthz) for as long."""
        if size > OFF_LOOP_BYTES:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def render(self, ask: Ask, cache: bool = True, instruction: str | None = None) -> tuple[list[int], str | None]:
        """The prompt's token ids, with `instruction` where it fits, and the instruction they carry
        (`cache=False`: without the renderer's cache, so it may run off the loop)."""
        ctx = self.backend.context_length
        try:
            return instructing.render(
                lambda ms: self.renderer.render(ms, ask.tools, ask.req.tool_choice, use_cache=cache, limit=ctx),
                ask.messages, instruction, ctx)
        except PromptTooLong as e:
            raise context_length_exceeded(ctx, e.tokens, ask.name("messages")) from None
        except RenderError as e:
            raise APIError(400, str(e), param=ask.name("messages")) from None
        except RecursionError:  # bounded at the door (wire.MAX_DEPTH); never a 500
            raise APIError(400, "The request is nested too deeply.", code="invalid_value") from None

    async def admit(self, request: Request, ask: Ask) -> Draft:
        """Everything that can reject a request happens here, before any state changes."""
        if self.durable.refusing:  # the operator chose durability over availability (spool_full)
            raise APIError(503, "The store is down and the spool full: try again later.",
                           type="server_error", code="store_unavailable")
        req = ask.req
        tag = self._tag(request, ask)
        if tag.session_id is not None:  # a session is its opener's: another user naming it is refused
            owner = await self.session_owner(tag.session_id)
            if tag.user is not None and owner not in (None, tag.user):
                raise users.not_yours(tag.session_id)
            tag = dataclasses.replace(tag, user=tag.user or owner)
        instruction = None if ask.prompt is not None else instructing.chosen(  # the user's own preferences
            ask.messages, tag.turn_type or self.sessions.default_turn_type, request.headers.get(instructing.HEADER),
            self.standing.enabled, self.standing.of(tag.user or DEFAULT_USER))
        if ask.prompt is not None:
            prompt = ask.prompt
        else:
            big = ask.size > OFF_LOOP_BYTES
            prompt, instruction = await self.off_loop(ask.size, self.render, ask, not big, instruction)
        if req.model != self.model_name:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )
        if req.stream and req.n > 1:
            raise APIError(400, "n > 1 is supported without streaming only.", param="n")
        messages = ask.messages
        ctx = self.backend.context_length
        if len(prompt) >= ctx:
            raise context_length_exceeded(ctx, len(prompt), ask.name("messages"))
        which = ask.name("max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        wanted = req.max_completion_tokens or req.max_tokens or self.settings.serving.default_max_tokens
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
            temperature=self.settings.serving.default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop=req.stops(),
            stop_token_ids=tuple(self.renderer.stop_token_ids),
            seed=req.seed,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        )
        look = self.sessions.lookup(messages)
        found = await self._continuation(tag, look) if self.store.shared else None
        try:
            adm = self.sessions.admit(tag, look, found)
        except SessionOfAnotherUser as e:  # opened by another user while this request waited
            raise users.not_yours(e.session_id) from None
        return Draft(
            id=f"chatcmpl-{os.urandom(12).hex()}", created=int(time.time()), model=self.model_name,
            messages=messages, tools=ask.tools, prompt_ids=prompt, params=params,
            version=self.version_for(tag.user),  # pinned at admission: the user's own; the backend keeps it
            adm=adm, request_params=ask.request_params, logprobs=req.logprobs,
            t0=time.perf_counter(), next_state=adm.next_state, instruction=instruction,
        )

    def _tag(self, request: Request, ask: Ask) -> TurnTag:
        """What the request says of itself; an agent's housekeeping with no session is a side turn."""
        headers = {k: v for k in TAG_HEADERS if (v := request.headers.get(k)) is not None}
        if "x-session-id" in headers:
            headers["x-session-id"] = wire.session_id(headers["x-session-id"], "X-Session-Id") or ""
        path_sid = request.path_params.get("session_id")
        if path_sid is not None:
            path_sid = wire.session_id(path_sid, "session_id")
        try:
            tag = read_tag(headers, ask.keys, path_sid)
        except ValueError as e:
            raise APIError(400, str(e), param="turn_type") from None
        tag = dataclasses.replace(tag, user=self.keys.named(request, ask.req.user))
        if not tag.session_id and agent_housekeeping(ask.messages):  # no user is talking: side
            tag = dataclasses.replace(tag, turn_type="side")
        return tag

    async def _continuation(self, tag: TurnTag, look: Lookup) -> Continuation | None:
        """What the shared store knows of the conversation this request continues (several
        proxies on one store: docs/scale-out.md). None when the store cannot say: the request is
        admitted from this process's memory, as a single proxy admits it (`ask_store`)."""
        return await self.ask_store(self.store.continuation, tag.session_id, look.reply_keys, tag.user or DEFAULT_USER)

    def attach_next_state(self, d: Draft) -> None:
        """Write the next state this request carried for its session's previous turn (once): from
        `record`, just before the request's own turn (one group commit for both), and when the
        request ends (`pipeline.Endpoint`: a no-op unless it ended without a turn)."""
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
            out = await self.durable.next_state(ns.turn_id, ns.session_id, list(ns.messages), ns.matched)
        except Exception:
            log.exception("could not attach the next state of %s", ns.turn_id)
            return
        if out == "stored" and self.hooks.on_next_state is not None:
            res = self.hooks.on_next_state(ns)
            if asyncio.iscoroutine(res):
                await res

    async def _landed(self, kind: str, data: JSONObject) -> None:
        """A spooled write reached the store: a next state wakes the learner as it would have."""
        if kind == "next_state" and self.hooks.on_next_state is not None:
            ns = NextState(data["turn_id"], data["session_id"], tuple(data["messages"]), data["matched"])
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
        keys = self.sessions.reply_keys(d.adm, replies)
        recs = [
            TurnRecord(
                session_id=d.adm.session_id, messages=d.messages, tools=d.tools,
                prompt_ids=tuple(d.prompt_ids), completion_ids=c.tokens, logprobs=c.logprobs,
                top_logprobs=c.top_logprobs, version=c.version, finish_reason=fin, response=reply,
                request_params=d.request_params, sampling=d.params, turn_type=d.adm.turn_type,
                tagged=not d.adm.untagged, train=d.adm.train, session_source=d.adm.source,
                ttft_ms=ttft_ms, total_ms=total_ms,
                id=d.turn_ids[i] if i < len(d.turn_ids) else new_turn_id(),
                prompt_key=d.adm.fps[-1] if d.adm.fps else None, reply_key=keys[i], instruction=d.instruction,
                user=d.adm.user,
            )
            for i, (c, reply, fin) in enumerate(zip(comps, replies, finishes, strict=True))
        ]
        self.attach_next_state(d)
        try:
            # one turn without gather's tasks: every answer waits for this
            outs = [await self.durable.turn(recs[0])] if len(recs) == 1 else \
                list(await asyncio.gather(*(self.durable.turn(r) for r in recs)))
            self.counters.turns_recorded += outs.count("stored")
            self.counters.turns_spooled += outs.count("spooled")
            self.counters.record_failures += outs.count("lost")
        except Exception:
            self.counters.record_failures += len(recs)
            log.exception("could not record turn(s) of %s", d.id)
        if len(recs) > 1 and d.adm.turn_type == "main" and d.adm.train:
            await self._open_choice_group(d, [r.id for r in recs])
        self.sessions.complete(d.adm, [r.id for r in recs], replies, keys)
        if d.adm.done:
            await self.close_session(d.adm.session_id, "client")

    async def _open_choice_group(self, d: Draft, turn_ids: list[str]) -> None:
        """The n choices of one request are a group (its id is the completion's id): each is an
        episode of one turn, addressed by its turn id, trained once the client reports outcomes
        (`POST /v1/episodes/{turn_id}/outcome`) and closes the group or they time out."""
        try:
            await self.durable.choice_group(d.id, d.adm.session_id, turn_ids)
        except Exception:
            log.exception("could not open the group of %s", d.id)

    async def close_session(self, session_id: str, reason: str) -> bool:
        known = self.sessions.close(session_id)
        try:
            await self.durable.close_session(session_id, reason)
        except Exception:
            log.exception("could not close session %s", session_id)
        return known

    # --- sampling ---------------------------------------------------------------------------

    async def sample(self, d: Draft, n: int, request: Request | None = None) -> list[Completion]:
        """The n completions of a non-streamed answer. A client that leaves meanwhile stops the
        generation (as a stream's does) and ClientDisconnect is raised: nothing is recorded."""
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

    def logprobs(self, tokens: Sequence[int], lps: Sequence[float], top: Any) -> dict[str, Any]:
        dec = self.renderer.decode
        texts = [dec([t]) for t in tokens]
        alts = None
        if top:
            alts = [[(dec([a.token_id]), a.logprob) for a in row] for row in top]
        return wire.logprobs_content(texts, list(lps), alts)

    def model_card(self) -> dict[str, Any]:
        """The /v1/models entry. `max_model_len` (vLLM's name) and `suggested_max_tokens` let a
        client plan its prompts and budget for this server (`clawbridge openclaw install` does):
        a CPU engine suggests a short budget, since every token costs a decode step there."""
        own = self.backend.suggested_max_tokens if isinstance(self.backend, SuggestsMaxTokens) else None
        suggested = own or self.settings.serving.default_max_tokens
        return {
            "id": self.model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "clawbridge",
            "max_model_len": self.backend.context_length,
            "suggested_max_tokens": min(int(suggested), self.backend.context_length),
        } | ({"dtype": self.backend.dtype} if isinstance(self.backend, NamesItsDtype) else {})


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its body was read: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
