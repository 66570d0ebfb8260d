"""Many users on one server, strictly apart at serving and capture: who a request is for (its key,
`X-Session-User`, the body's `user` where trusted, else `default`), sessions that belong to the
user who opened them, continuation matching within one user's conversations, and what a user's
key may read. Pure parts in memory; the rest through a live server on loopback with the official
`openai` client and the SDK, a real store (SQLite and PostgreSQL for the store's own parts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import clawbridge
import httpx
import openai
import pytest
import sqlalchemy as sa
from alembic import command
from clawbridge.config import Settings
from clawbridge.learning.learner import Learner
from clawbridge.server import build_backend, learner_hooks
from clawbridge.serving import users
from clawbridge.serving.sessions import SessionOfAnotherUser, Sessions, TurnTag
from clawbridge.serving.users import OPERATOR, Caller
from clawbridge.serving.wire import APIError
from clawbridge.store import Store, TurnRecord
from clawbridge.store.base import alembic_config
from live_server import LiveServer

MODEL = "tiny-random"
ALICE, BOB, OPS, ADMIN = "sk-alice-1111", "sk-bob-2222", "sk-ops-3333", "sk-admin-4444"
QUESTION = [{"role": "user", "content": "What is rain?"}]


# --- who a request is for ------------------------------------------------------------------------
ALICE_KEY = Caller(admin=False, user="alice")
CASES = [  # (caller, X-Session-User, body user, trust the body, the user named | the error's status and code)
    (OPERATOR, None, None, False, None),  # nobody: `default`, or the user of the session it names
    (OPERATOR, "bob", None, False, "bob"),
    (OPERATOR, None, "carol", False, None),  # the body's user is abuse tracking unless trusted
    (OPERATOR, None, "carol", True, "carol"),
    (OPERATOR, "bob", "carol", True, "bob"),  # the header outranks the body
    (ALICE_KEY, None, None, False, "alice"),
    (ALICE_KEY, "alice", None, False, "alice"),
    (ALICE_KEY, None, "carol", False, "alice"),
    (ALICE_KEY, "bob", None, False, (403, "user_mismatch")),
    (ALICE_KEY, None, "bob", True, (403, "user_mismatch")),
    (OPERATOR, "bob/../../etc", None, False, (400, "invalid_user")),
    (OPERATOR, "x" * 65, None, False, (400, "invalid_user")),
    (OPERATOR, None, "-dash-first", True, (400, "invalid_user")),
]


@pytest.mark.parametrize(("caller", "header", "body", "trust", "want"), CASES)
def test_the_user_a_request_names(caller: Caller, header: str | None, body: str | None, trust: bool,
                                  want: Any) -> None:
    if not isinstance(want, tuple):
        assert users.named(caller, header, body, trust) == want
    else:
        with pytest.raises(APIError) as e:
            users.named(caller, header, body, trust)
        assert (e.value.status, e.value.code) == want


def test_a_keys_file_fixes_keys_to_users_marks_admins_and_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  {ALICE}: alice\n  {OPS}: {{admin: true}}\n")
    keys = users.Keys.of(Settings(api_keys_file=path, api_key=ADMIN))
    assert keys.caller(ALICE) == ALICE_KEY and keys.caller(OPS) == keys.caller(ADMIN) == OPERATOR
    assert sorted(k for k, c in keys.entries if c.admin) == sorted([OPS, ADMIN])
    for bad in (None, "", "sk-unknown"):
        with pytest.raises(APIError) as e:
            keys.caller(bad)
        assert e.value.status == 401
    assert users.Keys.of(Settings()).caller(None) == OPERATOR  # no keys: the operator, as always
    for text in ("keys: []", f"keys:\n  {ALICE}: ../alice\n", f"keys:\n  {ALICE}: {{admin: yes-please}}\n", "[]"):
        path.write_text(text)
        with pytest.raises(ValueError, match="keys"):
            users.read_keys_file(path)


def test_off_loopback_a_keys_file_is_a_key() -> None:
    assert Settings(host="0.0.0.0", api_keys_file=Path("keys.yaml")).serving.api_keys_file is not None
    with pytest.raises(ValueError, match="api_keys_file"):
        Settings(host="0.0.0.0")


# --- sessions in memory --------------------------------------------------------------------------
def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_a_session_belongs_to_the_user_who_opened_it() -> None:
    s = Sessions()
    first = s.admit(TurnTag(session_id="s1", user="alice"), QUESTION)
    s.complete(first, ["t1"], [reply("Water.")])
    counts = dict(s.counts)
    with pytest.raises(SessionOfAnotherUser):
        s.admit(TurnTag(session_id="s1", user="bob"), [*QUESTION, reply("Water."), {"role": "user", "content": "ok"}])
    assert s.counts == counts  # refused before anything changed
    nxt = s.admit(TurnTag(session_id="s1", user="alice"), [*QUESTION, reply("Water."), {"role": "user", "content": "ok"}])
    assert nxt.next_state is not None and nxt.next_state.turn_id == "t1"  # still alice's to continue
    assert (s.owner("s1"), s.open_of("alice"), s.open_of("bob")) == ("alice", 1, 0)


def test_an_untagged_conversation_never_continues_another_users() -> None:
    s = Sessions()
    a1 = s.admit(TurnTag(user="alice"), QUESTION)
    s.complete(a1, ["t-alice"], [reply("Water.")])
    # bob's history is alice's exactly (the same question, the same answer): a match but for the user
    b = s.admit(TurnTag(user="bob"), [*QUESTION, reply("Water."), {"role": "user", "content": "thanks"}])
    assert b.session_id != a1.session_id and b.new_session and not b.matched and b.next_state is None
    a2 = s.admit(TurnTag(user="alice"), [*QUESTION, reply("Water."), {"role": "user", "content": "more"}])
    assert a2.session_id == a1.session_id and a2.next_state is not None and a2.next_state.turn_id == "t-alice"


def test_untagged_requests_naming_nobody_are_one_user_as_before() -> None:
    s = Sessions()
    a1 = s.admit(TurnTag(), QUESTION)
    s.complete(a1, ["t1"], [reply("Water.")])
    a2 = s.admit(TurnTag(), [*QUESTION, reply("Water."), {"role": "user", "content": "thanks"}])
    assert a1.user == a2.user == "default" and a2.session_id == a1.session_id and a2.matched


# --- the store ------------------------------------------------------------------------------------
def stored_turn(store: Store, sid: str, user: str, **kw: Any) -> str:
    return store.record_turn(TurnRecord(
        session_id=sid, messages=QUESTION, prompt_ids=(1, 2, 3), completion_ids=(4, 5), logprobs=(-1.0, -2.0),
        version=0, finish_reason="stop", response=reply("Water."), user=user, **kw))


def test_a_session_and_its_turns_keep_their_user(store: Store) -> None:
    tid = stored_turn(store, "s-a", "alice")
    stored_turn(store, "s-d", "default")
    assert store.session_user("s-a") == "alice" and store.session_user("nope") is None
    assert store.get_session("s-a").user == "alice"  # type: ignore[union-attr]
    assert store.get_turn(tid).user == "alice"  # type: ignore[union-attr]
    assert store.turn_users([tid, "turn-unknown"]) == {tid: "alice"}


def test_the_store_continues_a_conversation_among_its_users_own_only(store: Store) -> None:
    """Several proxies on one store ask it which turn a request continues: by fingerprint, and
    only among the request's user's sessions."""
    key = b"k" * 16
    tid = stored_turn(store, "s-a", "alice", prompt_key=b"p" * 16, reply_key=key)
    mine = store.continuation(None, [key], "alice")
    assert mine.session_id == "s-a" and [m.id for m in mine.awaiting] == [tid]
    theirs = store.continuation(None, [key], "bob")
    assert theirs.session_id is None and theirs.matches == () and theirs.awaiting == ()


def test_sessions_restored_after_a_restart_keep_their_users_apart(store: Store) -> None:
    from datetime import UTC, datetime, timedelta

    s = Sessions()
    adm = s.admit(TurnTag(user="alice"), QUESTION)
    [key] = s.reply_keys(adm, [reply("Water.")])
    stored_turn(store, "s-a", "alice", prompt_key=adm.fps[-1], reply_key=key)
    restarted = Sessions()
    assert restarted.restore(store.open_session_turns(datetime.now(UTC) - timedelta(hours=1))) == 1
    follow = [*QUESTION, reply("Water."), {"role": "user", "content": "thanks"}]
    bob = restarted.admit(TurnTag(user="bob"), follow)
    assert bob.session_id != "s-a" and bob.next_state is None
    with pytest.raises(SessionOfAnotherUser):
        restarted.admit(TurnTag(session_id="s-a", user="bob"), follow)
    alice = restarted.admit(TurnTag(user="alice"), follow)
    assert alice.session_id == "s-a" and alice.next_state is not None


def test_migration_0009_gives_every_session_the_default_user_and_takes_it_away(db_url: str) -> None:
    s = Store.open(db_url, migrate=False)
    s.migrate("0008")
    stored = sa.table("sessions", sa.column("id", sa.Text), sa.column("source", sa.String),
                      sa.column("created_at", sa.DateTime(timezone=True)),
                      sa.column("updated_at", sa.DateTime(timezone=True)), sa.column("turns", sa.Integer),
                      sa.column("main_turns", sa.Integer), sa.column("done", sa.Boolean))
    from datetime import UTC, datetime

    now = datetime(2026, 1, 1, tzinfo=UTC)
    with s.engine.begin() as conn:  # a session as 0008 kept it: no user
        conn.execute(stored.insert().values(id="old", source="header", created_at=now, updated_at=now, turns=0,
                                            main_turns=0, done=False))
    s.migrate()
    assert s.session_user("old") == "default"
    with s.engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0008")
    with s.engine.connect() as conn:
        assert "user_name" not in {c["name"] for c in sa.inspect(conn).get_columns("sessions")}
    s.migrate()
    assert s.session_user("old") == "default"
    s.close()


# --- a live server with users' keys --------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("users")
    keys = data / "keys.json"
    keys.write_text(json.dumps({"keys": {ALICE: "alice", BOB: "bob", OPS: {"admin": True}}}))
    settings = Settings(model=MODEL, port=0, data_dir=data, api_key=ADMIN, api_keys_file=keys,
                        default_max_tokens=6, batch_size=1000, judge="rules")
    # the learner's routes (feedback, rollback, preferences, the page) without its loop: nothing trains
    server = LiveServer(settings, build_backend(settings), hooks=learner_hooks(Learner(settings))).start()
    yield server
    server.stop()


def client(live: LiveServer, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, default_headers=headers)


def store_of(live: LiveServer) -> Store:
    assert live.running is not None
    return live.running.store


def turn_count(live: LiveServer) -> int:
    live.settle()
    return store_of(live).stats().turns


def ask(c: openai.OpenAI, messages: list[dict[str, Any]], **headers: str) -> str:
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                  extra_headers=headers or None)
    return r.choices[0].message.content or ""


def get(live: LiveServer, path: str, key: str | None, **headers: str) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(live.url + path, headers={**auth, **headers}, timeout=30)


def post(live: LiveServer, path: str, key: str, body: dict[str, Any] | None = None, **headers: str) -> httpx.Response:
    return httpx.post(live.url + path, json=body or {}, headers={"Authorization": f"Bearer {key}", **headers},
                      timeout=60)


def test_a_users_key_is_that_user_and_cannot_name_another(live: LiveServer) -> None:
    ask(client(live, ALICE), QUESTION, **{"X-Session-Id": "alice-own"})
    assert store_of(live).session_user("alice-own") == "alice"
    before = turn_count(live)
    with pytest.raises(openai.PermissionDeniedError) as e:
        ask(client(live, ALICE), QUESTION, **{"X-Session-User": "bob", "X-Session-Id": "alice-as-bob"})
    assert e.value.status_code == 403 and e.value.code == "user_mismatch"
    assert turn_count(live) == before and store_of(live).get_session("alice-as-bob") is None  # nothing captured
    with pytest.raises(openai.AuthenticationError):
        ask(client(live, "sk-nobody"), QUESTION)


def test_the_body_user_field_is_not_whose_data_it_is_unless_trusted(live: LiveServer) -> None:
    client(live, ADMIN).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, user="carol",  # type: ignore[arg-type]
                                                extra_headers={"X-Session-Id": "body-user"})
    assert store_of(live).session_user("body-user") == "default"


def test_an_admin_key_acts_for_the_user_it_names_and_names_are_checked(live: LiveServer) -> None:
    ask(client(live, OPS), QUESTION, **{"X-Session-Id": "ops-for-alice", "X-Session-User": "alice"})
    ask(client(live, ADMIN), QUESTION, **{"X-Session-Id": "admin-plain"})
    assert store_of(live).session_user("ops-for-alice") == "alice"
    assert store_of(live).session_user("admin-plain") == "default"  # nobody named: as a single-user install
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(live, ADMIN), QUESTION, **{"X-Session-User": "no spaces please"})
    assert e.value.code == "invalid_user"


def test_the_operator_naming_nobody_continues_a_session_as_its_user(live: LiveServer) -> None:
    """An admin key without X-Session-User (an agent's heartbeat in a user's conversation, a client
    resuming a session by id) acts for the session's user; naming another user is refused."""
    answer = ask(client(live, ALICE), QUESTION, **{"X-Session-Id": "alice-resumed"})
    follow = [*QUESTION, {"role": "assistant", "content": answer}, {"role": "user", "content": "and snow?"}]
    ask(client(live, ADMIN), follow, **{"X-Session-Id": "alice-resumed"})
    live.settle()
    first, second = store_of(live).session_turns("alice-resumed")
    assert second.user == "alice" and first.next_state == [{"role": "user", "content": "and snow?"}]
    with pytest.raises(openai.PermissionDeniedError):
        ask(client(live, ADMIN), follow, **{"X-Session-Id": "alice-resumed", "X-Session-User": "bob"})


