"""The spool: an append-only, fsynced, bounded log of writes the store could not take, kept on
local disk until they are replayed (`serving.durable`), in the order they were made.

    spool.log    records: <u32 length><u32 crc32> then `length` bytes of JSON {"k", "at", "d"}
    spool.pos    the offset up to which records were replayed (committed to the store)
    spool.lock   held (flock) by the one process that owns the spool

A record is appended whole and fsynced before the caller is told it is spooled, so a spooled
write survives a kill -9 like a committed one. A torn last record (a crash inside `append`) is
found when the spool is opened, logged and cut off. The files hold what the store holds (every
captured conversation): the directory is 0700 and the files 0600.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import logging
import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from clawbridge.store import codec
from clawbridge.store.base import private_dir
from clawbridge.store.records import (
    DEFAULT_USER,
    JSONObject,
    TurnRecord,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
)

log = logging.getLogger(__name__)
_HEAD = struct.Struct("<II")
LOG, POS, LOCK = "spool.log", "spool.pos", "spool.lock"


class SpoolFull(RuntimeError):
    """The spool is at its size limit: the write was not spooled."""


class SpoolBusy(RuntimeError):
    """Another process owns the spool (a running proxy replays it itself)."""


@dataclass(frozen=True)
class Entry:
    """One spooled write: its kind (`turn`, `next_state`, `close`, `group`, `feedback`), when it
    was made (epoch seconds), its data, and the offset just past it (what replaying it commits)."""

    kind: str
    at: float
    data: JSONObject
    end: int


class Spool:
    """The spool's files, owned by one process (`open` takes the lock). Not thread-safe: the
    proxy appends and replays from its event loop."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.dir = private_dir(directory)
        self.max_bytes = max_bytes
        self._lock: BinaryIO | None = None
        self._log: BinaryIO | None = None
        self.pos = 0  # replayed up to here
        self.size = 0  # bytes in spool.log
        self.depth = 0  # records not yet replayed
        self.oldest_at: float | None = None  # when the oldest record not yet replayed was made

    @classmethod
    def open(cls, directory: Path, max_bytes: int) -> Spool:
        """Take the spool (SpoolBusy if another process has it) and check its records: a torn
        last record is cut off with a log line."""
        spool = cls(directory, max_bytes)
        spool._take()
        try:
            spool._recover()
        except BaseException:
            spool.close()
            raise
        return spool

    def _take(self) -> None:
        path = self.dir / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        lock = os.fdopen(fd, "r+b")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise SpoolBusy(f"the spool in {self.dir} is in use by another process") from None
        self._lock = lock

    def _recover(self) -> None:
        path = self.dir / LOG
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        os.chmod(path, 0o600)
        self._log = os.fdopen(fd, "a+b", buffering=0)
        self.size = os.fstat(fd).st_size
        self.pos = _read_pos(self.dir / POS)
        if self.pos > self.size:  # a kill inside `_reset`: the log is empty, its position stale
            _write_pos(self.dir / POS, 0)
            self.pos = 0
        good, depth, oldest = self.pos, 0, None
        for e in _scan(path, self.pos):
            good, depth = e.end, depth + 1
            oldest = e.at if oldest is None else oldest
        if good < self.size:
            log.warning(
                "spool %s: a torn or unreadable record at offset %d (%d bytes) was skipped",
                path, good, self.size - good,
            )
            os.truncate(path, good)
            os.fsync(fd)
            self.size = good
        self.depth, self.oldest_at = depth, oldest
        if self.pos == self.size and self.size:
            self._reset()

    def close(self) -> None:
        for f in (self._log, self._lock):
            if f is not None:
                f.close()
        self._log = self._lock = None

    def append(self, kind: str, data: JSONObject) -> None:
        """Append one record and fsync it; SpoolFull past the size limit, OSError when the disk
        cannot take it (nothing of it is left in the log)."""
        assert self._log is not None, "the spool is closed"
        now = time.time()
        body = codec.dumps({"k": kind, "at": now, "d": data}).encode()
        rec = _HEAD.pack(len(body), zlib.crc32(body)) + body
        if self.size + len(rec) > self.max_bytes:
            raise SpoolFull(f"the spool is full ({self.size} of {self.max_bytes} bytes)")
        fd = self._log.fileno()
        try:
            if self._log.write(rec) != len(rec):  # an unbuffered write may stop short (a full disk)
                raise OSError(errno.ENOSPC, f"the spool's disk took part of a record ({self.dir})")
            os.fsync(fd)
        except BaseException:
            # a half record left here would hide every record appended after it
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self.size)
            raise
        self.size += len(rec)
        self.depth += 1
        if self.oldest_at is None:
            self.oldest_at = now

    def pending(self, limit: int = 256) -> list[Entry]:
        """The next records not yet replayed, oldest first."""
        out: list[Entry] = []
        for e in _scan(self.dir / LOG, self.pos):
            out.append(e)
            if len(out) >= limit:
                break
        return out

    def commit(self, entries: list[Entry]) -> None:
        """These records (the first `pending` ones) reached the store: never replay them again.
        Once everything is replayed the log starts over empty."""
        if not entries:
            return
        self.pos = entries[-1].end
        self.depth = max(0, self.depth - len(entries))
        if self.pos >= self.size:
            self._reset()
            return
        _write_pos(self.dir / POS, self.pos)
        nxt = self.pending(1)
        self.oldest_at = nxt[0].at if nxt else None

    def discard(self) -> int:
        """Drop every record not yet replayed; returns how many."""
        n = self.depth
        self._reset()
        return n

    def _reset(self) -> None:
        assert self._log is not None
        # the position first: a crash between the two leaves a log whose records all count
        # as replayed, never an empty log with a stale position
        _write_pos(self.dir / POS, self.size)
        os.ftruncate(self._log.fileno(), 0)
        os.fsync(self._log.fileno())
        _write_pos(self.dir / POS, 0)
        self.pos = self.size = self.depth = 0
        self.oldest_at = None


