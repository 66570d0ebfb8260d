"""Exact message-prefix comparison (`clawbridge.chat.prefix`): what the renderer's prompt cache, the
session fingerprints and the store's message deltas reuse must be equal as JSON, not as Python."""

from __future__ import annotations

from clawbridge.chat.prefix import best_prefix, same_message, shared_prefix, snapshot

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {"x": 1}}}]}


def test_messages_equal_as_json_are_the_same_and_python_equality_is_not_enough() -> None:
    assert same_message(U, dict(U))
    assert same_message(CALL, snapshot(CALL))
    assert not same_message(U, {"role": "user", "content": "hi "})
    assert not same_message({"role": "user", "n": 1}, {"role": "user", "n": 1.0})
    assert not same_message({"role": "user", "n": 1}, {"role": "user", "n": True})
    as_float = snapshot(CALL)
    as_float["tool_calls"][0]["function"]["arguments"]["x"] = 1.0
    assert as_float == CALL and not same_message(CALL, as_float)


def test_shared_prefix_counts_leading_messages_in_common() -> None:
    assert shared_prefix([U, A, U], [U, A, A]) == 2
    assert shared_prefix([U, A], [U, A, U]) == 2
    assert shared_prefix([], [U]) == 0


def test_best_prefix_takes_the_longest_shared_prefix_and_the_first_on_a_tie() -> None:
    other = [{"role": "user", "content": "another conversation"}, A]
    short, longer = [U, A], [U, A, U, A]
    assert best_prefix([other, short, longer], [U, A, U, A, U]) == (2, 4)
    assert best_prefix([short, [U, A, {"role": "user", "content": "x"}]], [U, A, U]) == (0, 2)
    assert best_prefix([other], [U]) == (-1, 0)
    assert best_prefix([short], []) == (-1, 0)


def test_a_first_message_equal_only_in_python_is_no_match() -> None:
    # The quick `!=` on first messages lets such a candidate through; the exact check stops it.
    old = [{"role": "user", "content": "hi", "n": 1}, A]
    assert best_prefix([old], [{"role": "user", "content": "hi", "n": 1.0}, A]) == (-1, 0)


def test_recent_finds_the_longest_prefix_supersedes_what_it_extends_and_keeps_the_newest() -> None:
    from clawbridge.chat.prefix import Recent

    recent: Recent[str] = Recent(size=2)
    assert recent.find([U]) is None and recent.newest() is None
    recent.put([U], "first")
    found = recent.find([U, A, U])
    assert found is not None and (found.item, found.shared) == ("first", 1)
    recent.put([U, A, U], "second", found)  # extends "first" by all its messages: it leaves
    assert len(recent) == 1 and recent.newest() == "second"
    other = [{"role": "user", "content": "another conversation"}]
    recent.put(other, "third", recent.find(other))
    recent.put([A], "fourth")  # size 2: the oldest goes
    assert len(recent) == 2 and recent.find([U, A, U]) is None
    assert recent.find(other, accept=lambda item: item != "third") is None
