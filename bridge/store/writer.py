"""Group commit: one thread owns the write path and commits whatever accumulated while its last
transaction was committing, in one transaction.

Many concurrent requests each wanting their turn durable before they answer would otherwise pay
one fsync (SQLite) or one round trip and WAL flush (PostgreSQL) each. Here a burst of N writes
costs one commit; the caller's future resolves only after that commit returned, so an
acknowledged write survives a crash of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa

log = logging.getLogger(__name__)
T = TypeVar("T")
A = TypeVar("A")
Op = Callable[[sa.Connection], Any]
ManyOp = Callable[[sa.Connection, list[Any]], list[Any]]


@dataclass
class _Item:
    op: Op | None  # a plain write, or
    many: ManyOp | None  # a write that runs together with its neighbours of the same kind
    arg: Any
    # Who waits: a thread (`submit`) or a coroutine (`write`); an event loop's waiters are woken
    # together, with one call into their loop per commit.
    future: Future[Any] | None = None
    waiter: asyncio.Future[Any] | None = None

    def run_alone(self, conn: sa.Connection) -> Any:
        if self.many is not None:
            return self.many(conn, [self.arg])[0]
        assert self.op is not None
        return self.op(conn)

    def start(self) -> bool:
        """False if the caller gave up before the write began (it is then skipped)."""
        if self.future is not None:
            return self.future.set_running_or_notify_cancel()
        assert self.waiter is not None
        return not self.waiter.cancelled()


_STOP = object()


class WriterClosed(RuntimeError):
    """The writer was closed; the write was not attempted."""


def unavailable(exc: BaseException) -> bool:
    """The store could not take a write for a reason of its own, not the write's: it is down
    or unreachable, its disk is full, its file is locked, or the write ran past its deadline.
    Such a write is worth spooling and trying again; any other failure would fail again."""
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, TimeoutError | OSError | sa.exc.TimeoutError):
        return True
    # by PEP 249's class names: the capture path raises the driver's own (`fast.py`), and
    # SQLAlchemy's wrappers carry the same names
    return any(c.__name__ in _UNAVAILABLE for c in type(exc).__mro__)


_UNAVAILABLE = frozenset({"OperationalError", "InterfaceError"})


class AsyncWriter:
    """A single writer thread with a queue. `submit(op)` from any thread returns a
    `concurrent.futures.Future`; `await write(op)` from an event loop never blocks the loop.

    An op is a function of an open connection inside the batch's transaction. A batched op
    (`submit_many(fn, arg)`) is a function of the connection and a list of args returning one
    result per arg: consecutive ones with the same `fn` run as one call, so a burst of turns
    becomes a few multi-row statements. Order is kept. When a batch fails (a batch of one too),
    each of its ops is retried in its own transaction, so one bad write fails alone and a dead
    connection is replaced before anyone's write fails.
    """

    def __init__(
        self,
        begin: Callable[[], AbstractContextManager[sa.Connection]],
        *,
        max_batch: int = 512,
        name: str = "clawbridge-store-writer",
    ) -> None:
        self._begin = begin
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Item | object] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self.batches = 0  # commits made (a batch of one counts); for tests and the status line
        self.written = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, op: Callable[[sa.Connection], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._put(_Item(op, None, None, future=fut))
        return fut

    def submit_many(self, fn: Callable[[sa.Connection, list[A]], list[T]], arg: A) -> Future[T]:
        fut: Future[T] = Future()
        self._put(_Item(None, fn, arg, future=fut))
        return fut

    async def write(self, op: Callable[[sa.Connection], T]) -> T:
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._put(_Item(op, None, None, waiter=waiter))
        return await waiter

    async def write_many(self, fn: Callable[[sa.Connection, list[A]], list[T]], arg: A) -> T:
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._put(_Item(None, fn, arg, waiter=waiter))
        return await waiter

    def _put(self, item: _Item) -> None:
        with self._lock:
            if self._closed:
                raise WriterClosed("the store's writer is closed")
            self._queue.put(item)

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new writes, finish every queued one, stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("store writer did not drain within %ss", timeout)

    # --- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is _STOP:
                break
            assert isinstance(first, _Item)
            batch = [first]
            while len(batch) < self._max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True  # commit what came before the stop, then leave
                    break
                assert isinstance(nxt, _Item)
                batch.append(nxt)
            try:
                self._commit(batch)
            except BaseException as exc:  # never leave a caller waiting on a dead thread
                _settle([(it, None, exc) for it in batch])
                raise

    def _commit(self, batch: list[_Item]) -> None:
        live = [it for it in batch if it.start()]
        if not live:
            return
        try:
            with self._begin() as conn:
                results = _run_in_order(conn, live)
        except Exception as exc:
            # Each write again, alone, in a fresh transaction: one bad write then fails only its
            # caller, and a connection that died while kept (a database restart) costs one
            # attempt, not the writes. The failed transaction was rolled back; where a connection
            # died during COMMIT and the outcome is unknown, the store's writes are idempotent.
            # An unreachable store is reported once by whoever spools (`serving.durable`), not
            # once per write.
            level = logging.DEBUG if unavailable(exc) else logging.WARNING
            log.log(level, "a batch of %d write(s) failed (%s); retrying each alone", len(live), exc)
            _settle([self._commit_one(it) for it in live])
            return
        self.batches += 1
        self.written += len(live)
        _settle([(it, res, None) for it, res in zip(live, results, strict=True)])

    def _commit_one(self, it: _Item) -> tuple[_Item, Any, BaseException | None]:
        try:
            with self._begin() as conn:
                res = it.run_alone(conn)
        except Exception as exc:
            if unavailable(exc):
                log.debug("store write failed: %s", exc)
            else:
                log.exception("store write failed")
            return it, None, exc
        self.batches += 1
        self.written += 1
        return it, res, None


def _settle(outcomes: list[tuple[_Item, Any, BaseException | None]]) -> None:
    """Hand each write's outcome to its caller: threads directly, coroutines through one
    `call_soon_threadsafe` per event loop (a wake-up per commit, not per write)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, BaseException | None]]] = {}
    for it, res, exc in outcomes:
        if it.future is not None:
            if it.future.done():
                continue
            if exc is None:
                it.future.set_result(res)
            else:
                it.future.set_exception(exc)
        elif it.waiter is not None:
            by_loop.setdefault(it.waiter.get_loop(), []).append((it.waiter, res, exc))
    for loop, waiters in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_wake, waiters)


def _wake(waiters: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, res, exc in waiters:
        if fut.done():  # cancelled meanwhile
            continue
        if exc is None:
            fut.set_result(res)
        else:
            fut.set_exception(exc)


def _run_in_order(conn: sa.Connection, items: list[_Item]) -> list[Any]:
    results: list[Any] = []
    i = 0
    while i < len(items):
        it = items[i]
        if it.many is None:
            results.append(it.run_alone(conn))
            i += 1
            continue
        j = i
        while j < len(items) and items[j].many == it.many:  # bound methods: ==, not is
            j += 1
        out = it.many(conn, [x.arg for x in items[i:j]])
        if len(out) != j - i:
            raise RuntimeError(f"a batched write returned {len(out)} results for {j - i} args")
        results.extend(out)
        i = j
    return results
