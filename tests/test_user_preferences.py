"""Each user's own standing preferences: a correction is heard into its turn's user's preferences
alone (the real collector's quick pass with the rules judge, on SQLite and PostgreSQL), so one
user's hearings never count for another's; each user is served the instruction of their own
applied preferences (a live server on loopback, users' keys, the learner's collector and the
official `openai` client); forgetting one user's leaves another's; a user's key neither lists
nor changes another user's; migration 0010 up and down."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
from alembic import command
from clawbridge.config import Settings
from clawbridge.learning import preferences as prefs
from clawbridge.store import Store, TurnRecord
from clawbridge.store.base import alembic_config
from live_server import LiveServer, with_learner

MODEL = "tiny-random"
CORRECTION = "Too long. Answer in one short sentence."
QUESTION = [{"role": "user", "content": "What is rain?"}]


# --- hearing: the store and the collector ------------------------------------------------------
def said(store: Store, sid: str, user: str, reply: str) -> str:
    """A main turn of `user`'s session `sid`, the user's reply to it attached (what the rules judge
    reads the correction from)."""
    tid = store.record_turn(TurnRecord(
        session_id=sid, messages=QUESTION, prompt_ids=(1, 2, 3), completion_ids=(4, 5), logprobs=(-1.0, -2.0),
        version=0, finish_reason="stop", response={"role": "assistant", "content": "Rain is water."}, user=user))
    store.attach_next_state(tid, [{"role": "user", "content": reply}])
    return tid


async def test_a_users_corrections_count_for_their_own_preference_alone(db_url: str, data_dir: Path) -> None:
    from clawbridge.backends.local import LocalBackend
    from helpers.learning import collector_for, settings_for

    settings = settings_for(data_dir)
    store = Store.open(db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    told: dict[str, str | None] = {}
    try:
        collector = collector_for(settings, backend, store)
        collector.on_preferences = lambda user, known: told.__setitem__(user, prefs.served_instruction(known))
        said(store, "a1", "alice", CORRECTION)
        said(store, "a2", "alice", CORRECTION)
        said(store, "b1", "bob", CORRECTION)  # the same words, once
        said(store, "c1", "carol", CORRECTION)
        said(store, "d1", "dave", CORRECTION)  # carol and dave: once each
        assert await collector.judge_once() == 5
        [a] = store.preferences("alice")
        assert (a.text, a.count, a.state, a.user) == (CORRECTION, 2, "applied", "alice")
        for user in ("bob", "carol", "dave"):
            [p] = store.preferences(user)
            assert (p.count, p.state, p.user) == (1, "heard", user), user  # never counted with another's
        assert store.preferences() == ()  # `default` heard nothing
        assert told == {"alice": CORRECTION, "bob": None, "carol": None, "dave": None}
        everyone = store.all_preferences()
        assert sorted(p.id for p in everyone) == [1, 2, 3, 4]  # one numbering: a number names one user's
        assert prefs.served_by_user(everyone) == {"alice": CORRECTION}
    finally:
        await backend.close()
        store.close()


def test_forgetting_one_users_preference_leaves_anothers(store: Store) -> None:
    for user in ("alice", "bob"):
        for k in range(2):
            tid = said(store, f"{user}-{k}", user, CORRECTION)
            store.update_preferences(lambda known, t=tid: prefs.merge(known, [(CORRECTION, t)], 0), user)
    [a], [b] = store.preferences("alice"), store.preferences("bob")
    assert (a.state, b.state) == ("applied", "applied") and a.id != b.id
    store.create_sample(b.turns[0], "combine")
    store.create_sample(a.turns[0], "combine")
    with pytest.raises(KeyError):
        store.forget_preference(a.id, "bob")  # a number of alice's is none of bob's
    assert store.preference_owner(a.id) == "alice"
    assert store.forget_preference(a.id, "alice").state == "dropped"
    assert store.drop_preference_samples(a.id, "alice") == 1  # alice's sample; bob's is kept
    assert [p.state for p in store.preferences("bob")] == ["applied"]
    assert prefs.served_by_user(store.all_preferences()) == {"bob": CORRECTION}


def test_migration_0010_gives_every_preference_the_default_user_and_takes_it_away(db_url: str) -> None:
    s = Store.open(db_url, migrate=False)
    s.migrate("0009")
    stored = sa.table("preferences", sa.column("position", sa.Integer), sa.column("text", sa.Text),
                      sa.column("count", sa.Integer), sa.column("turns", sa.JSON),
                      sa.column("first_version", sa.Integer), sa.column("updated_at", sa.DateTime(timezone=True)))
    with s.engine.begin() as conn:  # a preference as 0009 kept it: nobody's, everyone's
        conn.execute(stored.insert().values(position=0, text=CORRECTION, count=1, turns=["t"], first_version=0,
                                            updated_at=datetime(2026, 1, 1, tzinfo=UTC)))
    s.migrate()
    [p] = s.preferences()
    assert (p.user, p.id, p.text) == ("default", 1, CORRECTION) and s.all_preferences() == (p,)
    with s.engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0009")
    with s.engine.connect() as conn:
        assert "user_name" not in {c["name"] for c in sa.inspect(conn).get_columns("preferences")}
        assert conn.execute(sa.text("SELECT text FROM preferences")).scalar() == CORRECTION
    s.migrate()
    assert s.preferences() == (p,)
    s.close()


# --- serving: a live server with users' keys ----------------------------------------------------
ALICE, BOB, ADMIN = "sk-alice-1111", "sk-bob-2222", "sk-admin-4444"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("user-prefs")
    keys = data / "keys.json"
    keys.write_text(json.dumps({"keys": {ALICE: "alice", BOB: "bob"}}))
    # a batch never filled: the collector hears and judges, nothing trains
    settings = Settings(model=MODEL, port=0, data_dir=data, api_key=ADMIN, api_keys_file=keys, default_max_tokens=6,
                        judge="rules", gate="off", batch_size=10_000, lora_rank=4, lora_alpha=4)
    with with_learner(settings) as server:
        yield server


class Person:
    def __init__(self, live: LiveServer, key: str) -> None:
        self.live = live
        self.client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)

    def ask(self, sid: str, messages: list[dict[str, Any]]) -> str:
        r = self.client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                extra_headers={"X-Session-Id": sid})
        self.live.settle()
        return r.choices[0].message.content or ""

    def corrects(self, sid: str, times: int) -> None:
        """A conversation whose answers the user corrects `times` times (each heard from the reply)."""
        msgs: list[dict[str, Any]] = list(QUESTION)
        for _ in range(times):
            msgs += [{"role": "assistant", "content": self.ask(sid, msgs)}, {"role": "user", "content": CORRECTION}]
        self.ask(sid, msgs)  # carries the last correction as the previous turn's next state

    def served(self, sid: str) -> str | None:
        """A new conversation's first turn, and the instruction it was served with."""
        self.ask(sid, [{"role": "user", "content": "What is snow?"}])
        turn = self.live.running.store.last_turn(sid, "main")  # type: ignore[union-attr]
        assert turn is not None
        return turn.instruction


