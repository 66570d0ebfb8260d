"""The SDK for custom agents: sessions as preconfigured `openai` clients.

    import clawbridge
    cb = clawbridge.Client("http://127.0.0.1:30000")
    with cb.session(user="alice") as chat:          # an openai.OpenAI that tags its requests
        r = chat.chat.completions.create(model=cb.models()[0], messages=[...])
    # leaving the block marks the session done (the last turn gets no next state)

Every request of a session carries `X-Session-Id` and `X-Turn-Type`, so clawbridge never has to
guess which conversation a turn belongs to; `main=False` marks side traffic (titles, summaries)
that must not train, `train=False` opts the whole session out.
"""

from __future__ import annotations

import uuid
from types import TracebackType
from typing import Any

import httpx
import openai


def root_url(base_url: str) -> str:
    """A server's root, whether given as `http://host:port` or the OpenAI-style `.../v1`."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _headers(session_id: str, user: str | None, main: bool, train: bool) -> dict[str, str]:
    h = {"X-Session-Id": session_id, "X-Turn-Type": "main" if main else "side"}
    if user:
        h["X-Session-User"] = user
    if not train:
        h["X-Train"] = "false"
    return h


def _new_id(user: str | None) -> str:
    return f"{user or 'sdk'}-{uuid.uuid4().hex[:16]}"


class Session(openai.OpenAI):
    """An `openai.OpenAI` whose requests belong to one clawbridge session."""

    def __init__(self, owner: Client, session_id: str, user: str | None, main: bool, train: bool) -> None:
        super().__init__(
            base_url=f"{owner.base_url}/v1",
            api_key=owner.api_key or "clawbridge",
            default_headers=_headers(session_id, user, main, train),
            timeout=owner.timeout,
        )
        self.owner = owner
        self.session_id = session_id
        self.user = user
        self.is_done = False

    def done(self) -> None:
        """Tell clawbridge the conversation ended (idempotent)."""
        if not self.is_done:
            self.owner._post(f"/v1/sessions/{self.session_id}/done")
            self.is_done = True

    def feedback(self, reward: int | None = None, hint: str | None = None, *, turn_id: str | None = None) -> dict[str, Any]:
        """Explicit feedback on the session's last main turn (or `turn_id`): a reward in
        {-1, 0, +1} and/or a hint saying what the answer should have done (POST /v1/feedback)."""
        body = {"session_id": self.session_id, "turn_id": turn_id, "reward": reward, "hint": hint}
        return self.owner._post("/v1/feedback", {k: v for k, v in body.items() if v is not None})  # type: ignore[no-any-return]

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.done()
        finally:
            self.close()


class AsyncSession(openai.AsyncOpenAI):
    """The asyncio twin of `Session`."""

    def __init__(self, owner: Client, session_id: str, user: str | None, main: bool, train: bool) -> None:
        super().__init__(
            base_url=f"{owner.base_url}/v1",
            api_key=owner.api_key or "clawbridge",
            default_headers=_headers(session_id, user, main, train),
            timeout=owner.timeout,
        )
        self.owner = owner
        self.session_id = session_id
        self.user = user
        self.is_done = False

    async def done(self) -> None:
        if not self.is_done:
            async with httpx.AsyncClient(timeout=self.owner.timeout) as h:
                r = await h.post(
                    f"{self.owner.base_url}/v1/sessions/{self.session_id}/done",
                    headers=self.owner._auth(),
                )
                r.raise_for_status()
            self.is_done = True

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.done()
        finally:
            await self.close()


class Client:
    """A clawbridge server: its sessions, models and status."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None, timeout: float = 120.0
    ) -> None:
        self.base_url = root_url(base_url)
        self.api_key = api_key
        self.timeout = timeout

    def session(
        self, user: str | None = None, main: bool = True, *, session_id: str | None = None, train: bool = True
    ) -> Session:
        """A new (or, with `session_id`, a resumed) session; use it as a context manager."""
        return Session(self, session_id or _new_id(user), user, main, train)

    def async_session(
        self, user: str | None = None, main: bool = True, *, session_id: str | None = None, train: bool = True
    ) -> AsyncSession:
        return AsyncSession(self, session_id or _new_id(user), user, main, train)

    def models(self) -> list[str]:
        return [m["id"] for m in self._get("/v1/models")["data"]]

    def status(self) -> dict[str, Any]:
        """Requests, sessions, captured turns, policy version and the store's counts."""
        return self._get("/v1/status")  # type: ignore[no-any-return]

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _get(self, path: str) -> Any:
        r = httpx.get(self.base_url + path, headers=self._auth(), timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        r = httpx.post(self.base_url + path, json=body or {}, headers=self._auth(), timeout=self.timeout)
        r.raise_for_status()
        return r.json()
