"""One trainer among several proxies on one store, and every proxy on the version it serves
(docs/scale-out.md).

A process started with training on trains only while it holds the store's trainer lease; it
renews the claim every few seconds and, while it holds it, writes the version it serves to the
store (`SERVING_KEY`): the newest version the gate accepted, never a candidate under judgement
or one held back (that is what the trainer's backend serves: `Routing`). Every other process
follows that record: it loads the version's published weights (`Restorable.restore`: the local
engine reads the adapter folder, a cloud backend points its sampler at the saved weights) within
a tick of its publish. A waiting process takes over once the holder's claim runs out (it died)
or is released (it stopped), resumes from the store as a restart does, and trains on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from clawbridge.protocol import Restorable
from clawbridge.store.records import DEFAULT_USER

if TYPE_CHECKING:
    from clawbridge.learning.lineages import UserLineages
    from clawbridge.protocol import Backend
    from clawbridge.store import LeaseRow, Store

log = logging.getLogger(__name__)

TRAINER_LEASE = "trainer"
SERVING_KEY = "policy.serving"  # store meta: {"version", "holder", "at"}: what the trainer serves
LEASE_TTL_S = 10.0  # a dead trainer is replaced within this (plus a tick)
TICK_S = 0.5  # how often a follower looks for a new version, and a holder for a changed one


def holder_name() -> str:
    """This process, as other processes see it in the lease: host, pid and a nonce (a pid is
    reused after a restart)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


