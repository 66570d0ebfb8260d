"""Each user's own page, strictly apart: through a live server on loopback with a keys file, a
user's key opens `/ui` and reads that user's data alone (turns, a conversation, what is waiting,
the reactions, hints and preferences, the change token), never another user's; the actions that
change everyone's serving stay the admin's, and a user acts on their own preferences only; an
admin key reads everyone's or one user's (`?user=`). Then `clawbridge status --user` and the
read-only page of `clawbridge ui --user` over a data directory."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from clawbridge.config import Settings
from clawbridge.learning import preferences as prefs
from clawbridge.learning.learner import Learner
from clawbridge.server import build_backend, learner_hooks
from clawbridge.store import GateRecord, JudgeVote, Judgment, PolicyVersionRow, Store
from clawbridge.ui.auth import COOKIE
from live_server import LiveServer
from ui_helpers import Served, judge, turn

MODEL = "tiny-random"
ALICE, BOB, OPS, ADMIN = "sk-alice-page-1", "sk-bob-page-2", "sk-ops-page-3", "sk-admin-page-4"
ALICE_ASKS, BOB_ASKS = "alice-secret: what is rain?", "bob-secret: what is snow?"
ALICE_PREF, BOB_PREF = "Answer in one sentence.", "Use bullet points."
ALICE_HINT, BOB_HINT = "alice-hint: answer briefly", "bob-hint: answer with a list"


@dataclasses.dataclass
class Page:
    server: LiveServer
    learner: Learner
    turns: dict[str, list[str]]  # each user's turn ids
    prefs: dict[str, int]  # each user's preference number

    @property
    def store(self) -> Store:
        assert self.server.running is not None
        return self.server.running.store

    def get(self, path: str, key: str | None, **params: str) -> httpx.Response:
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.server.url + path, params=params, headers=auth, timeout=30)

    def post(self, path: str, key: str, body: dict[str, Any], **params: str) -> httpx.Response:
        return httpx.post(self.server.url + path, params=params, json=body,
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def ask(self, key: str, session: str, text: str) -> None:
        c = openai.OpenAI(base_url=f"{self.server.url}/v1", api_key=key, max_retries=0)
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4,
                                  extra_headers={"X-Session-Id": session})
        self.server.settle()


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    data = tmp_path_factory.mktemp("user-page")
    keys = data / "keys.json"
    keys.write_text(json.dumps({"keys": {ALICE: "alice", BOB: "bob", OPS: {"admin": True}}}))
    settings = Settings(model=MODEL, port=0, data_dir=data, api_key=ADMIN, api_keys_file=keys,
                        default_max_tokens=4, batch_size=1000, judge="rules")
    learner = Learner(settings)  # its routes (rollback, pause, preferences) without its loop: nothing trains
    server = LiveServer(settings, build_backend(settings), hooks=learner_hooks(learner)).start()
    p = Page(server, learner, {}, {})
    p.ask(ALICE, "alice-s", ALICE_ASKS)
    p.ask(ALICE, "alice-s2", ALICE_ASKS + " again")
    p.ask(BOB, "bob-s", BOB_ASKS)
    store = p.store
    for user, sessions, hint, reward, text in (("alice", ("alice-s", "alice-s2"), ALICE_HINT, 1.0, ALICE_PREF),
                                               ("bob", ("bob-s",), BOB_HINT, -1.0, BOB_PREF)):
        ids = [t.id for sid in sessions for t in store.session_turns(sid)]
        p.turns[user] = ids
        judged(store, ids[0], reward, hint)
        [pref] = store.update_preferences(lambda known, t=text, tid=ids[0]: prefs.merge(known, [(t, tid)], 0), user)
        p.prefs[user] = pref.id
    store.record_policy_version(PolicyVersionRow(version=1, copy_of=0, user="bob"))  # bob's own adapter
    store.record_gate_decision(GateRecord(1, 0, "accepted", "no worse", {"probe_candidate": 0.5}, "twin",
                                          BOB_PREF, user="bob"))
    yield p
    server.stop()


def judged(store: Store, turn_id: str, reward: float, hint: str) -> None:
    """A judgment with a hint and the turn's sample judged, as the collector leaves them."""
    stored = store.get_turn(turn_id)
    assert stored is not None
    store.add_judgment(Judgment(turn_id=turn_id, judge="rules", kind="hint", votes=(JudgeVote(raw=hint, value=hint),),
                                reward=reward, hint=hint))
    store.create_sample(turn_id, "combine", state="judged", reward=reward, hint=hint,
                        advantages=tuple(reward for _ in stored.completion_ids))


