"""Sessions and turns (docs/design.md#sessions-and-turns): which conversation a request belongs to, whether it trains,
and the next state of the previous main turn.

A request names its session by header, body key or URL prefix. Untagged requests are joined to the
conversation they extend: every answered request registers the structural fingerprint of its
messages plus the reply it got; a later request whose message prefix has that fingerprint
continues the same session. Fingerprints are structural because real agents re-serialise what
they replay (OpenClaw does, observed against a logging server): tool-call ids are rewritten, JSON arguments are
re-encoded, and an internal-context message is rebuilt at the end of every request and never kept
in history — it is dropped before matching and never becomes a next state.

Everything here is in-memory and synchronous; the proxy calls it from the event loop, so one
request's admission is atomic with respect to every other. Several proxies on one store
(docs/scale-out.md) know only what they served themselves: there the proxy asks the store which
turn a request continues (`Store.continuation`, by the fingerprints of the request's prefixes)
and hands the answer to `admit`, which decides from it as it decides from its own memory.

Users are strictly apart (`serving.users`): a session belongs to the user who opened it, a request
for another user naming it is refused (`SessionOfAnotherUser`), and an untagged request is matched
against its own user's conversations only, so two users' identical histories never join.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from clawbridge.chat.prefix import Recent, snapshot
from clawbridge.store.continuation import Continuation, KeyedTurn
from clawbridge.store.records import DEFAULT_USER
from clawbridge.types import TurnType

INTERNAL_CONTEXT_MARKER = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
_KEYS_PER_SESSION = 8  # fingerprints kept per session: the last few replies, to allow branching
_TRUE = {"1", "true", "yes", "on"}
TAG_HEADERS = ("x-session-id", "x-turn-type", "x-session-done", "x-train", "x-session-user", "x-instructions")


class SessionOfAnotherUser(Exception):
    """A request named a session that another user opened."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id


@dataclass(frozen=True)
class TurnTag:
    """What a request says about itself (all optional)."""

    session_id: str | None = None
    turn_type: TurnType | None = None
    done: bool = False
    train: bool = True
    user: str | None = None
    source: Literal["header", "body", "path"] | None = None  # where the session id came from


def _flag(v: Any) -> bool:
    return v is True or (isinstance(v, str) and v.strip().lower() in _TRUE)


def read_tag(
    headers: Mapping[str, str], body_keys: Mapping[str, Any], path_session: str | None = None
) -> TurnTag:
    """Header > URL prefix > body. Raises ValueError on a turn type other than main|side."""
    candidates: tuple[tuple[Literal["header", "body", "path"], Any], ...] = (
        ("header", headers.get("x-session-id")),
        ("path", path_session),
        ("body", body_keys.get("session_id")),
    )
    source, sid = next(((src, v) for src, v in candidates if v), (None, None))
    ttype = headers.get("x-turn-type") or body_keys.get("turn_type")
    if ttype is not None:
        ttype = str(ttype).strip().lower()
        if ttype not in ("main", "side"):
            raise ValueError(f"turn type must be 'main' or 'side', got {ttype!r}")
    done = _flag(headers.get("x-session-done")) or _flag(body_keys.get("session_done"))
    train = str(headers.get("x-train", "true")).strip().lower() not in {"0", "false", "no", "off"}
    return TurnTag(
        session_id=str(sid) if sid else None,
        turn_type=ttype,  # type: ignore[arg-type]
        done=done,
        train=train,
        user=headers.get("x-session-user"),
        source=source,
    )


# An agent's own housekeeping, sent as a model request but written by no user: OpenClaw's
# compaction summary (observed with openclaw 2026.9.6; it carries no session id and, from older
# plug-ins, a main tag). Matched on the system prompt's opening words.
HOUSEKEEPING_PROMPTS = ("You are a context summarization assistant",)


