"""Nothing lost while the store is down: the proxy's writes go to the store, or to the spool
(`store.spool`) when the store cannot take them, and a background task replays the spool, in
order, once the store is back (docs/store.md#when-the-store-is-down).

    write --spool empty--> the store, within store_write_timeout_s
          \\--the store unavailable or past the deadline, or the spool not empty--> the spool
    replay: the spool's records in order; a run of turns, next states and closes in one
            transaction; each write idempotent, so a replay of one that landed is a success

While the spool holds anything, every write goes through it, so a session's turns keep their
order (a turn's index is its arrival order at the store), a next state follows its turn and a
feedback its turn. When the spool is full a write is refused and counted as lost (or, with
`spool_full: 503`, new requests are answered 503 until it has room). One log line per change of
state, never one per write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from clawbridge.store.capture import CaptureWrite, CloseWrite, NextStateWrite
from clawbridge.store.episodes import EpisodeError, NewEpisode
from clawbridge.store.records import JSONObject, TurnRecord
from clawbridge.store.spool import (
    Entry,
    Spool,
    SpoolBusy,
    SpoolFull,
    has_records,
    turn_from_json,
    turn_to_json,
)
from clawbridge.store.writer import unavailable

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from clawbridge.store import Store

log = logging.getLogger(__name__)
Outcome = Literal["stored", "spooled", "lost"]
# A spooled write of another kind is replayed by its handler, (store, data) -> None, raising
# `Dropped` when it can never apply (it is then counted lost), any other error when it may later.
Handler = Callable[["Store", JSONObject], Awaitable[None]]
CAPTURE_KINDS = frozenset({"turn", "next_state", "close"})
REPLAY_BATCH = 256
BACKOFF_S = (0.25, 5.0)


class Dropped(Exception):
    """A spooled write that can never apply (e.g. a feedback for a turn that was never stored)."""


@dataclass(frozen=True)
class SpoolConfig:
    """What the spool works with, from `settings.spool`: its folder (default: spool/ in the data
    directory), its limit in bytes, what a full spool does, the store's write deadline."""

    dir: Path
    max_bytes: int
    full: Literal["drop", "503"]
    write_timeout_s: float

    @classmethod
    def of(cls, settings: Settings) -> SpoolConfig:
        return cls(
            dir=settings.spool.spool_dir or settings.data_dir / "spool",
            max_bytes=settings.spool.spool_max_mb * 1024 * 1024,
            full=settings.spool.spool_full,
            write_timeout_s=settings.spool.store_write_timeout_s,
        )


@dataclass
class _Spooled:
    session_id: str
    train: bool


