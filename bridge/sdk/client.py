"""The SDK for custom agents: sessions as preconfigured `openai` clients.

    import clawbridge
    cb = clawbridge.Client("http://127.0.0.1:30000")
    with cb.session(user="alice") as chat:          # an openai.OpenAI that tags its requests
        r = chat.chat.completions.create(model=cb.models()[0], messages=[...])
    # leaving the block marks the session done (the last turn gets no next state)

A custom agent trains from its own episodes: a group of n attempts at one task, each an OpenAI
client whose multi-turn requests (tool calls, tool results) belong to that attempt, each ending in
an outcome reward; advantages are normalised within the group (docs/agents.md):

    with cb.group(n=4, task="fix the failing test") as g:
        for ep in g:                                    # an openai.OpenAI per episode
            ... ep.chat.completions.create(...) ...     # as many turns and tool calls as needed
            ep.outcome(tests_passed / tests_total)

Every request of a session carries `X-Session-Id` and `X-Turn-Type`, so clawbridge never has to
guess which conversation a turn belongs to; `main=False` marks side traffic (titles, summaries)
that must not train, `train=False` opts the whole session out.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
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

    def feedback(self, reward: float | None = None, hint: str | None = None, *, turn_id: str | None = None) -> dict[str, Any]:
        """Explicit feedback on the session's last main turn (or `turn_id`): a reward in
        [-1, +1] and/or a hint saying what the answer should have done (POST /v1/feedback)."""
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

    def group(self, n: int, task: Any = None, *, group_id: str | None = None, user: str | None = None) -> Group:
        """Open a group of `n` episodes (attempts at `task`) on the server; use it as a context
        manager, which closes it (episodes left without an outcome expire, with the reason)."""
        return Group(self, self._post("/v1/groups", _group_body(n, task, group_id)), user)

    def async_group(self, n: int, task: Any = None, *, group_id: str | None = None, user: str | None = None) -> AsyncGroup:
        """The asyncio twin of `group`: `async with cb.async_group(4, task) as g:` opens it."""
        return AsyncGroup(self, _group_body(n, task, group_id), user)

    def outcome(self, episode_id: str, outcome: float) -> dict[str, Any]:
        """Report an episode's outcome by id: an SDK episode's, or the `turn_id` of a choice of
        an `n > 1` request (each choice is an episode of the group named by the response id)."""
        return self._post(f"/v1/episodes/{episode_id}/outcome", {"outcome": float(outcome)})  # type: ignore[no-any-return]

    def close_group(self, group_id: str) -> dict[str, Any]:
        """No more outcomes for the group: episodes without one expire; the group then trains."""
        return self._post(f"/v1/groups/{group_id}/close")  # type: ignore[no-any-return]

    def get_group(self, group_id: str) -> dict[str, Any]:
        """The group's state and every episode's state, outcome and reason."""
        return self._get(f"/v1/groups/{group_id}")  # type: ignore[no-any-return]

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


# --- groups and episodes (general agents: outcome rewards, GRPO within the group) ---------------
def _group_body(n: int, task: Any, group_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"n": n, "task": task}
    if group_id is not None:
        body["id"] = group_id
    return body


class Episode(Session):
    """One attempt at a group's task: an `openai.OpenAI` whose requests (tool calls and tool
    results included) all belong to this episode. End it with `outcome(reward)`."""

    def __init__(self, group: Group, info: dict[str, Any], user: str | None) -> None:
        super().__init__(group.owner, info["session_id"], user, True, True)
        self.group = group
        self.id: str = info["id"]
        self.index: int = info["index"]
        self.reward: float | None = None

    def outcome(self, reward: float) -> dict[str, Any]:
        """The episode's outcome (e.g. tests passed / total); once per episode. The episode's
        session ends with it."""
        out = self.owner.outcome(self.id, reward)
        self.reward, self.is_done = float(reward), True
        return out


class Group:
    """n episodes of one task, opened on the server by `Client.group`."""

    def __init__(self, owner: Client, info: dict[str, Any], user: str | None) -> None:
        self.owner = owner
        self.id: str = info["id"]
        self.task = info.get("task")
        self.episodes = [Episode(self, e, user) for e in info["episodes"]]
        self.closed = False

    def __iter__(self) -> Iterator[Episode]:
        return iter(self.episodes)

    def __len__(self) -> int:
        return len(self.episodes)

    def __getitem__(self, i: int) -> Episode:
        return self.episodes[i]

    def status(self) -> dict[str, Any]:
        return self.owner.get_group(self.id)

    def close(self) -> dict[str, Any] | None:
        """No more outcomes (idempotent): open episodes expire; the group is settled and trains."""
        if self.closed:
            return None
        out = self.owner.close_group(self.id)
        self.closed = True
        for e in self.episodes:
            e.is_done = True
            e.close()
        return out

    def __enter__(self) -> Group:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncEpisode(AsyncSession):
    """The asyncio twin of `Episode`."""

    def __init__(self, group: AsyncGroup, info: dict[str, Any], user: str | None) -> None:
        super().__init__(group.owner, info["session_id"], user, True, True)
        self.group = group
        self.id: str = info["id"]
        self.index: int = info["index"]
        self.reward: float | None = None

    async def outcome(self, reward: float) -> dict[str, Any]:
        out = await self.group._post(f"/v1/episodes/{self.id}/outcome", {"outcome": float(reward)})
        self.reward, self.is_done = float(reward), True
        return out


class AsyncGroup:
    """The asyncio twin of `Group`: `async with cb.async_group(n, task) as g` opens it (or
    `await g.open()`), leaving the block closes it."""

    def __init__(self, owner: Client, body: dict[str, Any], user: str | None) -> None:
        self.owner, self._body, self._user = owner, body, user
        self.id: str | None = body.get("id")
        self.task = body.get("task")
        self.episodes: list[AsyncEpisode] = []
        self.closed = False

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=self.owner.timeout) as h:
            r = await h.post(self.owner.base_url + path, json=body or {}, headers=self.owner._auth())
            r.raise_for_status()
            return r.json()  # type: ignore[no-any-return]

    async def open(self) -> AsyncGroup:
        if not self.episodes:
            info = await self._post("/v1/groups", self._body)
            self.id = info["id"]
            self.episodes = [AsyncEpisode(self, e, self._user) for e in info["episodes"]]
        return self

    def __iter__(self) -> Iterator[AsyncEpisode]:
        return iter(self.episodes)

    def __len__(self) -> int:
        return len(self.episodes)

    def __getitem__(self, i: int) -> AsyncEpisode:
        return self.episodes[i]

    async def close(self) -> dict[str, Any] | None:
        if self.closed or self.id is None:
            return None
        out = await self._post(f"/v1/groups/{self.id}/close")
        self.closed = True
        for e in self.episodes:
            e.is_done = True
            await e.close()
        return out

    async def __aenter__(self) -> AsyncGroup:
        return await self.open()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
