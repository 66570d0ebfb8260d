"""Who may see the page: the API's own rule, plus a sign-in a browser can use.

A browser cannot send a bearer header when it navigates, so with a key the page asks for it
once (`POST /ui/login`) and answers with an HttpOnly, SameSite=Strict cookie holding a token
derived from the key (HMAC-SHA256; the key itself never sits in the cookie jar, and changing
the key signs every browser out). Every data route takes the header too, as the API does.

Every key of the server opens the page (`serving.users`): its `api_key` and the keys file's
admin keys show everyone's data, a user's key that user's alone (`routes.viewer`). With several,
the cookie is the one of the key that signed in, and is that key's caller.

A state-changing request authenticated by the cookie must also carry `X-Clawbridge-UI: 1`:
SameSite treats other ports of the same host as the same site, and a page there could post a
form; a form cannot set a header, and a script that sets one needs a CORS preflight this server
never grants.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from clawbridge.serving.users import OPERATOR, Caller
from starlette.requests import Request

COOKIE = "clawbridge_ui"
UI_HEADER = "x-clawbridge-ui"
SAFE_METHODS = frozenset({"GET", "HEAD"})
PageKeys = Sequence[tuple[str, Caller]]  # every key that opens the page, with whose it is


def session_token(key: str) -> str:
    return hmac.new(key.encode(), b"clawbridge ui session v1", hashlib.sha256).hexdigest()


def key_matches(given: str, key: str) -> bool:
    return hmac.compare_digest(given.strip().encode(), key.encode())


def bearer_ok(request: Request, key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and key_matches(token, key)


def cookie_ok(request: Request, key: str) -> bool:
    got = request.cookies.get(COOKIE, "")
    if not got or not hmac.compare_digest(got.encode(), session_token(key).encode()):
        return False
    return request.method in SAFE_METHODS or request.headers.get(UI_HEADER) == "1"


def caller_of(request: Request, keys: PageKeys | None) -> Caller | None:
    """Who a page request is from. No keys (a loopback server): the operator, as for everyone on
    the machine. With them: the caller of the key the header or the cookie carries (each key
    compared in constant time, all of them every time); None: neither carries one."""
    if keys is None:
        return OPERATOR
    found = None
    for key, who in keys:
        if bearer_ok(request, key) or cookie_ok(request, key):
            found = who
    return found


def matching(given: str, keys: PageKeys) -> str | None:
    """The key among `keys` that `given` is (each compared in constant time), or None."""
    found = None
    for k, _who in keys:
        if key_matches(given, k):
            found = k
    return found


def cookie_header(key: str, secure: bool) -> str:
    parts = [f"{COOKIE}={session_token(key)}", "Path=/", "HttpOnly", "SameSite=Strict"]
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


def clear_cookie_header() -> str:
    return f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"