class Durable:
    """The proxy's writes, stored or spooled, and the spool's replay. `landed(kind, data)` is
    called for every replayed write once it is in the store (the learner's wake-up)."""

    def __init__(
        self, store: Store, cfg: SpoolConfig,
        landed: Callable[[str, JSONObject], Awaitable[None] | None] | None = None,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self._spool: Spool | None = None  # opened at the first write it takes (or at start)
        self._task: asyncio.Task[None] | None = None
        self.landed = landed
        self.handlers: dict[str, Handler] = {}
        self.down_since: float | None = None  # the store unavailable since (epoch s)
        self.full = False  # the last write was refused for want of room
        self.spooled = 0  # writes spooled, ever
        self.replayed = 0  # spooled writes that reached the store
        self.lost: dict[str, int] = {}  # writes never stored, by kind
        self._turns: dict[str, _Spooled] = {}  # turns in the spool (feedback resolves them)
        self._last_main: dict[str, str] = {}  # session -> its newest main turn in the spool
        self._wake = asyncio.Event()
        self.handlers["group"] = lambda _store, data: self._replay_group(data)

    async def start(self, timeout_s: float = 30.0) -> None:
        """Replay what a previous run left in the spool (a kill -9 during an outage) before the
        proxy reads the store back; what the store cannot take yet is replayed in the background."""
        if has_records(self.cfg.dir):
            spool = self.open()
            log.warning("the spool in %s holds %d writes from before a restart: replaying them",
                        self.cfg.dir, spool.depth)
            if not await self.drain(timeout_s):
                self._replaying()

    def open(self) -> Spool:
        """The spool, taken by this process."""
        if self._spool is None:
            self._spool = Spool.open(self.cfg.dir, self.cfg.max_bytes)
        return self._spool

    def _replaying(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self.run())

    # --- state ----------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return 0 if self._spool is None else self._spool.depth

    @property
    def spooling(self) -> bool:
        """Writes go through the spool (it holds writes not yet replayed)."""
        return self.depth > 0

    @property
    def refusing(self) -> bool:
        """New requests are answered 503 (`spool_full: 503` and the spool is full)."""
        return self.cfg.full == "503" and self.full

    def status(self) -> dict[str, Any]:
        """The spool for /v1/status and /metrics."""
        sp = self._spool
        oldest = None if sp is None else sp.oldest_at
        return {
            "state": "down" if self.down_since is not None else "spooling" if self.spooling else "ok",
            "store_down_since": None if self.down_since is None
            else datetime.fromtimestamp(self.down_since, UTC).isoformat(timespec="seconds"),
            "depth": self.depth,
            "bytes": 0 if sp is None else sp.size - sp.pos,
            "max_bytes": self.cfg.max_bytes,
            "oldest_age_s": 0.0 if oldest is None else round(time.time() - oldest, 1),
            "full": self.full,
            "spooled": self.spooled,
            "replayed": self.replayed,
            "turns_lost": self.lost.get("turn", 0),
            "writes_lost": sum(self.lost.values()),
        }

    def spooled_turn(self, turn_id: str) -> tuple[str, bool] | None:
        """(session id, train) of a turn waiting in the spool."""
        t = self._turns.get(turn_id)
        return None if t is None else (t.session_id, t.train)

    def last_spooled_main(self, session_id: str) -> str | None:
        return self._last_main.get(session_id)

    def down(self, exc: BaseException) -> None:
        """The store could not take a write (`unavailable(exc)`): say so once."""
        if self.down_since is None:
            self.down_since = time.time()
            log.error("the store is unavailable (%s): spooling writes to %s until it is back",
                      _reason(exc), self.cfg.dir)

    def _back(self) -> None:
        assert self.down_since is not None
        log.warning("the store is back after %.1f s: replaying %d spooled writes",
                    time.time() - self.down_since, self.depth)
        self.down_since = None

    def _lose(self, kind: str, n: int = 1) -> None:
        self.lost[kind] = self.lost.get(kind, 0) + n

    # --- writes ---------------------------------------------------------------------------------
    async def turn(self, rec: TurnRecord) -> Outcome:
        out = await self.write("turn", lambda: turn_to_json(rec), lambda: self.store.record_turn_async(rec))
        if out == "spooled":
            self._turns[rec.id] = _Spooled(rec.session_id, rec.train)
            if rec.turn_type == "main":
                self._last_main[rec.session_id] = rec.id
        return out

    async def next_state(self, turn_id: str, session_id: str, messages: list[JSONObject], matched: bool) -> Outcome:
        at = datetime.now(UTC)
        return await self.write(
            "next_state",
            lambda: {"turn_id": turn_id, "session_id": session_id, "messages": messages,
                     "matched": matched, "at": at.isoformat()},
            lambda: self.store.attach_next_state_async(turn_id, messages, at),
        )

    async def close_session(self, session_id: str, reason: str) -> Outcome:
        return await self.write(
            "close", lambda: {"session_id": session_id, "reason": reason},
            lambda: self.store.close_session_async(session_id, reason),
        )

    async def choice_group(self, group_id: str, session_id: str, turn_ids: list[str]) -> Outcome:
        """Open the group of a request's n choices (`Proxy._open_choice_group`)."""
        data = {"id": group_id, "session_id": session_id, "turn_ids": turn_ids}
        return await self.write("group", lambda: data, lambda: self._open_group(data))

    async def _open_group(self, data: JSONObject) -> None:
        eps = [NewEpisode(id=t, session_id=data["session_id"], turn_id=t) for t in data["turn_ids"]]
        await self.store.run(self.store.open_group, data["id"], eps, {"choices_of": data["id"]})

    async def _replay_group(self, data: JSONObject) -> None:
        try:
            await self._open_group(data)
        except EpisodeError as e:
            if e.status != 409:  # it exists: this replay landed before
                raise

    async def write(
        self, kind: str, data: Callable[[], JSONObject], direct: Callable[[], Awaitable[Any]]
    ) -> Outcome:
        """`direct()` (the write to the store), or the spool when the store cannot take it.
        A failure that is not the store's (`unavailable`) is raised: spooled, it would fail
        again at every replay."""
        if not self.spooling:
            try:
                async with asyncio.timeout(self.cfg.write_timeout_s):
                    await direct()
                if self.down_since is not None:  # it came back while nothing was spooled
                    self._back()
                return "stored"
            except Exception as e:
                if not unavailable(e):
                    raise
                self.down(e)
        return self.append(kind, data())

    def append(self, kind: str, data: JSONObject) -> Outcome:
        """Spool one write (fsynced when this returns) and wake the replay."""
        try:
            self.open().append(kind, data)
        except (SpoolFull, SpoolBusy, OSError) as e:
            if not self.full:
                self.full = True
                log.error("the spool cannot take writes (%s): %s are lost until it has room%s", e,
                          "new turns" if kind == "turn" else "writes",
                          "; new requests are answered 503" if self.cfg.full == "503" else "")
            self._lose(kind)
            return "lost"
        self.spooled += 1
        self._wake.set()
        self._replaying()
        return "spooled"

    # --- replay ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Replay the spool whenever it holds writes, backing off while the store is down."""
        wait = BACKOFF_S[0]
        while True:
            if not self.depth:
                self._wake.clear()
                await self._wake.wait()
                continue
            if await self.replay():
                wait = BACKOFF_S[0]
            else:
                await asyncio.sleep(wait)
                wait = min(wait * 2, BACKOFF_S[1])

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Replay until the spool is empty (True) or the store stays down past `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        wait = BACKOFF_S[0]
        while self.depth:
            if await self.replay():
                continue
            if deadline is not None and time.monotonic() + wait > deadline:
                return False
            await asyncio.sleep(wait)
            wait = min(wait * 2, BACKOFF_S[1])
        return True

    async def replay(self) -> bool:
        """Replay the next records; False when the store is still unavailable."""
        spool = self.open()
        entries = spool.pending(REPLAY_BATCH)
        if not entries:
            if spool.depth:  # a record damaged on disk: it and those after it can never be read
                log.error("the spool in %s holds %d writes that cannot be read (a damaged record): "
                          "they are lost", self.cfg.dir, spool.depth)
                self._lose("unreadable", spool.discard())
            self._drained()
            return True
        i = 0
        while i < len(entries):
            j = i + 1
            if entries[i].kind in CAPTURE_KINDS:
                while j < len(entries) and entries[j].kind in CAPTURE_KINDS:
                    j += 1
            run = entries[i:j]
            if not await self._apply(run):
                return False
            i = j
        if not self.depth:
            self._drained()
        return True

    async def _apply(self, run: list[Entry]) -> bool:
        try:
            await self._apply_run(run)
        except Exception as e:
            if unavailable(e):
                self.down(e)
                return False
            if len(run) > 1:  # one bad write must not hold the others back: each alone
                for e1 in run:
                    if not await self._apply([e1]):
                        return False
                return True
            log.error("a spooled %s can never be stored (%s): dropped", run[0].kind, e)
            self._lose(run[0].kind)
            self._committed(run, landed=False)
            return True
        if self.down_since is not None:
            self._back()
        self._committed(run, landed=True)
        for entry in run:
            if self.landed is not None:
                res = self.landed(entry.kind, entry.data)
                if asyncio.iscoroutine(res):
                    await res
        return True

    async def _apply_run(self, run: list[Entry]) -> None:
        async with asyncio.timeout(self.cfg.write_timeout_s * max(1, len(run) // 32)):
            if run[0].kind in CAPTURE_KINDS:
                await self.store.replay_async([_capture_write(e) for e in run])
                return
            handler = self.handlers.get(run[0].kind)
            if handler is None:
                raise Dropped(f"no handler replays a spooled {run[0].kind}")
            await handler(self.store, run[0].data)

    def _committed(self, run: list[Entry], *, landed: bool) -> None:
        self.open().commit(run)
        if landed:
            self.replayed += len(run)
        for e in run:
            if e.kind == "turn":
                self._turns.pop(e.data["id"], None)
                sid = e.data["session_id"]
                if self._last_main.get(sid) == e.data["id"]:
                    del self._last_main[sid]

    def _drained(self) -> None:
        self._turns.clear()
        self._last_main.clear()
        if self.full:
            self.full = False
        log.warning("the spool is empty: every spooled write was replayed (%d in all, %d lost)",
                    self.replayed, sum(self.lost.values()))

    def discard(self) -> int:
        n = self.open().discard()
        self._lose("discarded", n)
        self._drained()
        return n

    async def close(self) -> None:
        """Stop replaying and let the spool go (what it holds is replayed at the next start)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._spool is not None:
            self._spool.close()
            self._spool = None


def _capture_write(e: Entry) -> CaptureWrite:
    d = e.data
    if e.kind == "turn":
        return turn_from_json(d)
    if e.kind == "next_state":
        return NextStateWrite(d["turn_id"], d["messages"], datetime.fromisoformat(d["at"]))
    return CloseWrite(d["session_id"], d["reason"])


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "a write ran past its deadline"
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
