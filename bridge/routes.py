"""The learning loop's HTTP routes, registered on the proxy by the composition root: the wire
format and errors are serving's, the work is learning's, and neither room imports the other.

    POST /v1/feedback         {"session_id", "turn_id", "reward", "hint"}   (learning.feedback)
    POST /v1/admin/rollback   {"version": K}                                (learning.learner)
    GET  /v1/preferences[?user=], POST /v1/admin/preferences/{n}/confirm|forget (learning.standing)
    POST /v1/groups, GET /v1/groups/{id}, POST /v1/groups/{id}/close,
    POST /v1/episodes/{id}/outcome                                          (learning.episodes)
    DELETE /v1/admin/users/{name}                                           (store.users)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from clawbridge.learning import standing
from clawbridge.learning.feedback import FeedbackRejected, FeedbackRequest, record_feedback
from clawbridge.learning.preferences import PreferenceRefused
from clawbridge.protocol import BackendError, TransientBackendError, UnknownVersion
from clawbridge.serving import users, wire
from clawbridge.serving.durable import Dropped
from clawbridge.serving.wire import APIError
from clawbridge.store import EpisodeError, EpisodeRow, GroupRow, NewEpisode
from clawbridge.store.writer import unavailable
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from clawbridge.learning.learner import Learner
    from clawbridge.serving.proxy import Proxy
    from clawbridge.store import Store

log = logging.getLogger(__name__)


Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, model: type[Body], what: str) -> Body:
    """A route's JSON body as `model`; anything else is an OpenAI-style 400 naming `what`."""
    try:
        return model.model_validate(wire.json_object(await request.body()))
    except ValidationError as e:
        raise wire.invalid(e, what) from None


def parse_feedback(raw: bytes, header_session: str | None) -> FeedbackRequest:
    body = wire.json_object(raw)
    if header_session and "session_id" not in body:
        body["session_id"] = header_session
    try:
        return FeedbackRequest.model_validate(body)
    except ValidationError as e:
        raise wire.invalid(e, "feedback") from None


def feedback_route(wake: asyncio.Event | None = None) -> Route:
    async def feedback(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        proxy.check_auth(request)
        fb = parse_feedback(await request.body(), request.headers.get("x-session-id"))
        await check_feedback_owner(proxy, request, fb)
        durable = proxy.durable
        if durable.spooling:  # its turn may be in the spool: it waits there, in order
            return _json(spool_feedback(proxy, fb), 202)
        try:
            async with asyncio.timeout(durable.cfg.write_timeout_s):
                out = await record_feedback(proxy.store, proxy.settings.training.method, fb)
        except FeedbackRejected as e:
            raise APIError(e.status, str(e), param=e.param, code=e.code) from None
        except Exception as e:
            if not unavailable(e):
                raise
            durable.down(e)
            return _json(spool_feedback(proxy, fb), 202)
        if wake is not None:
            wake.set()
        return Response(json.dumps(out), media_type="application/json")

    return Route("/v1/feedback", feedback, methods=["POST"])


async def check_feedback_owner(proxy: Proxy, request: Request, fb: FeedbackRequest) -> None:
    """A user's key (or a request naming its user) gives feedback on that user's turns only: the
    session it names, and the session of the turn it names, must be theirs (`Proxy.check_owner`).
    A turn of another user is answered as a turn that does not exist."""
    if fb.session_id is not None:
        await proxy.check_owner(request, fb.session_id)
    user = proxy.keys.named(request)
    if fb.turn_id is not None and user is not None:
        try:
            owner = (await proxy.store.run(proxy.store.turn_users, [fb.turn_id])).get(fb.turn_id)
        except Exception as e:
            if not unavailable(e):
                raise
            owner = None  # the store is down: the feedback spools, and its replay finds its turn
        if owner is not None and owner != user:
            raise APIError(404, f"No turn `{fb.turn_id}`.", param="turn_id", code="not_found")


def spool_feedback(proxy: Proxy, fb: FeedbackRequest) -> dict[str, Any]:
    """Spool a feedback while the store cannot take it, its turn resolved now (the session's
    last main turn as this proxy answered it); answered 202, replayed after its turn."""
    durable = proxy.durable
    turn_id = fb.turn_id or (durable.last_spooled_main(fb.session_id) if fb.session_id else None)
    known = durable.spooled_turn(turn_id) if turn_id else None
    session_id = fb.session_id
    if known is not None:
        if session_id is not None and known[0] != session_id:
            raise APIError(404, f"No turn `{turn_id}`.", param="turn_id", code="not_found")
        if not known[1]:
            raise APIError(400, f"Turn `{turn_id}` opted out of training (X-Train: false).", param="turn_id")
        session_id = known[0]
    data = {"feedback": fb.model_copy(update={"turn_id": turn_id}).model_dump(mode="json"),
            "method": proxy.settings.training.method}
    if durable.append("feedback", data) == "lost":
        raise APIError(503, "The store is down and the spool full: the feedback was not recorded.",
                       type="server_error", code="store_unavailable")
    return {"object": "feedback", "state": "spooled", "session_id": session_id, "turn_id": turn_id,
            "reward": fb.reward, "hint": fb.hint, "sample": None}


async def replay_feedback(store: Store, data: dict[str, Any]) -> None:
    """A spooled feedback, replayed in its place in the spool's order (its turn before it)."""
    try:
        await record_feedback(store, data["method"], FeedbackRequest.model_validate(data["feedback"]), replay=True)
    except FeedbackRejected as e:
        raise Dropped(str(e)) from None


# what a spool replays beside the capture path's writes (`serving.durable`)
SPOOL_HANDLERS = {"feedback": replay_feedback}


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, description="The published version whose weights to serve again (0: the base model).")
    user: str | None = Field(None, description="Whose lineage: the version must be theirs; for v0, whose adapter starts again from the base (default: the version's owner, and for v0 the default user).")


