"""The page's routes (docs/ui.md lists them with their bodies):

    GET  /                     -> 307 to /ui
    GET  /ui                   the page (or, with a key and no session, the sign-in form: 401)
    POST /ui/login             form field `key` -> the session cookie, 303 to /ui
    POST /ui/logout            drops the cookie
    GET  /ui/static/{name}     the page's CSS and JS (shipped in the package)
    GET  /ui/api/now           serving and learning now, what is waiting, the change token, who reads
    GET  /ui/api/progress      versions with reactions, gate decisions, rollbacks; steps; hints
    GET  /ui/api/turns         ?before=CURSOR&limit=N&learning=1: the newest turns with verdicts
    GET  /ui/api/sessions/{id} ?after=INDEX&limit=N: one conversation
    POST /ui/api/rollback      {"version": K}: serve vK's weights again (the admin rollback; admin only)
    POST /ui/api/training      {"paused": true|false}: pause or resume training steps (admin only)
    POST /ui/api/preferences   {"id": N, "action": "confirm"|"forget"}: a preference applied or dropped

Data routes answer JSON and take the API key as a bearer header or the page's cookie. Whose
data they show is the key's (`viewer`): an admin key everyone's, or one user's with `?user=NAME`;
a user's key that user's alone (naming another is a 403; another user's session is a 404, as an
unknown one), and the actions that change everyone's serving (rollback, pause) are the admin's.
The page itself is static: it fills in every value with `textContent` and SVG text nodes, never markup,
and a Content-Security-Policy forbids inline script, so no conversation can run code in it.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from clawbridge.learning import standing
from clawbridge.serving.users import Caller, valid_name
from clawbridge.store import Preference, Store
from clawbridge.store.browse import BadCursor, Browse
from clawbridge.ui import auth
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

log = logging.getLogger(__name__)
JSON = dict[str, Any]

STATIC = {"app.js": "text/javascript", "app.css": "text/css", "index.html": "text/html", "login.html": "text/html"}
# Nothing but our own files: no inline script or style, no framing, no other origin.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
                    "referrer-policy": "no-referrer", "cache-control": "no-store"}
MAX_BODY = 4096
WRONG_KEY = b'<p class="bad">That is not this server\'s key.</p>'


class RouteError(Exception):
    """An action the board refuses: the HTTP status and an OpenAI-shaped message."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass
class Board:
    """What the page reads and acts on. `status(user)` is the live server's view (version
    serving, backend, model, learner), everyone's or `user`'s; `rollback` and `pause` are None
    where no server runs (read-only)."""

    store: Store
    # every key that opens the page with its caller (an admin key sees everyone's data, a user's
    # key that user's); None: the server takes no keys, and the page is open to whoever reaches
    # it (a loopback server), as the operator
    keys: auth.PageKeys | None
    status: Callable[[str | None], Awaitable[JSON]]
    rollback: Callable[[int], Awaitable[JSON]] | None = None
    pause: Callable[[bool], JSON] | None = None
    # (action, id, user): confirm or forget a preference, which must be `user`'s (None: anyone's)
    preference: Callable[[str, int, str | None], Awaitable[JSON]] | None = None
    poll_s: float = 2.0
    user: str | None = None  # the one user whose data this page shows (`clawbridge ui --user`)

    def __post_init__(self) -> None:
        self.browse = Browse(self.store)


@dataclass(frozen=True)
class Viewer:
    """Who reads the page (`caller`, by key) and whose data it shows (`user`; None: everyone's)."""

    caller: Caller
    user: str | None


def viewer(caller: Caller, asked: str | None, fixed: str | None = None) -> Viewer:
    """Whose data a page request shows: a user key's own user's; the one user the page is fixed
    to (`fixed`); else the user an admin names (`asked`, the query's `user`); else everyone's.
    Naming another user than the key's or the page's is a 403."""
    if asked is not None and not valid_name(asked):
        raise RouteError(400, "Invalid 'user': a user's name is 1 to 64 letters, digits, '.', '_', '@' or '-', "
                         "starting with a letter or digit.", "invalid_user", "user")
    own = {u for u in (caller.user, fixed) if u is not None}
    if len(own) > 1:
        raise RouteError(403, f"This page shows {fixed!r}'s data only, and this API key is another user's.",
                         "user_mismatch", "user")
    if own:
        [user] = own
        if asked not in (None, user):
            raise RouteError(403, f"This page shows {user!r}'s data only: drop 'user', or send the other "
                             "user's key.", "user_mismatch", "user")
        return Viewer(caller, user)
    return Viewer(caller, asked)


