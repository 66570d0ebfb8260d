"""A user's data is theirs to take and to delete: `clawbridge export --user` writes only their
turns, `clawbridge users` counts each user's rows, and deleting a user (`clawbridge users delete`,
`DELETE /v1/admin/users/{name}`) removes exactly their rows, table by table, and leaves every
other user's as they were. A real store (SQLite and PostgreSQL), the real command line (typer's
runner) and a live server on loopback with users' keys and the `openai` client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
from clawbridge.cli.main import app
from clawbridge.config import Settings
from clawbridge.learning.learner import Learner
from clawbridge.server import build_backend, learner_hooks
from clawbridge.store import (
    JudgeVote,
    Judgment,
    NewEpisode,
    Preference,
    Store,
    TrainingStep,
    TurnRecord,
)
from clawbridge.store import schema as t
from live_server import LiveServer
from typer.testing import CliRunner

TABLES = ("sessions", "turns", "next_states", "judgments", "samples", "episodes", "groups", "preferences")


def _turn(store: Store, sid: str, user: str, text: str) -> str:
    return store.record_turn(TurnRecord(
        session_id=sid, messages=[{"role": "user", "content": text}], prompt_ids=(1, 2, 3), completion_ids=(4, 5),
        logprobs=(-1.0, -2.0), version=0, finish_reason="stop", response={"role": "assistant", "content": "ok"},
        user=user))


def give_data(store: Store, user: str, step: int) -> list[str]:
    """Two sessions of `user` with a turn each, every table of theirs filled: next states,
    judgments, a sample trained (training step `step`) and one judged, an episode of their own
    group, one in a group shared with another user, and a preference."""
    tids = [_turn(store, f"{user}-s{i}", user, f"{user} asks {i}") for i in range(2)]
    for i, tid in enumerate(tids):
        store.attach_next_state(tid, [{"role": "user", "content": f"{user} answers {i}"}])
        store.add_judgment(Judgment(turn_id=tid, judge="rules", kind="prm", votes=(JudgeVote(raw="+1", value=1.0),), reward=1.0))
        store.create_sample(tid, "binary", reward=1.0, advantages=(1.0, 1.0))
    first = next(x for x in store.pending_samples(method="binary") if x.turn_id == tids[0])
    store.record_training_step(TrainingStep(step=step, version_before=step - 1, version_after=step), [first.id])
    store.open_group(f"{user}-g", [NewEpisode(id=f"{user}-e", session_id=f"{user}-s0")])
    store.save_preferences([Preference(f"{user} likes it short", 1, (tids[0],), 0)], user)
    return tids


def counts(store: Store, user: str) -> dict[str, int]:
    """Rows of `user`'s in each table (and the groups that hold an episode of theirs)."""
    se, tu, ep = t.sessions.c, t.turns.c, t.episodes.c
    sessions = sa.select(se.id).where(se.user_name == user)
    turns = sa.select(tu.id).where(tu.session_id.in_(sessions))
    where = {
        "sessions": se.user_name == user, "turns": tu.session_id.in_(sessions),
        "next_states": t.next_states.c.turn_id.in_(turns), "judgments": t.judgments.c.turn_id.in_(turns),
        "samples": t.samples.c.turn_id.in_(turns), "episodes": ep.session_id.in_(sessions),
        "groups": t.groups.c.id.in_(sa.select(ep.group_id).where(ep.session_id.in_(sessions))),
        "preferences": t.preferences.c.user_name == user,
    }
    with store.engine.connect() as conn:
        return {n: int(conn.execute(sa.select(sa.func.count()).select_from(t.metadata.tables[n]).where(where[n]))
                       .scalar_one()) for n in TABLES}