def error_code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


# --- a user's key: the page opens, with that user's data alone -------------------------------------
def test_a_users_key_signs_in_and_the_page_says_whose_it_is(page: Page) -> None:
    assert page.get("/ui", BOB).status_code == 200
    with httpx.Client(base_url=page.server.url) as browser:
        signed = browser.post("/ui/login", data={"key": BOB})
        assert signed.status_code == 303 and BOB not in signed.headers["set-cookie"]
        assert COOKIE in browser.cookies and browser.get("/ui").status_code == 200
        now = browser.get("/ui/api/now").json()
        # the cookie is bob's: alice's conversation does not exist for it
        r = browser.get("/ui/api/sessions/alice-s")
        assert r.status_code == 404 and ALICE_ASKS not in r.text
    assert now["viewer"] == {"admin": False, "user": "bob"} and now["users"] is None  # no user picker


def test_another_users_session_is_not_found_and_says_nothing_of_it(page: Page) -> None:
    mine = page.get("/ui/api/sessions/alice-s", ALICE)
    assert mine.status_code == 200 and ALICE_ASKS in mine.text and mine.json()["session"]["user"] == "alice"
    theirs = page.get("/ui/api/sessions/alice-s", BOB)
    unknown = page.get("/ui/api/sessions/no-such-session", BOB)
    assert theirs.status_code == unknown.status_code == 404
    assert error_code(theirs) == error_code(unknown) == "not_found"
    assert theirs.json()["error"]["message"] == "No session `alice-s` among bob's sessions."
    assert ALICE_ASKS not in theirs.text and "alice" not in theirs.json()["error"]["message"].replace("alice-s", "")
    named = page.get("/ui/api/sessions/alice-s", BOB, user="alice")  # naming alice: refused outright
    assert named.status_code == 403 and error_code(named) == "user_mismatch" and ALICE_ASKS not in named.text


def test_a_users_turns_never_contain_another_users(page: Page) -> None:
    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        params = {"limit": "1", "learning": "0", **({"before": cursor} if cursor else {})}
        r = page.get("/ui/api/turns", ALICE, **params)
        assert r.status_code == 200 and BOB_ASKS not in r.text and BOB_HINT not in r.text
        seen += r.json()["turns"]
        cursor = r.json()["next"]
        if cursor is None:
            break
    assert sorted(t["id"] for t in seen) == sorted(page.turns["alice"])
    assert {t["user"] for t in seen} == {"alice"} and {t["session_id"] for t in seen} == {"alice-s", "alice-s2"}
    r = page.get("/ui/api/turns", ALICE, user="bob")
    assert r.status_code == 403 and error_code(r) == "user_mismatch"


def test_now_and_progress_show_a_user_their_own_counts_reactions_hints_and_preferences(page: Page) -> None:
    now = page.get("/ui/api/now", BOB).json()
    status = now["status"]
    assert status["user"] == "bob" and status["instruction"] is None
    assert not {"requests", "in_flight", "spend", "spool", "data_dir"} & status.keys()  # everyone's, or the operator's
    assert now["waiting"]["samples_to_train"] == 1  # bob's one judged sample, not alice's too
    assert page.get("/ui/api/now", ADMIN).json()["waiting"]["samples_to_train"] == 2
    assert now["actions"] == {"rollback": False, "pause": False, "preferences": True}

    progress = page.get("/ui/api/progress", BOB)
    out = progress.json()
    assert [p["text"] for p in out["preferences"]] == [BOB_PREF] and {p["user"] for p in out["preferences"]} == {"bob"}
    assert [h["hint"] for h in out["hints"]] == [BOB_HINT]
    v0, v1 = out["versions"]
    assert v0["reactions"] == {"judged": 1, "up": 0, "down": 1, "neutral": 0, "mean_reward": -1.0}
    # their own adapter's versions and gate decisions, with the instruction their twin was asked
    # (their own preferences)
    assert v1["user"] == "bob" and v1["gate"]["decision"] == "accepted" and v1["gate"]["asked"] == BOB_PREF
    assert ALICE_PREF not in progress.text and ALICE_HINT not in progress.text
    assert [v["version"] for v in page.get("/ui/api/progress", ALICE).json()["versions"]] == [0]  # not bob's
    everyone = page.get("/ui/api/progress", ADMIN).json()
    assert everyone["versions"][1]["gate"]["asked"] == BOB_PREF and everyone["versions"][1]["user"] == "bob"
    assert everyone["versions"][0]["reactions"]["judged"] == 2