def require_admin(view: Viewer) -> None:
    if not view.caller.admin:
        raise RouteError(403, "This action needs an admin key; a user's key reaches only that user's own data.",
                         "admin_key_required")


def memo_key(name: str, user: str | None) -> str:
    """The name a read is kept under between two changes: everyone's, or one user's apart."""
    return name if user is None else f"{name}:{user}"


@cache
def asset(name: str) -> bytes:
    return resources.files("clawbridge.ui").joinpath("static", name).read_bytes()


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body), status_code=status, media_type="application/json",
                    headers={"cache-control": "no-store"})


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _json({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _page(name: str, status: int = 200, extra: dict[str, str] | None = None) -> Response:
    return Response(asset(name), status_code=status, media_type=STATIC[name],
                    headers={**SECURITY_HEADERS, **(extra or {})})


STATE_ORDER = {"applied": 0, "learned": 1, "heard": 2, "superseded": 3, "dropped": 4}


def preferences_view(known: Sequence[Preference]) -> list[JSON]:
    """The stored preferences with their state and why (learning.standing): the applied ones
    (served as an instruction now) first, then the learned, heard, superseded and dropped."""
    return sorted((standing.view(p) for p in known), key=lambda r: (STATE_ORDER.get(r["state"], 9), -r["count"]))


def _int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise RouteError(400, f"`{name}` must be an integer", "invalid_value", name) from None


async def _body(request: Request) -> JSON:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise RouteError(413, "the body is too large")
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise RouteError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise RouteError(400, "the body must be a JSON object")
    return body


def ui_routes(board_of: Callable[[Request], Board]) -> list[BaseRoute]:
    """The page's routes; `board_of(request)` gives the board (the live server's, or a fixed one)."""

    def guarded(fn: Callable[[Request, Board, Viewer], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            board = board_of(request)
            caller = auth.caller_of(request, board.keys)
            if caller is None:
                if board.keys is not None and auth.COOKIE in request.cookies and request.method not in auth.SAFE_METHODS:
                    return error(403, "A signed-in page sends `X-Clawbridge-UI: 1` with every action.", "missing_ui_header")
                return error(401, "Incorrect API key provided: send `Authorization: Bearer KEY`, or sign in at /ui.",
                             "invalid_api_key")
            try:
                view = viewer(caller, request.query_params.get("user") or None, board.user)
                return await fn(request, board, view)
            except RouteError as e:
                return error(e.status, str(e), e.code, e.param)
            except BadCursor as e:
                return error(400, str(e), "invalid_cursor")

        return endpoint

    async def root(request: Request) -> Response:
        return RedirectResponse("/ui", status_code=307)

    async def page(request: Request) -> Response:
        board = board_of(request)
        if auth.caller_of(request, board.keys) is None:
            return _page("login.html", 401)
        return _page("index.html")

    async def login(request: Request) -> Response:
        board = board_of(request)
        if board.keys is None:
            return RedirectResponse("/ui", status_code=303)
        raw = await request.body()
        given = urllib.parse.parse_qs(raw[:MAX_BODY].decode("utf-8", "replace")).get("key", [""])[0]
        key = auth.matching(given, board.keys)
        if key is None:
            log.warning("ui: a sign-in with a wrong key")
            body = asset("login.html").replace(b"<!--status-->", WRONG_KEY)
            return Response(body, status_code=401, media_type="text/html", headers=SECURITY_HEADERS)
        r = RedirectResponse("/ui", status_code=303)
        r.headers["set-cookie"] = auth.cookie_header(key, secure=request.url.scheme == "https")
        return r

    async def logout(request: Request) -> Response:
        r = RedirectResponse("/ui", status_code=303)
        r.headers["set-cookie"] = auth.clear_cookie_header()
        return r

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC or name.endswith(".html"):
            return error(404, f"No file `{name}`.", "not_found")
        return Response(asset(name), media_type=STATIC[name], headers=SECURITY_HEADERS)

    async def now(request: Request, board: Board, view: Viewer) -> Response:
        b, user, admin = board.browse, view.user, view.caller.admin
        status = await board.status(user)

        def read() -> JSON:
            token = b.token(user)
            out = {"token": token, "waiting": b.memo(memo_key("waiting", user), token, lambda: b.waiting(user))}
            if admin and board.user is None:  # the admin's user picker: a new user moves everyone's token
                everyone = token if user is None else b.token()
                out["users"] = b.memo("users", everyone, lambda: {"names": b.users()})["names"]
            return out

        read_now = await board.store.run(read)
        return _json({"status": status, "waiting": read_now["waiting"], "token": read_now["token"],
                      "poll_s": board.poll_s, "viewer": {"admin": admin, "user": user},
                      "users": read_now.get("users"),
                      "actions": {"rollback": board.rollback is not None and admin,
                                  "pause": board.pause is not None and admin,
                                  "preferences": board.preference is not None}})

    async def progress(request: Request, board: Board, view: Viewer) -> Response:
        b, user = board.browse, view.user

        def read() -> JSON:
            out = b.memo(memo_key("progress", user), b.token(user), lambda: b.progress(user))
            return {**out, "preferences": preferences_view(out["preferences"])}

        return _json(await board.store.run(read))

    async def turns(request: Request, board: Board, view: Viewer) -> Response:
        before = request.query_params.get("before") or None
        learning = request.query_params.get("learning", "") in ("1", "true")
        return _json(await board.store.run(board.browse.turns, before, _int(request, "limit", 30), learning, view.user))

    async def session(request: Request, board: Board, view: Viewer) -> Response:
        sid = request.path_params["sid"]
        out = await board.store.run(board.browse.conversation, sid, _int(request, "after", -1),
                                    _int(request, "limit", 50), view.user)
        if out is None:  # unknown, or another user's: the same answer, saying nothing of whose
            among = "" if view.user is None else f" among {view.user}'s sessions"
            raise RouteError(404, f"No session `{sid}`{among}.", "not_found", "session_id")
        return _json(out)

    async def rollback(request: Request, board: Board, view: Viewer) -> Response:
        require_admin(view)
        if board.rollback is None:
            raise RouteError(409, "No server is running on this data directory: the page is read-only.", "read_only")
        version = (await _body(request)).get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RouteError(400, "`version` must be a version number (0 or more)", "invalid_value", "version")
        return _json(await board.rollback(version))

    async def training(request: Request, board: Board, view: Viewer) -> Response:
        require_admin(view)
        if board.pause is None:
            raise RouteError(409, "No learning loop runs here: there is no training to pause.", "read_only")
        paused = (await _body(request)).get("paused")
        if not isinstance(paused, bool):
            raise RouteError(400, "`paused` must be true or false", "invalid_value", "paused")
        return _json(board.pause(paused))

    async def preference(request: Request, board: Board, view: Viewer) -> Response:
        if board.preference is None:
            raise RouteError(409, "No server is running on this data directory: the page is read-only.", "read_only")
        body = await _body(request)
        pid, action = body.get("id"), body.get("action")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid < 1:
            raise RouteError(400, "`id` must be a preference's number (1 or more)", "invalid_value", "id")
        if action not in standing.ACTIONS:
            raise RouteError(400, "`action` must be confirm or forget", "invalid_value", "action")
        return _json(await board.preference(action, pid, view.user))  # a user's key: their own only

    return [
        Route("/", root, methods=["GET"]),
        Route("/ui", page, methods=["GET"]),
        Route("/ui/login", login, methods=["POST"]),
        Route("/ui/logout", logout, methods=["POST"]),
        Route("/ui/static/{name}", static, methods=["GET"]),
        Route("/ui/api/now", guarded(now), methods=["GET"]),
        Route("/ui/api/progress", guarded(progress), methods=["GET"]),
        Route("/ui/api/turns", guarded(turns), methods=["GET"]),
        Route("/ui/api/sessions/{sid}", guarded(session), methods=["GET"]),
        Route("/ui/api/rollback", guarded(rollback), methods=["POST"]),
        Route("/ui/api/training", guarded(training), methods=["POST"]),
        Route("/ui/api/preferences", guarded(preference), methods=["POST"]),
    ]