def has_records(directory: Path) -> bool:
    """The spool in `directory` may hold records not yet replayed."""
    try:
        return (directory / LOG).stat().st_size > 0
    except FileNotFoundError:
        return False


def peek(directory: Path) -> tuple[int, int, float | None]:
    """Records not yet replayed, their bytes, and when the oldest was made: read without taking
    the spool (for `clawbridge spool status` beside a running proxy)."""
    path = directory / LOG
    if not path.exists():
        return 0, 0, None
    pos = _read_pos(directory / POS)
    n, end, oldest = 0, pos, None
    for e in _scan(path, pos):
        n, end = n + 1, e.end
        oldest = e.at if oldest is None else oldest
    return n, end - pos, oldest


def _scan(path: Path, start: int) -> Iterator[Entry]:
    """The whole, intact records from `start` on; stops at the first torn or corrupt one."""
    with open(path, "rb") as f:
        f.seek(start)
        off = start
        while True:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                return
            n, crc = _HEAD.unpack(head)
            body = f.read(n)
            if len(body) < n or zlib.crc32(body) != crc:
                return
            try:
                obj = json.loads(body)
            except ValueError:
                return
            off += _HEAD.size + n
            yield Entry(obj["k"], float(obj["at"]), obj["d"], off)


def _read_pos(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _write_pos(path: Path, pos: int) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, str(pos).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename durable too (not every filesystem allows it)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# --- turns as JSON, bit for bit ------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def turn_to_json(rec: TurnRecord) -> JSONObject:
    """A turn record as JSON; token ids and logprobs packed (every float64 bit kept)."""
    return {
        "id": rec.id, "session_id": rec.session_id, "messages": rec.messages, "tools": rec.tools,
        "prompt_ids": _b64(pack_ids(rec.prompt_ids)),
        "completion_ids": _b64(pack_ids(rec.completion_ids)),
        "logprobs": _b64(pack_floats(rec.logprobs)),
        "top_logprobs": codec.top_to_json(rec.top_logprobs),
        "version": rec.version, "finish_reason": rec.finish_reason, "response": rec.response,
        "request_params": rec.request_params,
        "sampling": {k: getattr(rec.sampling, k) for k in codec.SAMPLING_FIELDS},
        "turn_type": rec.turn_type, "tagged": rec.tagged, "train": rec.train,
        "session_source": rec.session_source, "queued_ms": rec.queued_ms,
        "ttft_ms": rec.ttft_ms, "total_ms": rec.total_ms,
        "created_at": rec.created_at.isoformat(),
        "prompt_key": None if rec.prompt_key is None else _b64(rec.prompt_key),
        "reply_key": None if rec.reply_key is None else _b64(rec.reply_key),
        "instruction": rec.instruction, "user": rec.user,
    }


def turn_from_json(d: JSONObject) -> TurnRecord:
    return TurnRecord(
        id=d["id"], session_id=d["session_id"], messages=d["messages"], tools=d["tools"],
        prompt_ids=unpack_ids(_unb64(d["prompt_ids"])),
        completion_ids=unpack_ids(_unb64(d["completion_ids"])),
        logprobs=unpack_floats(_unb64(d["logprobs"])),
        top_logprobs=codec.top_from_json(d["top_logprobs"]),
        version=d["version"], finish_reason=d["finish_reason"], response=d["response"],
        request_params=d["request_params"], sampling=codec.sampling_from_json(d["sampling"]),
        turn_type=d["turn_type"], tagged=d["tagged"], train=d["train"],
        session_source=d["session_source"], queued_ms=d["queued_ms"], ttft_ms=d["ttft_ms"],
        total_ms=d["total_ms"], created_at=datetime.fromisoformat(d["created_at"]),
        prompt_key=None if d["prompt_key"] is None else _unb64(d["prompt_key"]),
        reply_key=None if d["reply_key"] is None else _unb64(d["reply_key"]),
        instruction=d.get("instruction"),  # None in a spool written before turns kept it
        user=d.get("user", DEFAULT_USER),  # a spool written before sessions kept their user
    )


def describe(directory: Path) -> dict[str, Any]:
    """What `clawbridge spool status` prints."""
    n, size, oldest = peek(directory)
    return {
        "dir": str(directory), "records": n, "bytes": size,
        "oldest_age_s": None if oldest is None else round(time.time() - oldest, 1),
    }