def test_another_user_naming_a_session_is_refused_and_nothing_attaches(live: LiveServer) -> None:
    alice, bob = client(live, ALICE), client(live, BOB)
    answer = ask(alice, QUESTION, **{"X-Session-Id": "alice-s1"})
    before = turn_count(live)
    follow = [*QUESTION, {"role": "assistant", "content": answer}, {"role": "user", "content": "thanks"}]
    for name in ({"X-Session-Id": "alice-s1"}, {}):  # by header, and by the URL's session prefix
        with pytest.raises(openai.PermissionDeniedError) as e:
            c = bob if name else openai.OpenAI(base_url=f"{live.url}/s/alice-s1/v1", api_key=BOB, max_retries=0)
            ask(c, follow, **name)
        assert e.value.code == "session_of_another_user" and "bob" not in str(e.value.body)
    assert turn_count(live) == before
    [turn] = store_of(live).session_turns("alice-s1")
    assert turn.next_state is None and turn.user == "alice"  # bob's message is not alice's feedback
    r = post(live, "/v1/sessions/alice-s1/done", BOB)
    assert r.status_code == 403 and store_of(live).get_session("alice-s1").done is False  # type: ignore[union-attr]
    # a closed session is still alice's: the store says so once this process forgets it
    assert post(live, "/v1/sessions/alice-s1/done", ALICE).status_code == 200
    with pytest.raises(openai.PermissionDeniedError):
        ask(bob, follow, **{"X-Session-Id": "alice-s1"})


