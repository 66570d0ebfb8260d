"""Explicit feedback for SDK users: `POST /v1/feedback` (DESIGN.md §5, issue 4 item 4).

    {"session_id": "...", "turn_id": null, "reward": 1, "hint": null}

A reward (-1, 0 or +1) and/or a hint for one turn: `turn_id`, or else the session's last main
turn. Stored as a judgment of kind `feedback` (judge `user`) with the request as its raw vote; the
collector lets it outrank the judges, used alongside them or instead (a turn with no next state
is trained from feedback alone). One feedback per turn: a second answers 409.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from clawbridge import wire
from clawbridge.store import JudgeVote, Judgment
from clawbridge.wire import APIError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from clawbridge.proxy import Proxy

USER_JUDGE = "user"


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(None, description="The session (or header X-Session-Id).")
    turn_id: str | None = Field(None, description="The turn; default: the session's last main turn.")
    reward: int | None = Field(None, ge=-1, le=1, description="-1, 0 or +1.")
    hint: str | None = Field(None, min_length=1, max_length=4000, description="What the answer should have done.")

    @model_validator(mode="after")
    def _something(self) -> FeedbackRequest:
        if self.reward is None and self.hint is None:
            raise ValueError("give a reward, a hint, or both")
        if self.session_id is None and self.turn_id is None:
            raise ValueError("give a session_id (or X-Session-Id) or a turn_id")
        return self


def parse(raw: bytes, header_session: str | None) -> FeedbackRequest:
    body = wire.json_object(raw)
    if header_session and "session_id" not in body:
        body["session_id"] = header_session
    try:
        return FeedbackRequest.model_validate(body)
    except ValidationError as e:
        raise wire.invalid(e, "feedback") from None


async def record_feedback(proxy: Proxy, fb: FeedbackRequest) -> dict[str, Any]:
    store = proxy.store
    if fb.turn_id is not None:
        turn = await store.run(store.get_turn, fb.turn_id)
        if turn is not None and fb.session_id is not None and turn.session_id != fb.session_id:
            turn = None
    else:
        assert fb.session_id is not None
        turn = await store.run(store.last_turn, fb.session_id, "main")
    if turn is None:
        what = f"turn `{fb.turn_id}`" if fb.turn_id else f"main turn in session `{fb.session_id}`"
        raise APIError(404, f"No {what}.", param="turn_id" if fb.turn_id else "session_id", code="not_found")
    if not turn.train:
        raise APIError(400, f"Turn `{turn.id}` opted out of training (X-Train: false).", param="turn_id")
    before = await store.run(store.judgments, turn.id)
    if any(j.kind == "feedback" and j.judge == USER_JUDGE for j in before):
        raise APIError(409, f"Turn `{turn.id}` already has feedback.", param="turn_id", code="duplicate_feedback")
    raw = fb.model_dump_json(exclude_none=True)
    value: float | str | None = fb.reward if fb.reward is not None else fb.hint
    await store.run(
        store.add_judgment,
        Judgment(
            turn_id=turn.id, judge=USER_JUDGE, kind="feedback",
            votes=(JudgeVote(raw=raw, value=value),),
            reward=None if fb.reward is None else float(fb.reward), hint=fb.hint,
        ),
    )
    method = proxy.settings.method
    sample_id, created = await store.run(store.create_sample, turn.id, method, state="pending")
    state = (await store.run(store.get_samples, [sample_id]))[0].state
    return {
        "object": "feedback",
        "session_id": turn.session_id,
        "turn_id": turn.id,
        "reward": fb.reward,
        "hint": fb.hint,
        "sample": {"id": sample_id, "method": method, "state": state, "new": created},
    }


def feedback_route(wake: asyncio.Event | None = None) -> Route:
    async def feedback(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        proxy.check_auth(request)
        fb = parse(await request.body(), request.headers.get("x-session-id"))
        out = await record_feedback(proxy, fb)
        if wake is not None:
            wake.set()
        return Response(json.dumps(out), media_type="application/json")

    return Route("/v1/feedback", feedback, methods=["POST"])