def totals(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {n: int(conn.execute(sa.select(sa.func.count()).select_from(t.metadata.tables[n])).scalar_one())
                for n in TABLES}


@pytest.fixture
def two_users(store: Store) -> Store:
    give_data(store, "alice", 1)
    give_data(store, "bob", 2)
    store.open_group("shared", [NewEpisode(id="sh-a", session_id="alice-s1"), NewEpisode(id="sh-b", session_id="bob-s1")])
    return store


def test_export_of_one_user_has_their_turns_only(two_users: Store, tmp_path: Path) -> None:
    n = two_users.export_jsonl(tmp_path / "alice.jsonl", user="alice")
    rows = [json.loads(line) for line in (tmp_path / "alice.jsonl").read_text().splitlines()]
    assert n == len(rows) == 2
    assert {r["session_id"] for r in rows} == {"alice-s0", "alice-s1"} and {r["user"] for r in rows} == {"alice"}
    assert all("alice asks" in r["messages"][0]["content"] for r in rows)
    assert all(r["judgments"] and r["samples"] and "alice answers" in r["next_state"][0]["content"] for r in rows)
    assert two_users.export_jsonl(tmp_path / "all.jsonl") == 4  # without a user: everyone's, as before


def test_each_user_is_counted_by_their_own_rows(two_users: Store) -> None:
    by_user = {c.user: c for c in two_users.user_counts()}
    assert set(by_user) == {"alice", "bob"}
    a = by_user["alice"]
    assert (a.sessions, a.turns, a.preferences) == (2, 2, 1)
    assert a.samples["trained"] == 1 and a.samples["judged"] == 1


def test_deleting_a_user_removes_exactly_their_rows(two_users: Store) -> None:
    alice, bob, before = counts(two_users, "alice"), counts(two_users, "bob"), totals(two_users)
    assert all(alice[n] for n in TABLES) and all(bob[n] for n in TABLES)  # every table holds some of each
    gone = two_users.delete_user("alice")
    assert counts(two_users, "alice") == dict.fromkeys(TABLES, 0)
    assert counts(two_users, "bob") == bob
    after = totals(two_users)
    # alice's groups: her own goes, the one shared with bob stays (his episode is in it)
    assert gone.rows == {**alice, "groups": 1} and after == {n: before[n] - gone.rows[n] for n in TABLES}
    assert two_users.get_group("shared") is not None and two_users.get_group("alice-g") is None
    # her trained sample is gone; the step that trained it, and its version, say where to roll back to
    assert (gone.trained, gone.first_step, gone.rollback_to) == (1, 1, 0)
    assert len(two_users.training_steps()) == 2
    assert two_users.delete_user("alice").total == 0  # a second time: nothing left


def test_the_default_user_is_deleted_like_any_other(two_users: Store) -> None:
    give_data(two_users, "default", 3)
    alice = counts(two_users, "alice")
    two_users.delete_user("default")
    assert counts(two_users, "default") == dict.fromkeys(TABLES, 0) and counts(two_users, "alice") == alice


# --- the command line ----------------------------------------------------------------------------
@pytest.fixture
def data_dir_of_two(data_dir: Path) -> Path:
    with Store.open(f"sqlite:///{data_dir / 'clawbridge.db'}") as store:
        give_data(store, "alice", 1)
        give_data(store, "bob", 2)
    return data_dir


def test_the_cli_exports_lists_and_deletes_one_users_data(data_dir_of_two: Path, tmp_path: Path) -> None:
    cli, d = CliRunner(), str(data_dir_of_two)
    out = cli.invoke(app, ["export", "--data-dir", d, "--user", "bob", "--out", str(tmp_path / "bob.jsonl")])
    assert out.exit_code == 0, out.output
    assert {json.loads(r)["session_id"] for r in (tmp_path / "bob.jsonl").read_text().splitlines()} == {"bob-s0", "bob-s1"}
    listed = cli.invoke(app, ["users", "--data-dir", d])
    assert listed.exit_code == 0 and "alice" in listed.output and "bob" in listed.output
    refused = cli.invoke(app, ["users", "delete", "alice", "--data-dir", d], input="n\n")  # asked, and said no
    assert refused.exit_code != 0 and "Delete alice's 2 sessions, 2 turns, 1 preferences" in refused.output
    done = cli.invoke(app, ["users", "delete", "alice", "--yes", "--data-dir", d])
    assert done.exit_code == 0, done.output
    assert "deleted alice's data: 2 next_states, 2 judgments, 2 samples" in done.output
    assert "clawbridge rollback 0" in done.output  # her trained sample: the weights since v0 may carry it
    with Store.open(f"sqlite:///{data_dir_of_two / 'clawbridge.db'}") as store:
        assert [c.user for c in store.user_counts()] == ["bob"]
        assert counts(store, "bob")["turns"] == 2
    again = cli.invoke(app, ["users", "delete", "alice", "--yes", "--data-dir", d])
    assert again.exit_code == 1 and "no data of 'alice'" in again.output


def test_the_cli_does_not_delete_under_a_server_that_holds_the_store(data_dir_of_two: Path) -> None:
    with Store.open(f"sqlite:///{data_dir_of_two / 'clawbridge.db'}") as serving:
        serving.claim_serving()  # what `clawbridge up` does
        out = CliRunner().invoke(app, ["users", "delete", "alice", "--yes", "--data-dir", str(data_dir_of_two)])
        assert out.exit_code == 1 and "--url" in out.output
        assert counts(serving, "alice")["turns"] == 2


# --- a live server -------------------------------------------------------------------------------
ALICE, BOB, ADMIN = "sk-alice-1111", "sk-bob-2222", "sk-admin-4444"


@pytest.fixture
def live(tmp_path: Path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {ALICE: "alice", BOB: "bob"}}))
    settings = Settings(model="tiny-random", port=0, data_dir=tmp_path / "data", api_key=ADMIN, api_keys_file=keys,
                        default_max_tokens=4, batch_size=1000, judge="rules")
    server = LiveServer(settings, build_backend(settings), hooks=learner_hooks(Learner(settings))).start()
    yield server
    server.stop()


def delete(live: LiveServer, name: str, key: str) -> httpx.Response:
    return httpx.delete(f"{live.url}/v1/admin/users/{name}", headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_the_admin_deletes_one_users_data_through_the_server_and_a_users_key_cannot(live: LiveServer) -> None:
    for key, who in ((ALICE, "alice"), (BOB, "bob")):
        c = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)
        for i in range(2):
            c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": f"{who} {i}"}],
                                      extra_headers={"X-Session-Id": f"{who}-{i}"})
    live.settle()
    assert live.running is not None
    store = live.running.store
    bob = counts(store, "bob")
    for key in (BOB, ALICE):  # a user's key deletes nobody, themselves included
        r = delete(live, "alice", key)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_key_required")
    assert counts(store, "alice")["turns"] == 2
    r = delete(live, "alice", ADMIN)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert out["user"] == "alice" and out["deleted"]["turns"] == 2 and out["deleted"]["sessions"] == 2
    assert counts(store, "alice") == dict.fromkeys(TABLES, 0) and counts(store, "bob") == bob
    assert delete(live, "alice", ADMIN).status_code == 404  # nothing of hers is left
    assert delete(live, "../etc", ADMIN).status_code in (400, 404)
