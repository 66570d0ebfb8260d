"""What goes wrong, as the client sees it: backend errors mapped to API errors, and the
OpenAI-shaped answers for errors raised by the routes beside the wire formats (models, status,
the learning loop's routes). A wire format's own endpoint answers its errors in its own shape
(`pipeline.Endpoint`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from clawbridge.protocol import ContextLengthExceeded, TransientBackendError
from clawbridge.serving import wire
from clawbridge.serving.wire import APIError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

log = logging.getLogger(__name__)
SERVER_ERROR = "The server had an error while processing your request."


def backend_error(e: Exception) -> APIError:
    if isinstance(e, ContextLengthExceeded):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, TransientBackendError):
        return APIError(503, f"The backend is temporarily unavailable: {e}", type="server_error")
    log.error("backend error: %s", e)
    return APIError(500, "The backend failed while answering this request.", type="server_error")


def context_length_exceeded(ctx: int, tokens: int, param: str = "messages") -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {ctx} tokens. However, your messages "
        f"resulted in {tokens} tokens. Please reduce the length of the messages.",
        param=param,
        code="context_length_exceeded",
    )


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(wire.dumps(obj), status_code=status, media_type="application/json")


Handler = Callable[[Request, Exception], Awaitable[Response]]


def handlers(count: Callable[[int], None]) -> Mapping[Any, Handler]:
    """Starlette's exception handlers for every route that is not a wire format's endpoint;
    `count(status)` counts each error answered."""

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        count(exc.status)
        return json_response(exc.body(), exc.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        count(exc.status_code)
        code = "not_found" if exc.status_code == 404 else None
        return json_response(wire.error_body(str(exc.detail), "invalid_request_error", None, code), exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientDisconnect):  # the client left; no error of ours, nobody to answer
            log.info("client left during %s", request.url.path)
            return Response(status_code=499)
        count(500)
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return json_response(wire.error_body(SERVER_ERROR, "server_error"), 500)

    return {APIError: api_error, HTTPException: http_error, Exception: server_error}