class Coordinator:
    """The trainer lease and the version every proxy serves, for one process. `run` is its loop
    (a background task of the server); `lead(learn)` runs `learn` whenever this process holds
    the lease and cancels it when the lease is lost."""

    def __init__(
        self, store: Store, backend: Backend, *, train: bool,
        ttl_s: float = LEASE_TTL_S, tick_s: float = TICK_S, holder: str | None = None,
        lineages: UserLineages | None = None,
    ) -> None:
        self.store = store
        self.backend = backend
        self.lineages = lineages  # each user's version, announced and followed together
        self.train = train
        self.ttl_s = ttl_s
        self.tick_s = tick_s
        self.holder = holder or holder_name()
        self.lease: LeaseRow | None = None  # the lease as last read
        self.holding = asyncio.Event()  # this process holds the trainer lease
        self.lost = asyncio.Event()  # ... and lost it (the learner is cancelled)
        self.announced: tuple[int, dict[str, int]] | None = None  # what this holder last wrote to SERVING_KEY
        self.followed: int | None = None  # the version this follower last loaded
        self._renewed = 0.0  # monotonic time of the last successful claim
        self._warned = False

    # --- the loop ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Before serving: try the lease once (training on) and, without it, serve the version
        the trainer serves (not the newest published: it may be a candidate under judgement)."""
        if self.train:
            await self._claim()
        else:
            with contextlib.suppress(Exception):
                self.lease = await self.store.run(self.store.lease, TRAINER_LEASE)
        if not self.holding.is_set():
            await self._follow()

    async def run(self) -> None:
        """Until cancelled: claim or renew the lease, announce or follow the serving version.
        Cancelled, it releases the lease so that a waiting process takes over at once."""
        try:
            while True:
                if self.train and (not self.holding.is_set() or time.monotonic() - self._renewed > self.ttl_s / 3):
                    await self._claim()
                if self.holding.is_set():
                    await self._announce()
                else:
                    await self._follow()
                await asyncio.sleep(self.tick_s)
        finally:
            if self.holding.is_set():
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.store.run(self.store.release_lease, TRAINER_LEASE, self.holder))

    async def lead(self, learn: Callable[[], Awaitable[None]]) -> None:
        """Run `learn` while this process holds the lease; when it loses it, cancel `learn` and
        wait to hold it again. Returns when `learn` returns."""
        while True:
            await self.holding.wait()
            self.lost.clear()
            task = asyncio.ensure_future(learn())
            lost = asyncio.ensure_future(self.lost.wait())
            try:
                await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if task.done() and not task.cancelled():
                task.result()  # the learner's own end (or its error) ends the lead
                return

    # --- steps ------------------------------------------------------------------------------

    async def _claim(self) -> None:
        was = self.holding.is_set()
        try:
            self.lease = await self.store.run(self.store.claim_lease, TRAINER_LEASE, self.holder, self.ttl_s)
        except Exception:
            log.exception("could not claim the trainer lease")
            if was and time.monotonic() - self._renewed > self.ttl_s:
                self._lose("the store could not be reached for longer than the lease")
            return
        if self.lease.holder == self.holder:
            self._renewed = time.monotonic()
            if not was:
                log.warning("this process holds the trainer lease: it trains; the other proxies on the store "
                            "serve what it publishes")
                self.holding.set()
        elif was:
            self._lose(f"the trainer lease is held by {self.lease.holder}")
        elif not self._warned:
            self._warned = True
            log.warning("the trainer lease is held by %s: this process serves the versions it publishes and "
                        "takes over if it stops", self.lease.holder)

    def _lose(self, why: str) -> None:
        log.error("lost the trainer lease (%s): training stops in this process", why)
        self.holding.clear()
        self.lost.set()
        self.announced = None

    def serving(self) -> dict[str, int]:
        """The version each user is served in this process (one adapter: everyone the backend's)."""
        if self.lineages is None:
            return {DEFAULT_USER: self.backend.version}
        return self.lineages.served()

    async def _announce(self) -> None:
        users = self.serving()
        version = users.get(DEFAULT_USER, self.backend.version)
        if (version, users) == self.announced:
            return
        value = {"version": version, "users": users, "holder": self.holder, "at": datetime.now(UTC).isoformat()}
        try:
            await self.store.run(self.store.set_meta, SERVING_KEY, value)
        except Exception:
            log.exception("could not record the serving version")
            return
        self.announced = (version, users)

    async def _follow(self) -> None:
        """Serve what the trainer announced: each user's version (the default user's alone from
        a trainer that announced one): the versions that changed loaded from their published
        weights in ascending order, the newest announced last, so it stays the newest here too."""
        try:
            value = await self.store.run(self.store.get_meta, SERVING_KEY)
            if not value:
                return
            wanted = {str(u): int(v) for u, v in (value.get("users") or {DEFAULT_USER: value["version"]}).items()}
            if all(self.serving().get(u, 0) == v for u, v in wanted.items()):
                return
            version = int(value["version"])
            if not isinstance(self.backend, Restorable):
                if self.followed != version:
                    log.error("the %s backend cannot serve another process's policy@v%d", self.backend.name, version)
                    self.followed = version
                return
            serving = self.serving()
            changed = {v for u, v in wanted.items() if serving.get(u, 0) != v}
            # only what changed is loaded, the newest last: it stays the newest here too
            for v in sorted(changed | {max(wanted.values())}):
                row = await self.store.run(self.store.policy_version, v)
                await self.backend.restore(v, row.path if row is not None else None)
            self.backend.serve(None)  # a version this process held at start (`server.serve`) is not its to hold
            if self.lineages is not None:
                for user, v in wanted.items():
                    self.lineages.get(user).backend.follow(v)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # e.g. its weights are still being written: the next tick retries
            log.debug("could not follow the serving version yet: %s", e)
            return
        self.followed = version
        log.info("serving policy@v%d, as the trainer (%s) does", version, value.get("holder"))

    def elsewhere(self) -> str | None:
        """Why this process may not publish a version now (None: it holds the lease)."""
        if self.holding.is_set():
            return None
        holder = self.lease.holder if self.lease is not None else "no process"
        return (f"this process does not train: {holder} holds the store's trainer lease; "
                "send this to the process that trains (its /v1/status says trainer: this process)")

    # --- what the operator sees ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Fields for /v1/status and the status line."""
        if self.holding.is_set():
            return {"trainer": "this process"}
        lease = self.lease
        other = lease.holder if lease is not None else "no process"
        out: dict[str, Any] = {"trainer": other}
        if self.train:
            out["trainer"] = f"{other} (this process waits to take over)"
        return out

    def describe(self) -> str:
        """The banner's line."""
        if self.holding.is_set():
            return "  trainer   this process (holds the store's trainer lease)"
        lease = self.lease
        other = lease.holder if lease is not None else "no process"
        if self.train:
            return f"  trainer   {other}; this process serves its versions and takes over if it stops"
        return f"  trainer   {other}; this process serves its versions (training off here)"