def test_an_untagged_conversation_of_bob_never_becomes_alices_next_state(live: LiveServer) -> None:
    alice, bob = client(live, ALICE), client(live, BOB)
    opening = [{"role": "user", "content": "Name a colour."}]
    answer = ask(alice, opening)
    live.settle()
    [alice_turn] = [t for t in store_of(live).session_turns(_session_of(live, opening, "alice"))]
    # bob sends alice's very conversation (her question, her answer) and a reply of his own
    ask(bob, [*opening, {"role": "assistant", "content": answer}, {"role": "user", "content": "Wrong, try again."}])
    live.settle()
    assert store_of(live).get_turn(alice_turn.id).next_state is None  # type: ignore[union-attr]
    bobs = _session_of(live, opening, "bob")
    assert bobs != alice_turn.session_id and store_of(live).session_user(bobs) == "bob"
    # alice's own follow-up still continues her conversation
    ask(alice, [*opening, {"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks."}])
    live.settle()
    assert store_of(live).get_turn(alice_turn.id).next_state == [{"role": "user", "content": "Thanks."}]  # type: ignore[union-attr]


def _session_of(live: LiveServer, opening: list[dict[str, Any]], user: str) -> str:
    """The session of `user` whose first turn asked `opening`."""
    store = store_of(live)
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT t.session_id FROM turns t JOIN sessions s ON s.id = t.session_id "
                                    "WHERE s.user_name = :u AND t.idx = 0 ORDER BY t.created_at"), {"u": user}).all()
    found = [sid for (sid,) in rows if store.session_turns(sid)[0].messages[: len(opening)] == opening]
    assert len(found) == 1, found
    return str(found[0])


