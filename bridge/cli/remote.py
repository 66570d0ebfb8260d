"""A running server's admin routes asked from the command line: one request, its JSON body when
the server says 200, else `Refused` with the server's own error message (and a hint where the
key is missing or not an admin's), or why no server answered."""

from __future__ import annotations

from typing import Any


class Refused(Exception):
    """The server said no (`status`, its error `code`), or none answered (`status` 0; `timed_out`:
    one is there but did not answer in time)."""

    def __init__(self, message: str, status: int = 0, code: str | None = None, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.message, self.status, self.code, self.timed_out = message, status, code, timed_out


def admin_call(method: str, url: str, path: str, api_key: str | None, *, timeout: float,
               unreachable: str, params: dict[str, Any] | None = None,
               json: dict[str, Any] | None = None) -> dict[str, Any]:
    """`method` on `url` + `path` with the admin key; the JSON body of a 200. `unreachable` is
    what follows "no clawbridge server at URL:" when nothing listens there."""
    import httpx
    from clawbridge.sdk.client import root_url

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.request(method, root_url(url) + path, headers=headers, params=params, json=json, timeout=timeout)
    except httpx.ConnectError:
        raise Refused(f"no clawbridge server at {url}: {unreachable}") from None
    except httpx.TimeoutException:
        raise Refused(f"{url} did not answer within {timeout:.0f} s", timed_out=True) from None
    if r.status_code == 200:
        return dict(r.json())
    try:
        error = r.json()["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = r.text[:200], None
    hint = {401: " Pass the server's key with --api-key (or CLAWBRIDGE_API_KEY).",
            403: " Pass an admin key with --api-key (or CLAWBRIDGE_API_KEY)."}.get(r.status_code, "")
    raise Refused(message + hint, r.status_code, code)


__all__ = ["Refused", "admin_call"]