def agent_housekeeping(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a request is an agent's housekeeping (a compaction summary), never a user's turn."""
    for m in messages[:1]:
        if m.get("role") in ("system", "developer"):
            text = _text(m.get("content"))
            return text.startswith(HOUSEKEEPING_PROMPTS)
    return False


# --- structural fingerprints --------------------------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    parts = []
    for p in content:
        if p.get("type") == "text":
            parts.append(str(p.get("text", "")))
        else:  # images etc.: their payload identifies them
            parts.append(json.dumps(p, sort_keys=True, separators=(",", ":")))
    return "\n".join(parts).strip()


def _args(arguments: Any) -> str:
    """Arguments compared by value: `{"a": 1}` and `{"a":1}` are the same call."""
    if not isinstance(arguments, str):
        return json.dumps(arguments, sort_keys=True, separators=(",", ":"))
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments.strip()


def is_internal_context(msg: Mapping[str, Any]) -> bool:
    return msg.get("role") == "user" and INTERNAL_CONTEXT_MARKER in _text(msg.get("content"))


def history(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages that are part of the conversation (internal-context messages dropped)."""
    return [m for m in messages if not is_internal_context(m)]


def canonical(msg: Mapping[str, Any]) -> bytes:
    """A message's identity: role, text, tool calls by name and argument value. Ids, reasoning
    and key order are not part of it. Length-prefixed fields, no JSON: OpenClaw's 40 K-character
    system message is hashed on every request, so this stays a couple of memory copies."""
    parts = [str(msg.get("role")), _text(msg.get("content"))]
    for c in msg.get("tool_calls") or ():
        parts += [str(c["function"]["name"]), _args(c["function"].get("arguments", ""))]
    out = bytearray()
    for p in parts:
        raw = p.encode("utf-8", "surrogatepass")
        out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def fingerprints(messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """fp[k] identifies messages[:k+1]: a chained hash, one pass over the conversation."""
    out: list[bytes] = []
    prev = b""
    for m in messages:
        prev = hashlib.blake2b(prev + canonical(m), digest_size=16).digest()
        out.append(prev)
    return out


def extend(fp: bytes, msg: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(fp + canonical(msg), digest_size=16).digest()


# --- the tracker --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NextState:
    """What the next main request appended after a main turn's reply."""

    turn_id: str
    session_id: str
    messages: tuple[dict[str, Any], ...]
    matched: bool  # False: the request did not extend the turn structurally (history rewritten)


@dataclass(frozen=True)
class Admission:
    session_id: str
    turn_type: TurnType
    train: bool
    done: bool
    new_session: bool
    matched: bool  # an untagged request joined an existing conversation
    untagged: bool
    source: Literal["header", "body", "path", "matched", "new"]
    user: str
    fps: tuple[bytes, ...]  # fingerprints of the request's history
    next_state: NextState | None


@dataclass(frozen=True)
class Lookup:
    """A request's history and the fingerprints of its prefixes (`fps[k]`: `hist[:k+1]`)."""

    hist: list[Mapping[str, Any]]
    fps: list[bytes]

    @property
    def reply_keys(self) -> list[bytes]:
        """The prefixes that end with a reply: what a turn this request continues has as its
        `reply_key` (`Store.continuation`)."""
        return [fp for m, fp in zip(self.hist, self.fps, strict=True) if m.get("role") == "assistant"]


@dataclass
class _Pending:
    turn_id: str
    fp: bytes  # fingerprint of the turn's history + reply
    length: int  # messages in that history + 1
    base: bytes = b""  # fingerprint of the history alone
    first: bool = True  # the first choice of its request


_AWAITING_PER_SESSION = 64  # choices and resamples of one prompt awaiting a next state


def _resampled(awaiting: Sequence[_Pending], fps: Sequence[bytes]) -> bool:
    """The request's history is exactly the one the awaiting turns answered: the same prompt
    sampled again, which continues nothing (never anyone's next state)."""
    return bool(awaiting) and awaiting[-1].length == len(fps) + 1 and awaiting[-1].base == (fps[-1] if fps else b"")


def _newest_first_choice(awaiting: Sequence[_Pending]) -> _Pending:
    return next((q for q in reversed(awaiting) if q.first), awaiting[-1])


def _shared_next_state(
    sid: str, awaiting: Sequence[KeyedTurn], hist: list[Mapping[str, Any]], fps: list[bytes]
) -> NextState | None:
    """`Sessions._next_state` over what the store knows (`Continuation.awaiting`): the
    awaiting turn this request continues gets what follows its reply; a request that repeats
    their prompt (a resample) continues nothing; history rewritten: what follows the last reply
    goes to the newest awaiting turn."""
    if not awaiting or (fps and awaiting[-1].prompt_key == fps[-1]):
        return None
    at = {fp: k for k, fp in enumerate(fps)}
    p = next((a for a in reversed(awaiting) if a.reply_key in at), None)
    if p is not None and p.reply_key is not None:
        appended, ok = hist[at[p.reply_key] + 1 :], True
    else:
        p = awaiting[-1]
        last = max((i for i, m in enumerate(hist) if m.get("role") == "assistant"), default=-1)
        appended, ok = hist[last + 1 :], False
    if not appended:
        return None
    return NextState(p.id, sid, tuple(dict(m) for m in appended), ok)


@dataclass
class _Session:
    id: str
    last_seen: float
    user: str = DEFAULT_USER
    keys: list[bytes] = field(default_factory=list)
    # main turns awaiting their next state: every choice of the last request, and the turns of
    # earlier requests with the very same history (the same prompt sampled again); the request
    # that extends one of them gives it its next state
    awaiting: list[_Pending] = field(default_factory=list)


class _Fingerprints:
    """The fingerprints of the last few histories: a request that extends one (the normal case:
    an agent resends its history plus what is new) hashes only its new messages. OpenClaw's
    system message alone is ~36 K characters, hashed on every request otherwise."""

    def __init__(self, size: int = 64) -> None:
        self._recent: Recent[list[bytes]] = Recent(size)

    def of(self, hist: Sequence[Mapping[str, Any]]) -> list[bytes]:
        found = self._recent.find(hist)
        if found is None:
            snap, fps = [snapshot(m) for m in hist], fingerprints(hist)
        else:
            k = found.shared
            snap, fps = list(found.messages[:k]), found.item[:k]
            prev = fps[-1]
            for m in hist[k:]:
                snap.append(snapshot(m))
                prev = extend(prev, m)
                fps.append(prev)
        self._recent.put(snap, fps, found)
        return list(fps)


class Sessions:
    def __init__(
        self,
        default_turn_type: TurnType = "main",
        idle_timeout_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.default_turn_type = default_turn_type
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        # (user, fingerprint of history + reply) -> session id: a user's conversations only
        self._index: dict[tuple[str, bytes], str] = {}
        self._fingerprints = _Fingerprints()
        self.counts = {"untagged": 0, "matched": 0, "side": 0, "main": 0, "no_train": 0}

    def __len__(self) -> int:
        return len(self._sessions)

    def owner(self, session_id: str) -> str | None:
        """The user of an open session this process knows (None: it knows no such session)."""
        sess = self._sessions.get(session_id)
        return None if sess is None else sess.user

    def open_of(self, user: str) -> int:
        """How many open sessions `user` has."""
        return sum(s.user == user for s in self._sessions.values())

    def lookup(self, messages: Sequence[Mapping[str, Any]]) -> Lookup:
        hist = history(messages)
        return Lookup(hist, self._fingerprints.of(hist))

    def admit(
        self, tag: TurnTag, messages: Sequence[Mapping[str, Any]] | Lookup, found: Continuation | None = None
    ) -> Admission:
        """Admit a request for `tag.user` (None: `default`). `found`: what the store knows of the
        conversation it continues (on a store shared by several proxies), among that user's
        sessions; it decides the session of an untagged request and the turn whose next state the
        request carries, instead of this process's own memory. Raises SessionOfAnotherUser, before
        anything changes, when the request names a session another user opened."""
        look = messages if isinstance(messages, Lookup) else self.lookup(messages)
        hist, fps = look.hist, look.fps
        user = tag.user or DEFAULT_USER
        sid, matched, untagged = tag.session_id, False, tag.session_id is None
        if sid is not None and self.owner(sid) not in (None, user):
            raise SessionOfAnotherUser(sid)
        if sid is None:
            self.counts["untagged"] += 1
            if found is not None:
                sid = found.session_id
            else:
                for k in range(len(fps) - 1, -1, -1):  # the longest known prefix wins
                    if (user, fps[k]) in self._index:
                        sid = self._index[user, fps[k]]
                        break
            if sid is not None:
                matched = True
                self.counts["matched"] += 1
        new = sid is None or sid not in self._sessions
        if sid is None:
            sid = f"s-{os.urandom(8).hex()}"
        sess = self._sessions.get(sid)
        if sess is None:
            sess = self._sessions[sid] = _Session(sid, self._clock(), user)
        sess.last_seen = self._clock()
        ttype: TurnType = tag.turn_type or self.default_turn_type
        self.counts[ttype] += 1
        if not tag.train:
            self.counts["no_train"] += 1
        nxt = None
        if found is not None:
            if ttype == "main":
                nxt = _shared_next_state(sid, found.awaiting, hist, fps)
        elif ttype == "main" and sess.awaiting and not _resampled(sess.awaiting, fps):
            nxt = self._next_state(sess, sess.awaiting, hist, fps)
            sess.awaiting = []
        return Admission(
            session_id=sid,
            turn_type=ttype,
            train=tag.train,
            done=tag.done,
            new_session=new,
            matched=matched,
            untagged=untagged,
            source=tag.source or ("matched" if matched else "new"),
            user=user,
            fps=tuple(fps),
            next_state=nxt,
        )

    @staticmethod
    def _next_state(
        sess: _Session, awaiting: Sequence[_Pending], hist: list[Mapping[str, Any]], fps: list[bytes]
    ) -> NextState | None:
        # the choice (or resample) this request continues, whichever it is
        p = next((q for q in reversed(awaiting) if len(fps) >= q.length and fps[q.length - 1] == q.fp), None)
        if p is not None:
            appended, ok = hist[p.length :], True
        else:  # history was rewritten (compaction, edits): what follows the last reply goes to
            # the newest request's first choice
            p = _newest_first_choice(awaiting)
            last = max((i for i, m in enumerate(hist) if m.get("role") == "assistant"), default=-1)
            appended, ok = hist[last + 1 :], False
        if not appended:
            return None
        return NextState(p.turn_id, sess.id, tuple(dict(m) for m in appended), ok)

    @staticmethod
    def reply_keys(adm: Admission, replies: Sequence[Mapping[str, Any]]) -> list[bytes]:
        """The fingerprint of the request's history plus each reply: what a request that
        continues after that reply starts with (a turn's `reply_key`)."""
        base = adm.fps[-1] if adm.fps else b""
        return [extend(base, reply) for reply in replies]

    def complete(
        self, adm: Admission, turn_ids: Sequence[str], replies: Sequence[Mapping[str, Any]],
        keys: Sequence[bytes] | None = None,
    ) -> None:
        """A request was answered (one reply per choice): later requests that extend it join its
        session, and its main turns wait for their next state — every choice of `n > 1`: the
        request that continues one of them gives that one its next state. `keys`: the replies'
        `reply_keys`, when the caller has them already."""
        sess = self._sessions.get(adm.session_id)
        if sess is None:  # closed meanwhile
            return
        base = adm.fps[-1] if adm.fps else b""
        if adm.turn_type == "main" and turn_ids and not _resampled(sess.awaiting, list(adm.fps)):
            sess.awaiting = []
        for i, reply in enumerate(replies):
            fp = keys[i] if keys is not None else extend(base, reply)
            self._index[sess.user, fp] = sess.id
            sess.keys.append(fp)
            if adm.turn_type == "main" and i < len(turn_ids):
                sess.awaiting.append(_Pending(turn_ids[i], fp, len(adm.fps) + 1, base, first=i == 0))
        del sess.awaiting[:-_AWAITING_PER_SESSION]
        while len(sess.keys) > _KEYS_PER_SESSION:
            self._index.pop((sess.user, sess.keys.pop(0)), None)

    def restore(self, turns: Sequence[Any]) -> int:
        """Rebuild the index from stored turns (`Store.open_session_turns`: the last few of each
        open session, in order), as `complete` built it while they were answered: every reply's
        fingerprint joins its session, and a session's newest main turn still without a next
        state waits for one. Returns the number of sessions restored."""
        for turn in turns:
            sess = self._sessions.get(turn.session_id)
            if sess is None:
                sess = self._sessions[turn.session_id] = _Session(turn.session_id, self._clock(), turn.user)
            hist = history(turn.messages)
            fps = fingerprints(hist)
            fp = extend(fps[-1] if fps else b"", turn.response)
            self._index[sess.user, fp] = sess.id
            sess.keys.append(fp)
            while len(sess.keys) > _KEYS_PER_SESSION:
                self._index.pop((sess.user, sess.keys.pop(0)), None)
            if turn.turn_type != "main":
                continue
            if turn.next_state is not None:
                sess.awaiting = []
                continue
            # as `complete` built it: the choices of one request, and the same prompt sampled
            # again, wait together; another history replaces them
            first = not _resampled(sess.awaiting, fps)
            if first:
                sess.awaiting = []
            sess.awaiting.append(_Pending(turn.id, fp, len(fps) + 1, fps[-1] if fps else b"", first=first))
            del sess.awaiting[:-_AWAITING_PER_SESSION]
        return len({turn.session_id for turn in turns})

    def close(self, session_id: str) -> bool:
        sess = self._sessions.pop(session_id, None)
        if sess is None:
            return False
        for k in sess.keys:
            if self._index.get((sess.user, k)) == session_id:
                del self._index[sess.user, k]
        return True

    def close_user(self, user: str) -> list[str]:
        """Forget every open session of `user` (their data was deleted); returns their ids."""
        ids = [s.id for s in self._sessions.values() if s.user == user]
        for sid in ids:
            self.close(sid)
        return ids

    def expire(self) -> list[str]:
        """Close the sessions idle for longer than the timeout; returns their ids."""
        cutoff = self._clock() - self.idle_timeout_s
        idle = [s.id for s in self._sessions.values() if s.last_seen < cutoff]
        for sid in idle:
            self.close(sid)
        return idle