def test_a_users_key_reads_only_its_own_and_no_admin_route(live: LiveServer) -> None:
    ask(client(live, BOB), QUESTION, **{"X-Session-Id": "bob-status"})
    mine = get(live, "/v1/status", BOB).json()
    assert mine["user"] == "bob" and mine["sessions_open"] >= 1 and mine["model"] == MODEL
    assert not {"store", "requests", "turn_counts", "extra", "instruction"} & mine.keys()  # everyone's
    everyone = get(live, "/v1/status", ADMIN).json()
    assert everyone["store"]["turns"] >= 1 and "extra" in everyone
    assert get(live, "/v1/status", OPS).json().keys() == everyone.keys()
    r = get(live, "/metrics", BOB)
    assert r.status_code == 403 and get(live, "/metrics", OPS).status_code == 200
    # the page opens to a user's key, with that user's data alone: tests/test_user_page.py
    metrics = get(live, "/metrics", ADMIN).text
    assert "alice" not in metrics and "bob" not in metrics  # no label per user
    for path in ("/v1/admin/rollback", "/v1/admin/preferences/1/forget"):
        r = post(live, path, BOB, {"version": 0})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    prefs = get(live, "/v1/preferences", BOB).json()
    assert prefs["user"] == "bob" and prefs["data"] == [] and prefs["instruction"] is None  # their own
    assert "instructions" in get(live, "/v1/preferences", ADMIN).json()