def test_a_users_change_token_moves_with_their_own_data_only(page: Page) -> None:
    token = page.get("/ui/api/now", BOB).json()["token"]
    admin_token = page.get("/ui/api/now", ADMIN).json()["token"]
    page.ask(ALICE, "alice-token", "alice-secret: one more")
    assert page.get("/ui/api/now", ADMIN).json()["token"] != admin_token
    assert page.get("/ui/api/now", BOB).json()["token"] == token  # alice's turn says nothing to bob
    page.ask(BOB, "bob-token", "bob-secret: one more")
    assert page.get("/ui/api/now", BOB).json()["token"] != token


def test_a_users_key_cannot_roll_back_or_pause_training(page: Page) -> None:
    for path, body in (("/ui/api/rollback", {"version": 0}), ("/ui/api/training", {"paused": True})):
        r = page.post(path, BOB, body)
        assert r.status_code == 403 and error_code(r) == "admin_key_required", (path, r.text)
    assert page.learner.paused is None
    assert page.post("/ui/api/training", OPS, {"paused": True}).json()["paused"] is True  # an admin key may
    assert page.post("/ui/api/training", OPS, {"paused": False}).json()["paused"] is False


def test_a_user_acts_on_their_own_preferences_only(page: Page) -> None:
    alice_pref = page.prefs["alice"]
    for action in ("forget", "confirm"):
        r = page.post("/ui/api/preferences", BOB, {"id": alice_pref, "action": action})
        assert r.status_code == 404 and error_code(r) == "preference_not_found" and ALICE_PREF not in r.text
    r = page.post("/ui/api/preferences", OPS, {"id": alice_pref, "action": "forget"}, user="bob")
    assert r.status_code == 404  # an admin naming bob acts on bob's alone
    [kept] = page.store.preferences("alice")
    assert kept.state != "dropped" and not kept.confirmed
    own = page.post("/ui/api/preferences", BOB, {"id": page.prefs["bob"], "action": "forget"})
    assert own.status_code == 200 and own.json()["state"] == "dropped" and own.json()["user"] == "bob"
    assert [p.state for p in page.store.preferences("bob")] == ["dropped"]


# --- an admin key: everyone's, or one user's --------------------------------------------------------
def test_an_admin_key_sees_every_user_and_filters_by_one(page: Page) -> None:
    everyone = page.get("/ui/api/turns", ADMIN, limit="200", learning="0").json()["turns"]
    assert {"alice", "bob"} <= {t["user"] for t in everyone}
    only_alice = page.get("/ui/api/turns", ADMIN, limit="200", learning="0", user="alice").json()["turns"]
    assert only_alice and {t["user"] for t in only_alice} == {"alice"}
    assert {t["id"] for t in only_alice} == {t["id"] for t in everyone if t["user"] == "alice"}
    now = page.get("/ui/api/now", OPS).json()
    assert {"alice", "bob"} <= set(now["users"]) and now["viewer"] == {"admin": True, "user": None}
    assert now["actions"]["rollback"] and now["actions"]["pause"]
    assert page.get("/ui/api/now", OPS, user="alice").json()["viewer"] == {"admin": True, "user": "alice"}
    assert page.get("/ui/api/sessions/bob-s", ADMIN).json()["session"]["user"] == "bob"
    assert page.get("/ui/api/sessions/bob-s", ADMIN, user="alice").status_code == 404
    texts = [p["text"] for p in page.get("/ui/api/progress", ADMIN, user="alice").json()["preferences"]]
    assert texts == [ALICE_PREF]
    bad = page.get("/ui/api/turns", ADMIN, user="no spaces")
    assert bad.status_code == 400 and error_code(bad) == "invalid_user"


