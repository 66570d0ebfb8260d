"""Who a request is for: its caller (by API key) and the user it acts for.

    no key configured          the operator: the user `X-Session-User` names, else `default`
    the admin key (`api_key`)  the operator, the same way; and every admin route
    an admin key of the file   the same as `api_key`
    a user key of the file     that user, always: naming another one is a 403

The body's `user` field (OpenAI's, which many clients fill for abuse tracking, not to pick whose
data this is) names the user only where the operator trusts it (`trust_body_user`). A request
that names nobody is for `default`, so a single-user install is what it always was; one of the
operator's that names nobody but names a session is for that session's user (an agent's heartbeat
in a conversation, a client resuming a session by its id).

The keys file (`api_keys_file`, YAML or JSON) maps each key to a user name, or marks it admin:

    keys:
      sk-alice-5f2e...: alice
      sk-bob-91c0...: bob
      sk-ops-77aa...: {admin: true}

Keys are compared by their SHA-256 digests, so a lookup's timing says nothing about a key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from clawbridge.serving.wire import APIError
from starlette.requests import Request

if TYPE_CHECKING:
    from clawbridge.config import Settings

HEADER = "x-session-user"
_CALLER = "clawbridge.caller"  # where `Keys.check` keeps a request's caller on its scope
# Short, and safe wherever a user's name may go (a log line, a label, a directory name).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


@dataclass(frozen=True)
class Caller:
    """Who sent a request, by its key: `user`, the user a user key is fixed to (None: the
    operator, who may act for any user); `admin`, whether admin routes are open to it."""

    admin: bool
    user: str | None = None


OPERATOR = Caller(admin=True)


def valid_name(name: str) -> bool:
    return NAME.fullmatch(name) is not None


def checked_name(value: str, param: str) -> str:
    """A user's name as a request gives it; anything else is a 400 saying what a name may be."""
    if not valid_name(value):
        raise APIError(
            400, f"Invalid '{param}': a user's name is 1 to 64 letters, digits, '.', '_', '@' or '-', "
            "starting with a letter or digit.", param=param, code="invalid_user",
        )
    return value


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Keys:
    """The API keys a server accepts and who each one is. None configured: every request is the
    operator's (a loopback server, as before keys existed)."""

    def __init__(self, callers: Mapping[str, Caller], trust_body: bool = False) -> None:
        self._by_digest = {_digest(k): c for k, c in callers.items()}
        self.trust_body = trust_body  # whether the body's `user` names the user (`named`)
        # every key with its caller: the page signs in with any of them and shows that caller's data
        self.entries: tuple[tuple[str, Caller], ...] = tuple(callers.items())

    @classmethod
    def of(cls, settings: Settings) -> Keys:
        """The admin key (`api_key`) and the keys file's, read once at start."""
        callers: dict[str, Caller] = {}
        path = settings.serving.api_keys_file
        if path is not None:
            callers.update(read_keys_file(path))
        if settings.serving.api_key is not None:
            callers[settings.serving.api_key.get_secret_value()] = OPERATOR
        return cls(callers, settings.serving.trust_body_user)

    @property
    def required(self) -> bool:
        return bool(self._by_digest)

    def check(self, request: Request, key: str | None = None) -> Caller:
        """The caller of a request by its key (`key`, else its bearer token), kept on the request
        for `caller`; a 401 when keys are required and it has none of them."""
        if key is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            key = token if scheme.lower() == "bearer" else None
        request.scope[_CALLER] = found = self.caller(key)
        return found

    def named(self, request: Request, body_user: Any = None) -> str | None:
        """The user a checked request names (`named`); None when the operator names nobody."""
        return named(caller(request), request.headers.get(HEADER), body_user, self.trust_body)

    def caller(self, key: str | None) -> Caller:
        """The caller a request's key names; a missing or unknown key is a 401."""
        if not self._by_digest:
            return OPERATOR
        found = self._by_digest.get(_digest(key.strip())) if key else None
        if found is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return found


def read_keys_file(path: Path) -> dict[str, Caller]:
    """The keys of a keys file (see the module's doc); ValueError saying what is wrong in it."""
    text = path.read_text()
    if path.suffix in {".yaml", ".yml"}:
        import yaml

        data: Any = yaml.safe_load(text)
    else:
        data = json.loads(text)
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path}: a keys file is a mapping `keys:` of API keys to a user's name or {{admin: true}}")
    out: dict[str, Caller] = {}
    for i, (key, who) in enumerate(entries.items()):
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"{path}: key #{i + 1} is empty or not a string")
        if who == {"admin": True}:
            out[key.strip()] = OPERATOR
        elif isinstance(who, str) and valid_name(who):
            out[key.strip()] = Caller(admin=False, user=who)
        else:
            raise ValueError(f"{path}: key #{i + 1} names {who!r}: a user's name is 1 to 64 letters, digits, "
                             "'.', '_', '@' or '-' (starting with a letter or digit), or {admin: true}")
    return out


def named(caller: Caller, header: str | None, body_user: Any, trust_body: bool) -> str | None:
    """The user a request names: the user its key is fixed to, else the one `X-Session-User`
    names, else the body's `user` where trusted; None when the operator names nobody (`default`,
    or the user of the session it names). A user key that names another user is a 403 (nothing
    of the request is kept)."""
    name, param = None, "X-Session-User"
    if header:
        name = checked_name(header.strip(), param)
    elif trust_body and isinstance(body_user, str) and body_user:
        name, param = checked_name(body_user, "user"), "user"
    if caller.user is not None:
        if name is not None and name != caller.user:
            raise APIError(403, f"This API key is {caller.user!r}'s: it cannot act for another user "
                           f"(drop '{param}', or send the other user's key).", param=param, code="user_mismatch")
        return caller.user
    return name


def caller(request: Request) -> Caller:
    """Who `Keys.check` found a request is from."""
    found = request.scope.get(_CALLER)
    assert isinstance(found, Caller), "the request's key is checked before anything reads its caller"
    return found


def require_admin(caller: Caller) -> Caller:
    if not caller.admin:
        raise APIError(403, "This route needs an admin key; a user's key reaches only that user's own data.",
                       code="admin_key_required")
    return caller


def not_yours(session_id: str) -> APIError:
    """Another user's session, named: refused, saying nothing of whose it is."""
    return APIError(403, f"Session `{session_id}` belongs to another user: name a session of your own "
                    "(or none).", param="session_id", code="session_of_another_user")


class UserVersions(Protocol):
    """Which version serves each user: their own adapter's (the root sets
    `learning.lineages.UserLineages`, docs/learning.md#each-user-their-own-adapter)."""

    def serving(self, user: str | None) -> int:
        """The version a request of `user`'s is served by now."""
        ...

    def served(self) -> dict[str, int]:
        """The version each user with a lineage is served now."""
        ...
