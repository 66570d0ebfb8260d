"""Session resolution, untagged matching and next-state capture (pure, in-memory)."""

from __future__ import annotations

from typing import Any

import pytest
from clawbridge.serving.sessions import (
    INTERNAL_CONTEXT_MARKER,
    Sessions,
    TurnTag,
    fingerprints,
    read_tag,
)

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 50}


def internal(n: int) -> dict[str, Any]:
    text = f"{INTERNAL_CONTEXT_MARKER}\nclock tick {n}\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def answer(s: Sessions, msgs: list[dict[str, Any]], rep: dict[str, Any], tag: TurnTag = TurnTag(), turn: str = "t"):
    adm = s.admit(tag, msgs)
    s.complete(adm, [turn], [rep])
    return adm


def test_headers_outrank_url_prefix_and_body():
    tag = read_tag({"x-session-id": "h"}, {"session_id": "b"}, "p")
    assert tag.session_id == "h"
    assert read_tag({}, {"session_id": "b"}, "p").session_id == "p"
    assert read_tag({}, {"session_id": "b"}).session_id == "b"


def test_session_done_train_opt_out_and_turn_type_are_read_from_headers_or_body():
    tag = read_tag({"x-session-done": "true", "x-train": "false", "x-turn-type": "SIDE"}, {})
    assert (tag.done, tag.train, tag.turn_type) == (True, False, "side")
    assert read_tag({}, {"session_done": True, "turn_type": "main"}).done is True
    with pytest.raises(ValueError):
        read_tag({"x-turn-type": "bogus"}, {})


def test_untagged_request_extending_a_reply_joins_that_session():
    s = Sessions()
    first = [SYSTEM, {"role": "user", "content": "hi"}]
    a1 = answer(s, first, reply("hello!"), turn="t1")
    a2 = s.admit(TurnTag(), [*first, reply("hello!"), {"role": "user", "content": "thanks"}])
    assert a1.new_session and not a2.new_session
    assert a2.session_id == a1.session_id and a2.matched
    assert a2.next_state is not None
    assert a2.next_state.turn_id == "t1"
    assert a2.next_state.messages == ({"role": "user", "content": "thanks"},)
    assert a2.next_state.matched


def test_unrelated_untagged_request_opens_a_new_session():
    s = Sessions()
    a1 = answer(s, [SYSTEM, {"role": "user", "content": "hi"}], reply("hello!"))
    a2 = s.admit(TurnTag(), [SYSTEM, {"role": "user", "content": "something else"}])
    assert a2.session_id != a1.session_id and a2.new_session and a2.next_state is None


def test_openclaw_internal_context_is_ignored_for_matching_and_never_a_next_state():
    s = Sessions()
    u1 = {"role": "user", "content": "[Sun 2026-11-22 08:47 UTC] list files"}
    a1 = answer(s, [SYSTEM, u1, internal(1)], reply("Sure."), turn="t1")
    u2 = {"role": "user", "content": "[Sun 2026-11-22 08:48 UTC] thanks"}
    a2 = s.admit(TurnTag(), [SYSTEM, u1, reply("Sure."), u2, internal(2)])
    assert a2.session_id == a1.session_id
    assert a2.next_state is not None and a2.next_state.messages == (u2,)


def test_rewritten_tool_call_ids_and_reserialised_arguments_still_match():
    s = Sessions()
    u = {"role": "user", "content": "read a.txt"}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.txt", "n": 1}'}}
        ],
    }
    a1 = answer(s, [SYSTEM, u, internal(1)], call, turn="t1")
    replayed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "callabc", "type": "function", "function": {"name": "read", "arguments": '{"n":1,"path":"a.txt"}'}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "callabc", "content": "hello"}
    a2 = s.admit(TurnTag(), [SYSTEM, u, replayed, result, internal(2)])
    assert a2.session_id == a1.session_id
    assert a2.next_state is not None and a2.next_state.messages == (result,)


def test_next_state_is_attached_once_and_only_by_main_requests():
    s = Sessions()
    tag = TurnTag(session_id="x")
    m = [{"role": "user", "content": "q"}]
    answer(s, m, reply("a"), tag, turn="t1")
    side = s.admit(TurnTag(session_id="x", turn_type="side"), [{"role": "user", "content": "title?"}])
    assert side.next_state is None
    nxt = s.admit(tag, [*m, reply("a"), {"role": "user", "content": "more"}])
    assert nxt.next_state is not None and nxt.next_state.turn_id == "t1"
    again = s.admit(tag, [*m, reply("a"), {"role": "user", "content": "more"}])
    assert again.next_state is None


