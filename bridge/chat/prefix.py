"""Exact comparison of message lists, for what a conversation's next request shares with its last.

The renderer's prompt cache and the store's message deltas both reuse the longest message prefix
a new request shares with an earlier one, and both must be exact: `==` is not, since 1, 1.0 and
True are equal in Python but not in JSON (they render and serialise differently). What is kept
for later comparison is a snapshot, so a caller changing its dicts afterwards changes nothing.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

T = TypeVar("T")


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def same_message(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not dict or type(b) is not dict:
        return same_json(a, b)
    if a != b:  # exact equality implies `==`
        return False
    # Equal dicts whose values are all strings (almost every message) need no walk: a value of
    # `b` equal to a string of `a` is that string (JSON gives no str subclasses).
    for v in a.values():
        if type(v) is not str:
            return same_json(a, b)
    return True


def shared_prefix(old: Sequence[Any], new: Sequence[Any]) -> int:
    """How many leading messages `new` shares with `old`."""
    n = min(len(old), len(new))
    for i in range(n):
        if not same_message(old[i], new[i]):
            return i
    return n


def snapshot(m: Any) -> Any:
    """A copy the caller cannot change (a message of strings needs no deep copy)."""
    if type(m) is dict and all(type(v) is str for v in m.values()):
        return dict(m)
    return copy.deepcopy(m)


def best_prefix(candidates: Iterable[Sequence[Any]], messages: Sequence[Any]) -> tuple[int, int]:
    """(index, shared length) of the candidate sharing the longest prefix with `messages`, the
    first on a tie; (-1, 0) when none shares a message. A candidate must agree at the best
    length so far to beat it, so one comparison rules out most (forks share long prefixes)."""
    best, best_k, n = -1, 0, len(messages)
    if n == 0:
        return best, best_k
    first = messages[0]
    for i, old in enumerate(candidates):
        if best_k and (len(old) <= best_k or not same_message(old[best_k], messages[best_k])):
            continue
        # Most candidates are other conversations: one C-level `!=` on the first message rules
        # them out (exact equality implies `==`, so this never drops a true match).
        if not old or old[0] != first:
            continue
        k = shared_prefix(old, messages)
        if k > best_k:
            best, best_k = i, k
            if k == n:
                break
    return best, best_k


class Found(NamedTuple, Generic[T]):
    key: int
    messages: Sequence[Any]  # the snapshot the item was kept with
    item: T
    shared: int  # leading messages the new list shares with it


class Recent(Generic[T]):
    """The newest `size` items, each kept with the message list it was built from (a snapshot),
    found again by the longest exact message prefix a new list shares with that list. An item
    that the next one extends by all its messages, or all but its last (agents rebuild a last
    message on every request), is superseded: a conversation holds one item, lookups stay short.
    The session fingerprints and the renderer's prompt cache are both one of these."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[int, tuple[Sequence[Any], T]] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._items)

    def find(self, messages: Sequence[Any], accept: Callable[[T], bool] | None = None) -> Found[T] | None:
        """The item sharing the longest prefix with `messages` (the newest on a tie), among those
        `accept` takes; None when none shares a message."""
        candidates = [
            (key, kept, item) for key, (kept, item) in reversed(self._items.items()) if accept is None or accept(item)
        ]
        i, shared = best_prefix((kept for _, kept, _ in candidates), messages)
        if i < 0:
            return None
        key, kept, item = candidates[i]
        return Found(key, kept, item, shared)

    def newest(self) -> T | None:
        last = next(reversed(self._items.values()), None)
        return None if last is None else last[1]

    def put(self, messages: Sequence[Any], item: T, base: Found[T] | None = None) -> None:
        """Keep `item` under `messages` (a snapshot the caller will not change); `base`, what
        `find` gave for them, leaves if this extends it by all or all but its last message."""
        if base is not None and base.shared >= len(base.messages) - 1:
            self._items.pop(base.key, None)
        self._items[self._next] = (messages, item)
        self._next += 1
        while len(self._items) > self.size:
            self._items.popitem(last=False)
