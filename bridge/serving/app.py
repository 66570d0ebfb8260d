"""The ASGI app: the wire formats' endpoints, the small routes beside them (models, health,
status, metrics, ending a session) and the learning loop's routes from `ProxyHooks`.

A Starlette app with plain routes (no per-request dependency injection): the hop must cost about
as much as a minimal relay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from clawbridge.chat.renderer import Renderer
from clawbridge.protocol import Backend
from clawbridge.serving import chat_completions, errors, users
from clawbridge.serving.durable import SpoolConfig
from clawbridge.serving.errors import json_response
from clawbridge.serving.metrics import Metrics
from clawbridge.serving.metrics import status as metrics_status
from clawbridge.serving.pipeline import Endpoint
from clawbridge.serving.proxy import Proxy, ProxyHooks
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from clawbridge.store import Store

# Another wire format's routes over the same pipeline (`responses.routes`, `anthropic.routes`,
# `completions.routes`).
Surface = Callable[[Proxy, Metrics], Sequence[BaseRoute]]


def create_app(
    settings: Settings,
    backend: Backend,
    store: Store,
    hooks: ProxyHooks | None = None,
    renderer: Renderer | None = None,
    surfaces: Sequence[Surface] = (),
) -> Starlette:
    """The ASGI app: chat completions, and each of `surfaces` (`clawbridge.server.SURFACES`:
    /v1/responses, /v1/messages, /v1/completions); `hooks.routes` are mounted beside them."""
    if renderer is None:
        renderer = Renderer(backend.tokenizer())
    proxy = Proxy(settings, backend, store, renderer, hooks, spool=SpoolConfig.of(settings))
    metrics = Metrics(proxy)
    chat = chat_completions.endpoint(proxy, metrics)

    async def models(request: Request) -> Response:
        proxy.check_auth(request)
        return json_response({"object": "list", "data": [proxy.model_card()]})

    async def healthz(request: Request) -> Response:
        return json_response({"status": "ok", "version": proxy.version_for(None)})

    async def status(request: Request) -> Response:
        return json_response(await metrics_status(proxy, proxy.check_auth(request)))

    async def session_done(request: Request) -> Response:
        proxy.check_auth(request)
        sid = request.path_params["sid"]
        await proxy.check_owner(request, sid)
        known = await proxy.close_session(sid, "client")
        return json_response({"id": sid, "object": "session", "done": True, "known": known})

    async def prometheus(request: Request) -> Response:
        users.require_admin(proxy.check_auth(request))  # everyone's counters; never a label per user
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    routes: list[BaseRoute] = [
        *chat_completions.routes(chat),
        Route("/v1/models", models, methods=["GET"]),
        Route("/s/{session_id}/v1/models", models, methods=["GET"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/v1/sessions/{sid}/done", session_done, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        *(route for surface in surfaces for route in surface(proxy, metrics)),
        *(hooks.routes if hooks else []),
    ]
    app = _App(chat, routes=routes, exception_handlers=dict(errors.handlers(proxy.counters.error)))
    # `/v1/chat/completions/` is a 404 like any unknown path, not a 307 to the route: a redirect
    # of a POST sends the body twice and most clients do not follow it anyway.
    app.router.redirect_slashes = False
    app.state.proxy = proxy
    return app


class _App(Starlette):
    """Starlette, with `POST /v1/chat/completions` handed to its endpoint before the middleware
    stack. Every request to the other routes passes the error middleware, the exception
    middleware, the router and a route match: a coroutine frame each, about a tenth of a short
    chat request's CPU. The endpoint answers every error itself, so skipping the stack changes
    nothing else: the session-prefixed route reaches the same endpoint through it."""

    def __init__(self, chat: Endpoint, **kw: Any) -> None:
        super().__init__(**kw)
        self._chat = chat

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == chat_completions.PATH and scope["method"] == "POST":
            scope["app"] = self
            await self._chat(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)