def rollback_route(learner: Learner) -> Route:
    """`POST /v1/admin/rollback {"version": K, "user"?: NAME}`: publish vK's weights as the next
    version of its owner's lineage (v0: the named user's, else the default user's)."""

    async def rollback(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        users.require_admin(proxy.check_auth(request))
        body = await read_body(request, RollbackRequest, "rollback")
        try:
            who = users.checked_name(body.user, "user") if body.user is not None else None
            rb = await learner.rollback(proxy.backend, proxy.store, body.version, who)
        except UnknownVersion as e:
            raise APIError(404, str(e), param="version", code="version_not_found") from None
        except TransientBackendError as e:
            raise APIError(503, f"The backend is temporarily unavailable: {e}", type="server_error") from None
        except BackendError as e:
            log.error("rollback to v%d failed: %s", body.version, e)
            raise APIError(500, f"The rollback failed: {e}", type="server_error") from None
        out = {"object": "policy.rollback", "version": rb.version, "restored": rb.restored,
               "previous": rb.previous, "path": rb.path, "checkpoint": rb.checkpoint}
        return Response(json.dumps(out), media_type="application/json")

    return Route("/v1/admin/rollback", rollback, methods=["POST"])


# --- preferences (learning.standing) ------------------------------------------------------------
def preference_routes(learner: Learner | None = None) -> list[Route]:
    """Each user's preferences: the list, and confirming (applied at once) or forgetting one (its
    instruction stops at once, its samples not trained yet are dropped once no training step runs
    (the learner's lock), and the rollback to the version before it is offered). A user's key
    lists its own with the instruction it is served; the operator lists one user's (`?user=`) or
    everyone's, each naming its user. Confirming and forgetting are the operator's: a preference's
    number names one user's, and only that user's preferences change."""

    async def listing(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        caller = proxy.check_auth(request)
        asked = request.query_params.get("user")
        if caller.user is not None and asked not in (None, caller.user):
            raise APIError(403, f"This API key is {caller.user!r}'s: it lists that user's preferences only.",
                           param="user", code="user_mismatch")
        user = caller.user or (users.checked_name(asked, "user") if asked is not None else None)
        if user is not None:
            prefs = await proxy.store.run(proxy.store.preferences, user)
            return _json({"object": "list", "user": user, "data": [standing.view(p) for p in prefs],
                          "instruction": proxy.standing.served_to(user)})
        prefs = await proxy.store.run(proxy.store.all_preferences)
        served = {u: text for u in dict.fromkeys(p.user for p in prefs) if (text := proxy.standing.served_to(u))}
        return _json({"object": "list", "data": [standing.view(p) for p in prefs],
                      "instruction": proxy.standing.served, "instructions": served})

    async def act(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        users.require_admin(proxy.check_auth(request))
        user = request.query_params.get("user")  # given: the preference must be that user's
        out = await preference_action(proxy, request.path_params["action"], request.path_params["pid"],
                                      learner.lock if learner is not None else None,
                                      users.checked_name(user, "user") if user is not None else None)
        return _json(out)

    return [Route("/v1/preferences", listing, methods=["GET"]),
            Route("/v1/admin/preferences/{pid}/{action}", act, methods=["POST"])]


async def preference_action(proxy: Proxy, action: str, pid: Any, lock: asyncio.Lock | None = None,
                            user: str | None = None) -> dict[str, Any]:
    """Confirm or forget preference `pid`, `user`'s (None: whoever's it is); OpenAI-style errors."""
    if action not in standing.ACTIONS:
        raise APIError(404, f"No action `{action}`: confirm or forget.", code="not_found")
    try:
        pref_id = int(pid)
    except (TypeError, ValueError):
        raise APIError(400, f"The preference must be a number, got {pid!r}.", param="id", code="invalid_value") from None
    try:
        out = await standing.act(proxy.store, action, pref_id, proxy.version_for(user), proxy.standing.refresh, lock,
                                 user)
    except KeyError:
        whose = f" of {user!r}'s" if user else ""
        raise APIError(404, f"No preference {pref_id}{whose}.", param="id", code="preference_not_found") from None
    except PreferenceRefused as e:
        raise APIError(409, str(e), param="id", code="preference_refused") from None
    return {**out, "instruction": proxy.standing.served_to(out["user"])}  # what its user is served now


# --- users: deleting one user's data (store.users) ------------------------------------------------
def user_routes(learner: Learner | None = None) -> list[Route]:
    """`DELETE /v1/admin/users/{name}`: delete the user's sessions, all that hangs off them and
    their preferences (`store.users`); the operator's only. It runs once no training step runs
    (the learner's lock: a batch in training never loses a sample under it); then the proxy
    forgets the user's open sessions and stops serving their preferences, and their own adapter
    (trained on what was deleted) starts again from the base model: a copy of v0 serves them
    (`adapter_reset`). 404 when the store holds nothing of the user's."""

    async def delete(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        users.require_admin(proxy.check_auth(request))
        name = users.checked_name(request.path_params["name"], "name")
        async with learner.lock if learner is not None else contextlib.nullcontext():
            deleted = await proxy.store.run(proxy.store.delete_user, name)
        proxy.sessions.close_user(name)
        await proxy.standing.refresh()
        if not deleted.total:
            raise APIError(404, f"The store holds no data of user {name!r}.", param="name", code="user_not_found")
        log.info("deleted user %s's data: %s", name, deleted.rows)
        out = deleted.as_json()
        lineages = learner.parts.lineages if learner is not None and learner.parts is not None else None
        if lineages is not None and lineages.per_user and proxy.version_for(name) != 0:
            # their adapter learned from what was deleted: it starts again from the base model
            rb = await learner.rollback(proxy.backend, proxy.store, 0, name)  # type: ignore[union-attr]
            out["adapter_reset"] = {"version": rb.version, "was": rb.previous}
            log.info("user %s's adapter starts again from the base model (v%d)", name, rb.version)
        return _json(out)

    return [Route("/v1/admin/users/{name}", delete, methods=["DELETE"])]


# --- groups and episodes (learning.episodes trains them) ----------------------------------------
class GroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(ge=1, le=256, description="Episodes (attempts at the task) in the group.")
    task: Any = Field(None, description="What the episodes attempt, kept with the group (any JSON).")
    id: str | None = Field(None, min_length=1, max_length=128, description="The group's id; default: a new one.")


class OutcomeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    outcome: float = Field(allow_inf_nan=False, description="The episode's outcome reward (e.g. tests passed / total).")


def _episode_json(e: EpisodeRow) -> dict[str, Any]:
    return {"object": "episode", "id": e.id, "group_id": e.group_id, "index": e.idx, "session_id": e.session_id,
            "turn_id": e.turn_id, "state": e.state, "outcome": e.outcome, "reason": e.reason}


def group_json(g: GroupRow) -> dict[str, Any]:
    return {"object": "group", "id": g.id, "task": g.task, "n": g.size, "state": g.state, "reason": g.reason,
            "episodes": [_episode_json(e) for e in g.episodes]}


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(json.dumps(body), status_code=status, media_type="application/json")


async def _check_yours(proxy: Proxy, request: Request, what: str, session_ids: Sequence[str]) -> None:
    """A user's key (or a request naming its user) reaches a group or episode only where none of
    its sessions is another user's; otherwise it is answered as one that does not exist."""
    user = proxy.keys.named(request)
    for sid in session_ids if user is not None else ():
        if await proxy.session_owner(sid) not in (None, user):
            raise APIError(404, f"No {what}.", code="not_found")


def _episode_error(e: EpisodeError) -> APIError:
    return APIError(e.status, str(e), code="not_found" if e.status == 404 else "episode_conflict")


def episode_routes(wake: asyncio.Event | None = None) -> list[Route]:
    """The routes of groups and episodes (docs/agents.md):

    POST /v1/groups                      {"n": 4, "task": ...}  -> the group and its episodes
    GET  /v1/groups/{id}                 the group, every episode's state, outcome and reason
    POST /v1/groups/{id}/close           no more outcomes: open episodes expire (with the reason)
    POST /v1/episodes/{id}/outcome       {"outcome": 0.75}; `id` may be a choice's turn id

    An episode's requests carry its id as their session (`X-Session-Id`, or `/s/{id}/v1/...`)."""

    async def open_group(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        proxy.check_auth(request)
        body = await read_body(request, GroupRequest, "group")
        gid = body.id or f"grp-{os.urandom(8).hex()}"
        wire.session_id(gid, "id")
        eps = [NewEpisode(id=(eid := f"ep-{os.urandom(8).hex()}"), session_id=eid) for _ in range(body.n)]
        try:
            g = await proxy.store.run(proxy.store.open_group, gid, eps, body.task)
        except EpisodeError as e:
            raise _episode_error(e) from None
        return _json(group_json(g), 201)

    async def get_group(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        proxy.check_auth(request)
        g = await proxy.store.run(proxy.store.get_group, request.path_params["gid"])
        if g is None:
            raise APIError(404, f"No group `{request.path_params['gid']}`.", code="not_found")
        await _check_yours(proxy, request, f"group `{g.id}`", [e.session_id for e in g.episodes])
        return _json(group_json(g))

    async def close_group(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        proxy.check_auth(request)
        mine = await proxy.store.run(proxy.store.get_group, request.path_params["gid"])
        if mine is not None:
            await _check_yours(proxy, request, f"group `{mine.id}`", [e.session_id for e in mine.episodes])
        try:
            g = await proxy.store.run(proxy.store.close_group, request.path_params["gid"])
        except EpisodeError as e:
            raise _episode_error(e) from None
        for ep in g.episodes:
            if ep.turn_id is None:
                await proxy.close_session(ep.session_id, "group closed")
        if wake is not None:
            wake.set()
        return _json(group_json(g))

    async def outcome(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        proxy.check_auth(request)
        body = await read_body(request, OutcomeRequest, "outcome")
        mine = await proxy.store.run(proxy.store.get_episode, request.path_params["eid"])
        if mine is not None:
            await _check_yours(proxy, request, f"episode `{request.path_params['eid']}`", [mine.session_id])
        try:
            ep = await proxy.store.run(proxy.store.set_outcome, request.path_params["eid"], body.outcome)
        except EpisodeError as e:
            raise _episode_error(e) from None
        if ep.turn_id is None:  # the episode's conversation is over: its last turn has no next state
            await proxy.close_session(ep.session_id, "episode outcome")
        if wake is not None:
            wake.set()
        return _json(_episode_json(ep))

    return [
        Route("/v1/groups", open_group, methods=["POST"]),
        Route("/v1/groups/{gid}", get_group, methods=["GET"]),
        Route("/v1/groups/{gid}/close", close_group, methods=["POST"]),
        Route("/v1/episodes/{eid}/outcome", outcome, methods=["POST"]),
    ]
