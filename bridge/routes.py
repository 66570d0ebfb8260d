"""The learning loop's HTTP routes, registered on the proxy by the composition root: the wire
format and errors are serving's, the work is learning's, and neither room imports the other.

    POST /v1/feedback         {"session_id", "turn_id", "reward", "hint"}   (learning.feedback)
    POST /v1/admin/rollback   {"version": K}                                (learning.learner)
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from clawbridge.backends.base import BackendError, TransientBackendError, UnknownVersion
from clawbridge.learning.feedback import FeedbackRejected, FeedbackRequest, record_feedback
from clawbridge.serving import wire
from clawbridge.serving.wire import APIError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from clawbridge.learning.learner import Learner
    from clawbridge.serving.proxy import Proxy

log = logging.getLogger(__name__)


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
        try:
            out = await record_feedback(proxy.store, proxy.settings.method, fb)
        except FeedbackRejected as e:
            raise APIError(e.status, str(e), param=e.param, code=e.code) from None
        if wake is not None:
            wake.set()
        return Response(json.dumps(out), media_type="application/json")

    return Route("/v1/feedback", feedback, methods=["POST"])


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, description="The published version whose weights to serve again (0: the base model).")


def rollback_route(learner: Learner) -> Route:
    """`POST /v1/admin/rollback {"version": K}`: publish vK's weights as the next version."""

    async def rollback(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        proxy.check_auth(request)
        try:
            body = RollbackRequest.model_validate(wire.json_object(await request.body()))
        except ValidationError as e:
            raise wire.invalid(e, "rollback") from None
        try:
            rb = await learner.rollback(proxy.backend, proxy.store, body.version)
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
