"""The SDK for custom agents: sessions as preconfigured `openai` clients.

    import clawbridge
    with clawbridge.Client("http://127.0.0.1:30000") as cb:
        with cb.session(user="alice") as chat:      # an openai.OpenAI that tags its requests
            r = chat.chat.completions.create(model=cb.models()[0], messages=[...])
        # leaving the block marks the session done (the last turn gets no next state)

A custom agent trains from its own episodes: a group of n attempts at one task, each an OpenAI
client whose multi-turn requests (tool calls, tool results) belong to that attempt, each ending in
an outcome reward; advantages are normalised within the group (docs/agents.md):

    with cb.group(n=4, task="fix the failing test") as g:
        for ep in g:                                    # an openai.OpenAI per episode
            ... ep.chat.completions.create(...) ...     # as many turns and tool calls as needed
            ep.outcome(tests_passed / tests_total)

`clawbridge.AsyncClient` has the same methods, awaited: its sessions and episodes are
`openai.AsyncOpenAI` clients, and `async with cb.group(n, task) as g` opens the group.

Every request of a session carries `X-Session-Id` and `X-Turn-Type`, so clawbridge never has to
guess which conversation a turn belongs to; `main=False` marks side traffic (titles, summaries)
that must not train, `train=False` opts the whole session out.

Built as httpx builds its own clients: `BaseClient` defines every call once (the request and how
to read its answer, as a `Call`); `Client` and `AsyncClient` each own one pooled httpx client and
only send.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import httpx
import openai

T = TypeVar("T")

# uvicorn closes a keep-alive connection after 5 s idle, and a pooled connection reused at that
# moment fails without a retry: expire ours sooner (an agent often idles longer between calls).
_LIMITS = httpx.Limits(keepalive_expiry=2.0)


def root_url(base_url: str) -> str:
    """A server's root, whether given as `http://host:port` or the OpenAI-style `.../v1`."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _session_headers(session_id: str, user: str | None, main: bool, train: bool) -> dict[str, str]:
    h = {"X-Session-Id": session_id, "X-Turn-Type": "main" if main else "side"}
    if user:
        h["X-Session-User"] = user
    if not train:
        h["X-Train"] = "false"
    return h


def _new_id(user: str | None) -> str:
    return f"{user or 'sdk'}-{uuid.uuid4().hex[:16]}"


def _as_dict(data: Any) -> dict[str, Any]:
    return data  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API call as data: the request to send and how to read the JSON it answers."""

    request: httpx.Request
    read: Callable[[Any], T]


class BaseClient:
    """A clawbridge server's API, each call defined once; the subclasses only do the I/O."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        self.base_url = root_url(base_url)
        self.api_key = api_key
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              read: Callable[[Any], Any] = _as_dict) -> Call[Any]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        json = (body or {}) if method == "POST" else None
        return Call(httpx.Request(method, self.base_url + path, json=json, headers=auth), read)

    @staticmethod
    def _answer(call: Call[T], response: httpx.Response) -> T:
        response.raise_for_status()
        return call.read(response.json())

    def _openai_args(self, session_id: str, user: str | None, main: bool, train: bool) -> dict[str, Any]:
        """How a session's `openai` client reaches this server, tagged with the session."""
        return {"base_url": f"{self.base_url}/v1", "api_key": self.api_key or "clawbridge",
                "default_headers": _session_headers(session_id, user, main, train), "timeout": self.timeout}

    # --- the calls --------------------------------------------------------------------------
    def _models(self) -> Call[list[str]]:
        return self._call("GET", "/v1/models", read=lambda d: [m["id"] for m in d["data"]])

    def _status(self) -> Call[dict[str, Any]]:
        return self._call("GET", "/v1/status")

    def _feedback(self, session_id: str, reward: float | None, hint: str | None,
                  turn_id: str | None) -> Call[dict[str, Any]]:
        body = {"session_id": session_id, "turn_id": turn_id, "reward": reward, "hint": hint}
        return self._call("POST", "/v1/feedback", {k: v for k, v in body.items() if v is not None})

    def _session_done(self, session_id: str) -> Call[dict[str, Any]]:
        return self._call("POST", f"/v1/sessions/{session_id}/done")

    def _open_group(self, n: int, task: Any, group_id: str | None) -> Call[dict[str, Any]]:
        body: dict[str, Any] = {"n": n, "task": task}
        if group_id is not None:
            body["id"] = group_id
        return self._call("POST", "/v1/groups", body)

    def _outcome(self, episode_id: str, outcome: float) -> Call[dict[str, Any]]:
        return self._call("POST", f"/v1/episodes/{episode_id}/outcome", {"outcome": float(outcome)})

    def _close_group(self, group_id: str) -> Call[dict[str, Any]]:
        return self._call("POST", f"/v1/groups/{group_id}/close")

    def _get_group(self, group_id: str) -> Call[dict[str, Any]]:
        return self._call("GET", f"/v1/groups/{group_id}")