def wait_for(cond: Any, what: str, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.1)


def states(live: LiveServer, user: str) -> list[tuple[str, int]]:
    return [(p.state, p.count) for p in live.running.store.preferences(user)]  # type: ignore[union-attr]


def call(live: LiveServer, method: str, path: str, key: str) -> httpx.Response:
    return httpx.request(method, live.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_each_user_is_served_their_own_preferences_and_changes_only_their_own(live: LiveServer) -> None:
    alice, bob, proxy = Person(live, ALICE), Person(live, BOB), live.proxy
    alice.corrects("alice-c", 2)
    wait_for(lambda: states(live, "alice") == [("applied", 2)], "alice's correction was not applied")
    wait_for(lambda: proxy.standing.of("alice") == CORRECTION, "alice is not served hers")
    assert alice.served("alice-1") == CORRECTION
    assert bob.served("bob-1") is None  # alice's preference is hers alone
    bob.corrects("bob-c", 1)  # the same words, once: bob's own, heard
    wait_for(lambda: states(live, "bob") == [("heard", 1)], "bob's correction was not heard")
    assert states(live, "alice") == [("applied", 2)] and bob.served("bob-2") is None

    bob.corrects("bob-c2", 2)
    wait_for(lambda: states(live, "bob") == [("applied", 3)], "bob's correction was not applied")
    wait_for(lambda: proxy.standing.of("bob") == CORRECTION, "bob is not served his")
    [a], [b] = (live.running.store.preferences(u) for u in ("alice", "bob"))  # type: ignore[union-attr]
    mine = call(live, "GET", "/v1/preferences", BOB).json()
    assert [x["id"] for x in mine["data"]] == [b.id] and mine["instruction"] == CORRECTION
    everyone = call(live, "GET", "/v1/preferences", ADMIN).json()
    assert {(x["id"], x["user"]) for x in everyone["data"]} == {(a.id, "alice"), (b.id, "bob")}
    assert everyone["instructions"] == {"alice": CORRECTION, "bob": CORRECTION}
    assert [x["user"] for x in call(live, "GET", "/v1/preferences?user=alice", ADMIN).json()["data"]] == ["alice"]

    # a user's key changes no one's (bob's key on alice's number), and a number names one user's
    for action in ("confirm", "forget"):
        r = call(live, "POST", f"/v1/admin/preferences/{a.id}/{action}", BOB)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = call(live, "POST", f"/v1/admin/preferences/{a.id}/forget?user=bob", ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "preference_not_found"
    assert states(live, "alice") == [("applied", 2)] and alice.served("alice-2") == CORRECTION

    # forgetting alice's stops hers at once and leaves bob's
    out = call(live, "POST", f"/v1/admin/preferences/{a.id}/forget", ADMIN).json()
    assert (out["user"], out["state"], out["instruction"]) == ("alice", "dropped", None)
    assert alice.served("alice-3") is None
    assert states(live, "bob") == [("applied", 3)] and bob.served("bob-3") == CORRECTION
    assert "clawbridge_preferences_applied 1.0" in call(live, "GET", "/metrics", ADMIN).text

    from clawbridge.cli.main import app
    from typer.testing import CliRunner

    listed = CliRunner().invoke(app, ["preferences", "--data-dir", str(live.settings.data_dir), "--user", "bob"],
                                env={"COLUMNS": "250"})
    assert listed.exit_code == 0 and "bob" in listed.output and "alice" not in listed.output, listed.output
    assert f"served as an instruction now: {CORRECTION}" in listed.output


def test_the_proxy_keeps_each_users_instruction_and_at_most_max_users(monkeypatch: pytest.MonkeyPatch) -> None:
    from clawbridge.serving import instructing

    monkeypatch.setattr(instructing, "MAX_USERS", 2)
    standing = instructing.Standing()
    for user in ("alice", "bob", "carol"):
        standing.set(user, f"{user}'s")
    assert (standing.of("alice"), standing.of("bob"), standing.of("carol")) == (None, "bob's", "carol's")
    standing.set("bob", None)
    assert standing.texts == {"carol": "carol's"} and standing.served == standing.text is None  # default's: none

    async def newest_first() -> dict[str, str]:
        return {"dave": "dave's", "erin": "erin's", "frank": "frank's"}

    standing.source = newest_first
    asyncio.run(standing.refresh())
    assert standing.texts == {"erin": "erin's", "dave": "dave's"}  # the most recently applied kept
    standing.enabled = False  # instant_preferences: false
    assert standing.served_to("dave") is None and standing.of("dave") == "dave's"
