"""The boards the page reads: the running server's (`live_board`: the proxy's view of serving,
the learner's of learning, rollback and pause) and a data directory's with no server
(`offline_board`, for `clawbridge ui --data-dir`: read-only).

A board's status is everyone's, or one user's (`user`): what serves them (their own adapter's
version, their open conversations, the instruction made of their preferences) and how their
adapter trains, without the server's counters, everyone's learning figures or the cost."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawbridge.backends.costs import read_spend
from clawbridge.learning import standing
from clawbridge.learning.preferences import PreferenceRefused
from clawbridge.protocol import BackendError, TransientBackendError, UnknownVersion
from clawbridge.serving.users import Caller, Keys
from clawbridge.ui.routes import Board, RouteError
from starlette.applications import Starlette
from starlette.requests import Request

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from clawbridge.learning.learner import Learner
    from clawbridge.serving.proxy import Proxy
    from clawbridge.store import Store

JSON = dict[str, Any]
PAUSED_FROM_PAGE = "paused by the user (POST /ui/api/training)"


def spend(data_dir: Path) -> JSON | None:
    """The cost so far, where the backend keeps one (`costs.json`, as `clawbridge status`)."""
    try:
        return read_spend(data_dir / "costs.json")
    except (OSError, ValueError):
        return None


def learner_status(learner: Learner, user: str | None = None) -> JSON:
    """The learner as the page shows it; to one user, whether it trains and their own adapter's
    newest step and gate decision (`Learner.lineage_status`), not the figures of everyone's
    samples."""
    fields = {k: v if isinstance(v, int | float | str) else str(v) for k, v in learner.status().items()}
    out: JSON = {"fields": fields, "paused": learner.paused, "stopped": learner.training_stopped,
                 "errors": learner.errors, "busy": learner.lock.locked()}
    if user is not None:
        return {**out, "fields": learner.lineage_status(user)}
    if (d := learner.trainer.promotion.decisions[-1] if learner.trainer and learner.trainer.promotion.decisions else None) is not None:
        out["last_gate"] = d.record()
    return out


def _live(proxy: Proxy, learner: Learner | None) -> Board:
    settings = proxy.settings

    async def status(user: str | None) -> JSON:
        about: JSON = {"live": True, "model": proxy.model_name, "backend": proxy.backend.name,
                       "version": proxy.version_for(user), "uptime_s": round(time.time() - proxy.started, 1),
                       "learner": None if learner is None else learner_status(learner, user)}
        if user is not None:
            return {**about, "user": user, "sessions_open": proxy.sessions.open_of(user),
                    "instruction": proxy.standing.served_to(user)}  # their preferences served now
        c = proxy.counters
        return {**about, "requests": c.requests, "in_flight": c.in_flight, "errors_5xx": c.errors_5xx,
                "sessions_open": len(proxy.sessions), "spend": spend(settings.data_dir),
                "instruction": proxy.standing.served,  # the preferences served now to a request naming nobody
                "spool": proxy.durable.status()}

    async def rollback(version: int) -> JSON:
        assert learner is not None
        try:
            rb = await learner.rollback(proxy.backend, proxy.store, version)
        except UnknownVersion as e:
            raise RouteError(404, str(e), "version_not_found", "version") from None
        except TransientBackendError as e:
            raise RouteError(503, f"The backend is temporarily unavailable: {e}") from None
        except BackendError as e:
            raise RouteError(500, f"The rollback failed: {e}") from None
        return {"object": "policy.rollback", "version": rb.version, "restored": rb.restored,
                "previous": rb.previous, "path": rb.path, "checkpoint": rb.checkpoint}

    def pause(paused: bool) -> JSON:
        assert learner is not None
        learner.paused = PAUSED_FROM_PAGE if paused else None
        learner.ready.set()  # the train loop looks again: a resume trains a batch already waiting
        return {"object": "training", "paused": paused, "reason": learner.paused}

    async def preference(action: str, pref_id: int, user: str | None) -> JSON:
        try:
            out = await standing.act(proxy.store, action, pref_id, proxy.version_for(user), proxy.standing.refresh,
                                     learner.lock if learner is not None else None, user)
        except KeyError:
            whose = "" if user is None else f" of {user}'s"
            raise RouteError(404, f"No preference {pref_id}{whose}.", "preference_not_found", "id") from None
        except PreferenceRefused as e:
            raise RouteError(409, str(e), "preference_refused", "id") from None
        return {**out, "instruction": proxy.standing.served_to(out["user"])}  # its user's, from their next request on

    return Board(proxy.store, page_keys(proxy.keys), status,
                 rollback=rollback if learner is not None else None,
                 pause=pause if learner is not None else None,
                 preference=preference)


def live_board(learner: Learner | None) -> Callable[[Request], Board]:
    """The board of the server whose request this is (the proxy is the app's state, as for the
    learner's other routes); `learner` is None when training is off."""
    boards: dict[int, Board] = {}

    def board_of(request: Request) -> Board:
        proxy: Proxy = request.app.state.proxy
        board = boards.get(id(proxy))
        if board is None:
            board = boards[id(proxy)] = _live(proxy, learner)
        return board

    return board_of


def offline_board(settings: Settings, store: Store, user: str | None = None) -> Board:
    """A data directory with no server running: everything it recorded, no actions; `user`:
    that user's data alone, whoever opens it (`clawbridge ui --user`)."""

    async def status(shown: str | None) -> JSON:
        latest = await store.run(store.latest_version)
        about: JSON = {"live": False, "model": settings.model, "backend": settings.backend,
                       "version": latest.version if latest is not None else 0, "learner": None}
        if shown is not None:
            return {**about, "user": shown}
        return {**about, "data_dir": str(settings.data_dir), "spend": spend(settings.data_dir)}

    return Board(store, page_keys(Keys.of(settings)), status, user=user)


def page_keys(keys: Keys) -> tuple[tuple[str, Caller], ...] | None:
    """The keys that open the page, each with its caller, or None where the server takes no key."""
    return keys.entries if keys.required else None


def data_dir_app(settings: Settings, user: str | None = None) -> tuple[Starlette, Store]:
    """The page alone over a data directory's store (no model, no training): the app and the
    store it reads (close it when done); `user`: that user's data alone."""
    from clawbridge.store import Store
    from clawbridge.ui.routes import ui_routes

    store = Store.open(settings.db_url)
    board = offline_board(settings, store, user)
    return Starlette(routes=ui_routes(lambda _request: board)), store


def serve_data_dir(settings: Settings, host: str = "127.0.0.1", port: int = 30080,
                   started: Callable[[str], None] | None = None, user: str | None = None) -> None:
    """`clawbridge ui --data-dir DIR`: the page over a finished run (`make demo`'s), until Ctrl-C;
    `user`: that user's data alone. `started` gets the page's address once it listens."""
    import asyncio

    import uvicorn

    app, store = data_dir_app(settings, user)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started and started is not None:
            bound = server.servers[0].sockets[0].getsockname()[1]
            started(f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{bound}/ui")
        await task

    try:
        asyncio.run(run())
    finally:
        store.close()