def test_a_users_key_lists_their_own_preferences_alone(live: LiveServer) -> None:
    from clawbridge.learning import preferences as prefs

    store = store_of(live)
    ask(client(live, ALICE), QUESTION, **{"X-Session-Id": "alice-pref"})
    ask(client(live, BOB), QUESTION, **{"X-Session-Id": "bob-pref"})
    [a], [b] = (store.session_turns(sid) for sid in ("alice-pref", "bob-pref"))
    store.update_preferences(lambda known: prefs.merge(known, [("Answer in one sentence.", a.id)], 0), "alice")
    store.update_preferences(lambda known: prefs.merge(known, [("Use bullet points.", b.id)], 0), "bob")
    texts = {u: [p["text"] for p in get(live, "/v1/preferences", key).json()["data"]]
             for u, key in (("alice", ALICE), ("bob", BOB), ("admin", ADMIN))}
    assert texts["alice"] == ["Answer in one sentence."] and texts["bob"] == ["Use bullet points."]
    assert sorted(texts["admin"]) == ["Answer in one sentence.", "Use bullet points."]
    r = get(live, "/v1/preferences?user=alice", BOB)  # naming another user: refused
    assert r.status_code == 403 and r.json()["error"]["code"] == "user_mismatch"


def test_a_previous_response_of_another_user_does_not_exist_for_them(live: LiveServer) -> None:
    first = client(live, ALICE).responses.create(model=MODEL, input="Remember: my code is 4711.", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client(live, BOB).responses.create(model=MODEL, input="What was my code?", max_output_tokens=4,
                                           previous_response_id=first.id, extra_headers={"X-Session-Id": "bob-own"})
    assert e.value.code == "previous_response_not_found"
    assert store_of(live).get_session("bob-own") is None
    chained = client(live, ALICE).responses.create(model=MODEL, input="And now?", max_output_tokens=4,
                                                   previous_response_id=first.id)
    assert chained.previous_response_id == first.id


def test_a_user_gives_feedback_on_their_own_turns_only(live: LiveServer) -> None:
    ask(client(live, ALICE), QUESTION, **{"X-Session-Id": "alice-fb"})
    [turn] = store_of(live).session_turns("alice-fb")
    samples = store_of(live).stats().samples
    r = post(live, "/v1/feedback", BOB, {"session_id": "alice-fb", "reward": -1.0})
    assert r.status_code == 403 and r.json()["error"]["code"] == "session_of_another_user"
    r = post(live, "/v1/feedback", BOB, {"turn_id": turn.id, "reward": -1.0})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert store_of(live).stats().samples == samples  # nothing of bob's reached alice's turn
    assert post(live, "/v1/feedback", ALICE, {"session_id": "alice-fb", "reward": 1.0}).status_code == 200
    assert store_of(live).stats().samples != samples


def test_the_sdks_user_is_the_header_a_users_key_must_agree_with(live: LiveServer) -> None:
    with clawbridge.Client(live.url, api_key=ALICE) as cb:
        with cb.session(user="alice") as s:
            s.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
            assert store_of(live).session_user(s.session_id) == "alice"
        with cb.session(user="bob") as s, pytest.raises(openai.PermissionDeniedError):
            s.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]


def test_a_group_of_another_users_episodes_does_not_exist_for_a_users_key(live: LiveServer) -> None:
    group = post(live, "/v1/groups", ALICE, {"n": 1, "task": "alice's secret task"}).json()
    [episode] = group["episodes"]
    ask(client(live, ALICE), QUESTION, **{"X-Session-Id": episode["session_id"]})
    for method, path, body in (("GET", f"/v1/groups/{group['id']}", None),
                               ("POST", f"/v1/episodes/{episode['id']}/outcome", {"outcome": 0.0}),
                               ("POST", f"/v1/groups/{group['id']}/close", None)):
        r = httpx.request(method, live.url + path, json=body, headers={"Authorization": f"Bearer {BOB}"}, timeout=30)
        assert r.status_code == 404 and "secret" not in r.text, (path, r.text)
    assert get(live, f"/v1/groups/{group['id']}", ALICE).json()["state"] == "open"  # bob changed nothing
    assert post(live, f"/v1/episodes/{episode['id']}/outcome", ALICE, {"outcome": 1.0}).json()["outcome"] == 1.0
