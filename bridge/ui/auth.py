"""Who may see the page: the API's own rule, plus a sign-in a browser can use.

A browser cannot send a bearer header when it navigates, so with a key the page asks for it
once (`POST /ui/login`) and answers with an HttpOnly, SameSite=Strict cookie holding a token
derived from the key (HMAC-SHA256; the key itself never sits in the cookie jar, and changing
the key signs every browser out). Every data route takes the header too, as the API does.

The keys that open the page are the server's admin keys (`serving.users`): its `api_key` and
the keys file's admin keys; a user's key opens none of it. With several, the cookie is the one
of the key that signed in.

A state-changing request authenticated by the cookie must also carry `X-Clawbridge-UI: 1`:
SameSite treats other ports of the same host as the same site, and a page there could post a
form; a form cannot set a header, and a script that sets one needs a CORS preflight this server
never grants.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.requests import Request

COOKIE = "clawbridge_ui"
UI_HEADER = "x-clawbridge-ui"
SAFE_METHODS = frozenset({"GET", "HEAD"})


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


def authorized(request: Request, keys: Sequence[str] | None) -> bool:
    """No keys (a loopback server): everyone on the machine. With them: the header or the cookie
    of one of them."""
    return keys is None or any(bearer_ok(request, k) or cookie_ok(request, k) for k in keys)


def matching(given: str, keys: Sequence[str]) -> str | None:
    """The key among `keys` that `given` is (each compared in constant time), or None."""
    found = None
    for k in keys:
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