def test_rewritten_history_falls_back_to_messages_after_the_last_reply():
    s = Sessions()
    tag = TurnTag(session_id="x")
    answer(s, [{"role": "user", "content": "q"}], reply("a"), tag, turn="t1")
    compacted = [{"role": "system", "content": "summary"}, reply("a2"), {"role": "user", "content": "next"}]
    adm = s.admit(tag, compacted)
    assert adm.next_state is not None and not adm.next_state.matched
    assert adm.next_state.messages == ({"role": "user", "content": "next"},)


def test_default_turn_type_applies_to_untagged_requests_and_is_counted():
    s = Sessions(default_turn_type="side")
    adm = s.admit(TurnTag(), [{"role": "user", "content": "q"}])
    assert adm.turn_type == "side" and adm.untagged
    assert s.counts["side"] == 1 and s.counts["untagged"] == 1


def test_idle_sessions_expire_and_closed_sessions_stop_matching():
    now = [0.0]
    s = Sessions(idle_timeout_s=10, clock=lambda: now[0])
    m = [{"role": "user", "content": "q"}]
    a1 = answer(s, m, reply("a"))
    now[0] = 5
    assert s.expire() == []
    now[0] = 11
    assert s.expire() == [a1.session_id]
    a2 = s.admit(TurnTag(), [*m, reply("a"), {"role": "user", "content": "more"}])
    assert a2.session_id != a1.session_id and a2.next_state is None


def test_fingerprints_ignore_whitespace_padding_but_not_text():
    a = fingerprints([{"role": "user", "content": "hi "}])
    b = fingerprints([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    c = fingerprints([{"role": "user", "content": "ho"}])
    assert a == b and a != c


def test_remembered_fingerprints_equal_a_fresh_hash_as_conversations_grow_branch_and_change():
    from clawbridge.serving.sessions import _Fingerprints, fingerprints

    memo = _Fingerprints(size=4)
    system = {"role": "system", "content": "S " * 1000}
    convo: list[dict] = [system]
    seen = []
    for t in range(6):
        convo.append({"role": "user", "content": f"u{t}"})
        assert memo.of(convo) == fingerprints(convo)
        seen.append(list(convo))
        convo.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{t}", "type": "function", "function": {"name": "f", "arguments": '{"n": 1}'}}]})
    branch = [*seen[2][:-1], {"role": "user", "content": "another way"}]
    assert memo.of(branch) == fingerprints(branch)
    convo[1]["content"] = "edited in place"  # a caller changing its dicts afterwards
    assert memo.of(convo) == fingerprints(convo)
    for other in range(8):  # more conversations than the memo keeps
        msgs = [system, {"role": "user", "content": f"other {other}"}]
        assert memo.of(msgs) == fingerprints(msgs)


def test_the_choice_a_request_continues_gets_the_next_state_whichever_it_is():
    s = Sessions()
    tag = TurnTag(session_id="n3")
    m = [{"role": "user", "content": "pick"}]
    adm = s.admit(tag, m)
    s.complete(adm, ["c0", "c1", "c2"], [reply("zero"), reply("one"), reply("two")])
    nxt = s.admit(tag, [*m, reply("two"), {"role": "user", "content": "why two?"}])
    assert nxt.next_state is not None and nxt.next_state.turn_id == "c2" and nxt.next_state.matched
    assert nxt.next_state.messages == ({"role": "user", "content": "why two?"},)


def test_sampling_the_same_prompt_again_is_nobodys_next_state():
    s = Sessions()
    tag = TurnTag(session_id="again")
    m = [{"role": "user", "content": "q"}]
    answer(s, m, reply("a1"), tag, turn="t1")
    second = s.admit(tag, m)  # the same prompt again (a retry, a second sample)
    assert second.next_state is None
    s.complete(second, ["t2"], [reply("a2")])
    nxt = s.admit(tag, [*m, reply("a1"), {"role": "user", "content": "ok"}])  # continues the first
    assert nxt.next_state is not None and nxt.next_state.turn_id == "t1" and nxt.next_state.matched
    # a rewritten history still falls back to the newest request's first choice
    answer(s, [*m, reply("a1"), {"role": "user", "content": "ok"}], reply("b"), tag, turn="t3")
    adm = s.admit(tag, [{"role": "system", "content": "summary"}, {"role": "user", "content": "next"}])
    assert adm.next_state is not None and adm.next_state.turn_id == "t3" and not adm.next_state.matched