class Client(BaseClient):
    """A clawbridge server: its sessions, groups, models and status (one pooled connection;
    use it as a context manager or `close()` it)."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None, timeout: float = 120.0
    ) -> None:
        super().__init__(base_url, api_key, timeout)
        self._http = httpx.Client(timeout=timeout, limits=_LIMITS)

    def _send(self, call: Call[T]) -> T:
        return self._answer(call, self._http.send(call.request))

    def session(
        self, user: str | None = None, main: bool = True, *, session_id: str | None = None, train: bool = True
    ) -> Session:
        """A new (or, with `session_id`, a resumed) session; use it as a context manager."""
        return Session(self, session_id or _new_id(user), user, main, train)

    def group(self, n: int, task: Any = None, *, group_id: str | None = None, user: str | None = None) -> Group:
        """Open a group of `n` episodes (attempts at `task`) on the server; use it as a context
        manager, which closes it (episodes left without an outcome expire, with the reason)."""
        return Group(self, n, task, group_id, user).open()

    def models(self) -> list[str]:
        return self._send(self._models())

    def status(self) -> dict[str, Any]:
        """Requests, sessions, captured turns, policy version and the store's counts."""
        return self._send(self._status())

    def feedback(self, session_id: str, reward: float | None = None, hint: str | None = None, *,
                 turn_id: str | None = None) -> dict[str, Any]:
        """Explicit feedback on a session's last main turn (or `turn_id`): a reward in [-1, +1]
        and/or a hint saying what the answer should have done."""
        return self._send(self._feedback(session_id, reward, hint, turn_id))

    def outcome(self, episode_id: str, outcome: float) -> dict[str, Any]:
        """Report an episode's outcome by id: an SDK episode's, or the `turn_id` of a choice of
        an `n > 1` request (each choice is an episode of the group named by the response id)."""
        return self._send(self._outcome(episode_id, outcome))

    def close_group(self, group_id: str) -> dict[str, Any]:
        """No more outcomes for the group: episodes without one expire; the group then trains."""
        return self._send(self._close_group(group_id))

    def get_group(self, group_id: str) -> dict[str, Any]:
        """The group's state and every episode's state, outcome and reason."""
        return self._send(self._get_group(group_id))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(BaseClient):
    """The asyncio twin of `Client`: the same methods, awaited (`aclose()` or `async with`)."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None, timeout: float = 120.0
    ) -> None:
        super().__init__(base_url, api_key, timeout)
        self._http = httpx.AsyncClient(timeout=timeout, limits=_LIMITS)

    async def _send(self, call: Call[T]) -> T:
        return self._answer(call, await self._http.send(call.request))

    def session(
        self, user: str | None = None, main: bool = True, *, session_id: str | None = None, train: bool = True
    ) -> AsyncSession:
        """A new (or resumed) session; `async with` it."""
        return AsyncSession(self, session_id or _new_id(user), user, main, train)

    def group(self, n: int, task: Any = None, *, group_id: str | None = None,
              user: str | None = None) -> AsyncGroup:
        """A group of `n` episodes: `async with cb.group(n, task) as g` opens it on the server
        (or `await g.open()`); leaving the block closes it."""
        return AsyncGroup(self, n, task, group_id, user)

    async def models(self) -> list[str]:
        return await self._send(self._models())

    async def status(self) -> dict[str, Any]:
        return await self._send(self._status())

    async def feedback(self, session_id: str, reward: float | None = None, hint: str | None = None, *,
                       turn_id: str | None = None) -> dict[str, Any]:
        return await self._send(self._feedback(session_id, reward, hint, turn_id))

    async def outcome(self, episode_id: str, outcome: float) -> dict[str, Any]:
        return await self._send(self._outcome(episode_id, outcome))

    async def close_group(self, group_id: str) -> dict[str, Any]:
        return await self._send(self._close_group(group_id))

    async def get_group(self, group_id: str) -> dict[str, Any]:
        return await self._send(self._get_group(group_id))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


# --- sessions -------------------------------------------------------------------------------------
class Session(openai.OpenAI):
    """An `openai.OpenAI` whose requests belong to one clawbridge session."""

    def __init__(self, owner: Client, session_id: str, user: str | None, main: bool, train: bool) -> None:
        super().__init__(**owner._openai_args(session_id, user, main, train))
        self.owner = owner
        self.session_id = session_id
        self.user = user
        self.is_done = False

    def done(self) -> None:
        """Tell clawbridge the conversation ended (idempotent)."""
        if not self.is_done:
            self.owner._send(self.owner._session_done(self.session_id))
            self.is_done = True

    def feedback(self, reward: float | None = None, hint: str | None = None, *,
                 turn_id: str | None = None) -> dict[str, Any]:
        """Explicit feedback on the session's last main turn (or `turn_id`) (POST /v1/feedback)."""
        return self.owner.feedback(self.session_id, reward, hint, turn_id=turn_id)

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

    def __init__(self, owner: AsyncClient, session_id: str, user: str | None, main: bool, train: bool) -> None:
        super().__init__(**owner._openai_args(session_id, user, main, train))
        self.owner = owner
        self.session_id = session_id
        self.user = user
        self.is_done = False

    async def done(self) -> None:
        if not self.is_done:
            await self.owner._send(self.owner._session_done(self.session_id))
            self.is_done = True

    async def feedback(self, reward: float | None = None, hint: str | None = None, *,
                       turn_id: str | None = None) -> dict[str, Any]:
        return await self.owner.feedback(self.session_id, reward, hint, turn_id=turn_id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.done()
        finally:
            await self.close()


# --- groups and episodes (general agents: outcome rewards, GRPO within the group) ---------------
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


class AsyncEpisode(AsyncSession):
    """The asyncio twin of `Episode`."""

    def __init__(self, group: AsyncGroup, info: dict[str, Any], user: str | None) -> None:
        super().__init__(group.owner, info["session_id"], user, True, True)
        self.group = group
        self.id: str = info["id"]
        self.index: int = info["index"]
        self.reward: float | None = None

    async def outcome(self, reward: float) -> dict[str, Any]:
        out = await self.owner.outcome(self.id, reward)
        self.reward, self.is_done = float(reward), True
        return out


class _GroupBase:
    """What both group classes hold: the task, the server's id, the episodes once opened."""

    def __init__(self, n: int, task: Any, group_id: str | None, user: str | None) -> None:
        self.n, self.task, self.id, self.user = n, task, group_id, user
        self.closed = False

    def _opened(self) -> str:
        if self.id is None:
            raise RuntimeError("the group is not open yet: open() it, or enter its block, first")
        return self.id


class Group(_GroupBase):
    """n episodes of one task, opened on the server by `Client.group`."""

    def __init__(self, owner: Client, n: int, task: Any, group_id: str | None, user: str | None) -> None:
        super().__init__(n, task, group_id, user)
        self.owner = owner
        self.episodes: list[Episode] = []

    def open(self) -> Group:
        """Open the group on the server (idempotent; `Client.group` already did)."""
        if not self.episodes:
            info = self.owner._send(self.owner._open_group(self.n, self.task, self.id))
            self.id, self.task = info["id"], info.get("task", self.task)
            self.episodes = [Episode(self, e, self.user) for e in info["episodes"]]
        return self

    def __iter__(self) -> Iterator[Episode]:
        return iter(self.episodes)

    def __len__(self) -> int:
        return len(self.episodes)

    def __getitem__(self, i: int) -> Episode:
        return self.episodes[i]

    def status(self) -> dict[str, Any]:
        return self.owner.get_group(self._opened())

    def close(self) -> dict[str, Any] | None:
        """No more outcomes (idempotent): open episodes expire; the group is settled and trains."""
        if self.closed or self.id is None:
            return None
        out = self.owner.close_group(self.id)
        self.closed = True
        for e in self.episodes:
            e.is_done = True
            e.close()
        return out

    def __enter__(self) -> Group:
        return self.open()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncGroup(_GroupBase):
    """The asyncio twin of `Group`: `async with cb.group(n, task) as g` opens it."""

    def __init__(self, owner: AsyncClient, n: int, task: Any, group_id: str | None, user: str | None) -> None:
        super().__init__(n, task, group_id, user)
        self.owner = owner
        self.episodes: list[AsyncEpisode] = []

    async def open(self) -> AsyncGroup:
        if not self.episodes:
            info = await self.owner._send(self.owner._open_group(self.n, self.task, self.id))
            self.id, self.task = info["id"], info.get("task", self.task)
            self.episodes = [AsyncEpisode(self, e, self.user) for e in info["episodes"]]
        return self

    def __iter__(self) -> Iterator[AsyncEpisode]:
        return iter(self.episodes)

    def __len__(self) -> int:
        return len(self.episodes)

    def __getitem__(self, i: int) -> AsyncEpisode:
        return self.episodes[i]

    async def status(self) -> dict[str, Any]:
        return await self.owner.get_group(self._opened())

    async def close(self) -> dict[str, Any] | None:
        if self.closed or self.id is None:
            return None
        out = await self.owner.close_group(self.id)
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