# --- the store's queries for one user (SQLite and PostgreSQL) ---------------------------------------
def two_users(store: Store) -> None:
    """Two turns of alice's (two sessions), one of bob's, each judged, and a preference each."""
    for user, asks, pref, reward in (("alice", ALICE_ASKS, ALICE_PREF, 1.0), ("bob", BOB_ASKS, BOB_PREF, -1.0)):
        for i in range(2 if user == "alice" else 1):
            tid = store.record_turn(dataclasses.replace(turn(f"{user}-{i}", asks, "Water."), user=user))
            store.attach_next_state(tid, [{"role": "user", "content": "thanks"}])
            judge(store, tid, reward, hint=f"{user}-hint")
        store.update_preferences(lambda known, t=pref, tid=tid: prefs.merge(known, [(t, tid)], 0), user)


def test_the_page_s_queries_read_one_users_rows_alone(store: Store) -> None:
    from clawbridge.store.browse import Browse

    two_users(store)
    b = Browse(store)
    assert {t["user"] for t in b.turns(user="bob")["turns"]} == {"bob"} and len(b.turns()["turns"]) == 3
    assert b.conversation("alice-0", user="bob") is None and b.conversation("alice-0", user="alice") is not None
    assert b.waiting("bob")["samples_to_train"] == 1 and b.waiting()["samples_to_train"] == 3
    bob = b.progress("bob")
    assert [p.text for p in bob["preferences"]] == [BOB_PREF] and [h["hint"] for h in bob["hints"]] == ["bob-hint"]
    assert bob["versions"][0]["reactions"]["judged"] == 1 and b.progress()["versions"][0]["reactions"]["judged"] == 3
    token = b.token("bob")
    store.record_turn(dataclasses.replace(turn("alice-9", "more", "Water."), user="alice"))
    assert b.token("bob") == token and b.users() == ["alice", "bob"]
    assert (store.stats("bob").turns, store.stats("alice").turns, store.stats().turns) == (1, 3, 4)
    assert store.stats("bob").samples["judged"] == 1 and store.stats("nobody").sessions == 0


# --- the CLI and the read-only page over a data directory -------------------------------------------
@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A finished run's store: alice's and bob's turns, each judged, and a preference each."""
    with Store.open(f"sqlite:///{tmp_path / 'clawbridge.db'}") as store:
        two_users(store)
    return tmp_path


def test_clawbridge_status_of_one_user_counts_theirs_alone(data_dir: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from clawbridge.cli.main import app
    from clawbridge.cli.status import print_status
    from typer.testing import CliRunner

    monkeypatch.setenv("COLUMNS", "250")
    def rows() -> dict[str, str]:
        cells = (line.split("│") for line in capsys.readouterr().out.splitlines())
        return {c[1].strip(): c[2].strip() for c in cells if len(c) == 4}

    print_status(str(data_dir), None, "bob")
    bob = rows()
    print_status(str(data_dir), None)
    everyone = rows()
    assert bob["sessions (done)"] == "1 (0)" and everyone["sessions (done)"] == "3 (0)"
    assert bob["turns: main / side / untagged / opted out"].startswith("1 / ")
    assert bob["samples"].startswith("pending 0 · judged 1 ") and everyone["samples"].startswith("pending 0 · judged 3 ")
    assert bob["preferences"].startswith("1 heard;") and everyone["preferences"].startswith("2 heard;")
    assert bob["policy version of their own adapter"] == everyone["policy version"] == "v0"
    bad = CliRunner().invoke(app, ["status", "--data-dir", str(data_dir), "--user", "../alice"])
    assert bad.exit_code == 2 and "no user's name" in bad.output


def test_the_read_only_page_of_one_user_shows_theirs_alone(data_dir: Path) -> None:
    from clawbridge.ui.live import data_dir_app

    app, store = data_dir_app(Settings(data_dir=data_dir, model=MODEL), user="bob")
    try:
        with Served(app) as served:
            turns = httpx.get(f"{served.url}/ui/api/turns").json()["turns"]
            progress = httpx.get(f"{served.url}/ui/api/progress").text
            session = httpx.get(f"{served.url}/ui/api/sessions/alice-0")
            named = httpx.get(f"{served.url}/ui/api/turns", params={"user": "alice"})
            now = httpx.get(f"{served.url}/ui/api/now").json()
    finally:
        store.close()
    assert [t["user"] for t in turns] == ["bob"] and BOB_PREF in progress and ALICE_PREF not in progress
    assert session.status_code == 404 and named.status_code == 403
    assert now["viewer"] == {"admin": True, "user": "bob"} and now["users"] is None and "spend" not in now["status"]
