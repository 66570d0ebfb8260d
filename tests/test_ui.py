"""The page's routes over real HTTP on loopback and a real SQLite store: sign-in and the key,
pagination, what each turn's badge says, a conversation, the versions with their reactions and
gate decisions, the change token the page polls, and that the page fetches nothing from
elsewhere. The page itself, in a real browser: tests/test_ui_browser.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from clawbridge.config import Settings
from clawbridge.store import GateRecord, PolicyVersionRow, Preference, Store
from clawbridge.store.browse import turn_status
from clawbridge.ui import Board, ui_routes
from clawbridge.ui.auth import COOKIE, session_token
from clawbridge.ui.live import offline_board
from starlette.applications import Starlette
from ui_helpers import Served, judge, seed_store, turn

KEY = "ui-test-key"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'data' / 'clawbridge.db'}"
    else:
        url = request.getfixturevalue("pg_cluster").create_schema()
    with Store.open(url) as s:
        yield s


def board_for(store: Store, tmp_path: Path, key: str | None, **kw: Any) -> Board:
    settings = Settings(data_dir=tmp_path / "data", api_key=key, model="tiny-random")
    board = offline_board(settings, store)
    for k, v in kw.items():
        setattr(board, k, v)
    return board


def serve(board: Board) -> Served:
    return Served(Starlette(routes=ui_routes(lambda _request: board)))


def test_the_page_and_its_assets_come_from_this_server_only(store: Store, tmp_path: Path) -> None:
    with serve(board_for(store, tmp_path, None)) as app:
        page = httpx.get(f"{app.url}/ui")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
        assert httpx.get(f"{app.url}/").headers.get("location") == "/ui"
        texts = [page.text]
        for name in ("app.js", "app.css"):
            r = httpx.get(f"{app.url}/ui/static/{name}")
            assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff"
            texts.append(r.text)
        assert httpx.get(f"{app.url}/ui/static/..%2Fauth.py").status_code == 404
    for text in texts:  # offline: no other origin, no CDN, nothing fetched but our own paths
        text = text.replace('"http://www.w3.org/2000/svg"', "SVG_NAMESPACE")  # a name, never fetched
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), re.findall(r"https?://\S+", text)
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text and "eval(" not in text


def test_with_a_key_the_page_asks_for_it_once_and_keeps_a_cookie_not_the_key(store: Store, tmp_path: Path) -> None:
    seed_store(store, 3)
    with serve(board_for(store, tmp_path, KEY)) as app, httpx.Client(base_url=app.url) as browser:
        first = browser.get("/ui")
        assert first.status_code == 401 and 'name="key"' in first.text  # the sign-in form
        for path in ("/ui/api/now", "/ui/api/progress", "/ui/api/turns", "/ui/api/sessions/s0"):
            r = httpx.get(app.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(app.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(app.url + path, headers=BEARER).status_code == 200  # header auth, as the API

        wrong = browser.post("/ui/login", data={"key": "nope"})
        assert wrong.status_code == 401 and COOKIE not in browser.cookies and "not this server" in wrong.text
        signed = browser.post("/ui/login", data={"key": KEY})
        assert signed.status_code == 303 and signed.headers["location"] == "/ui"
        cookie = signed.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and KEY not in cookie
        assert browser.cookies[COOKIE] == session_token(KEY)
        assert browser.get("/ui").status_code == 200
        assert browser.get("/ui/api/turns").json()["turns"]

        # an action with the cookie alone could come from a form on another local port: refused
        bare = browser.post("/ui/api/training", json={"paused": True})
        assert bare.status_code == 403 and bare.json()["error"]["code"] == "missing_ui_header"
        page_like = browser.post("/ui/api/training", json={"paused": True}, headers={"X-Clawbridge-UI": "1"})
        assert page_like.status_code == 409  # authorised; no learning loop runs on a data directory
        forged = httpx.get(app.url + "/ui/api/now", cookies={COOKIE: "0" * 64})
        assert forged.status_code == 401

        browser.post("/ui/logout")
        assert browser.get("/ui/api/now").status_code == 401


def test_without_a_key_a_loopback_page_is_open(store: Store, tmp_path: Path) -> None:
    with serve(board_for(store, tmp_path, None)) as app:
        now = httpx.get(f"{app.url}/ui/api/now").json()
    assert now["status"]["live"] is False and now["actions"] == {"rollback": False, "pause": False, "preferences": False}
    assert now["waiting"] == {"samples_being_judged": 0, "samples_to_train": 0, "turns_to_judge": 0,
                              "turns_window": 1000}


def test_turns_come_newest_first_a_page_at_a_time(store: Store, tmp_path: Path) -> None:
    ids = seed_store(store, 75)
    seen: list[str] = []
    with serve(board_for(store, tmp_path, None)) as app:
        cursor, sizes = None, []
        while True:
            r = httpx.get(f"{app.url}/ui/api/turns", params={"limit": 30, **({"before": cursor} if cursor else {})})
            page = r.json()
            sizes.append(len(page["turns"]))
            seen += [t["id"] for t in page["turns"]]
            cursor = page["next"]
            if cursor is None:
                break
        assert httpx.get(f"{app.url}/ui/api/turns", params={"before": "garbage!"}).status_code == 400
        assert httpx.get(f"{app.url}/ui/api/turns", params={"limit": "x"}).status_code == 400
        huge = httpx.get(f"{app.url}/ui/api/turns", params={"limit": 10_000}).json()
    assert sizes == [30, 30, 15] and seen == ids[::-1]
    assert len(huge["turns"]) == 75  # under the cap of 200 a page


def test_each_turn_says_where_it_is_in_the_learning_loop(store: Store, tmp_path: Path) -> None:
    def rec(name: str, **kw: Any) -> str:
        return store.record_turn(turn(f"sess-{name}", f"ask {name}", f"answer {name}", **kw))

    waiting_reply = rec("reply")
    waiting_judge = rec("judge")
    store.attach_next_state(waiting_judge, [{"role": "user", "content": "ok"}])
    side = rec("side", turn_type="side")
    opted = rec("opt", train=False)
    pending = rec("pending")
    judge(store, pending, 0.0, state="pending")
    judged = rec("judged")
    judge(store, judged, 1.0, hint="answer in one sentence")
    dropped = rec("dropped")
    judge(store, dropped, 0.0, state="dropped", reason="no signal (prm: reward +0, no hint)")
    trained = rec("trained")
    judge(store, trained, -1.0, hint="shorter", state="trained", step=1)
    with serve(board_for(store, tmp_path, None)) as app:
        turns = {t["id"]: t for t in httpx.get(f"{app.url}/ui/api/turns").json()["turns"]}
    assert turns[waiting_reply]["status"] == "waiting for the user's next message"
    assert turns[waiting_judge]["status"] == "waiting for the judge" and turns[waiting_judge]["next"][0]["text"] == "ok"
    assert turns[side]["state"] == "side" and turns[opted]["state"] == "opted_out"
    assert turns[pending]["status"] == "being judged"
    assert turns[judged]["status"] == "judged, waiting for a training step"
    assert turns[judged]["reward"] == 1.0 and turns[judged]["votes"] == [1.0, 1.0, 1.0]
    assert turns[judged]["hint"] == "answer in one sentence"
    assert turns[dropped]["status"] == "dropped: no signal (prm: reward +0, no hint)"
    assert turns[trained]["status"] == "trained in step 1" and turns[trained]["reward"] == -1.0
    assert turns[trained]["asked"] == "ask trained" and turns[trained]["answer"] == "answer trained"
    with serve(board_for(store, tmp_path, None)) as app:
        learning = {t["id"] for t in httpx.get(f"{app.url}/ui/api/turns", params={"learning": "1"}).json()["turns"]}
    assert learning == set(turns) - {side, opted}


def test_pure_status_names_every_state() -> None:
    assert turn_status("main", True, False, None)[0] == "waiting_reply"
    assert turn_status("main", True, True, {"state": "trained", "step": None})[1] == "trained"
    assert turn_status("main", True, True, {"state": "dropped", "reason": None})[1] == "dropped: no reason stored"


def test_a_conversation_reads_in_order_a_page_at_a_time(store: Store, tmp_path: Path) -> None:
    seed_store(store, 12, per_session=12)
    long = "x" * 5000
    store.record_turn(turn("s0", long, "fine", history=[{"role": "system", "content": "be nice"}]))
    with serve(board_for(store, tmp_path, None)) as app:
        first = httpx.get(f"{app.url}/ui/api/sessions/s0", params={"limit": 5}).json()
        rest = httpx.get(f"{app.url}/ui/api/sessions/s0", params={"after": first["next"], "limit": 50}).json()
        missing = httpx.get(f"{app.url}/ui/api/sessions/nobody")
    assert [t["index"] for t in first["turns"]] == [0, 1, 2, 3, 4] and first["next"] == "4"
    assert [t["index"] for t in rest["turns"]] == list(range(5, 13)) and rest["next"] is None
    assert first["session"]["turns"] == 13
    assert first["turns"][0]["messages"] == [{"role": "user", "text": "question 0"}]
    last = rest["turns"][-1]
    assert last["messages"][0] == {"role": "system", "text": "be nice"}
    assert last["messages"][1]["text"].startswith("x" * 2000) and "3000 more characters" in last["messages"][1]["text"]
    assert missing.status_code == 404


def test_versions_carry_reactions_the_gate_s_figures_and_rollbacks(store: Store, tmp_path: Path) -> None:
    seed_store(store, 6)  # served by v0: +1, 0, -1, +1, 0, -1
    for i, r in enumerate((1.0, 1.0, 1.0, -1.0)):
        tid = store.record_turn(turn("later", f"q{i}", f"a{i}", version=1))
        store.attach_next_state(tid, [{"role": "user", "content": "thanks"}])
        judge(store, tid, r, state="trained" if i == 0 else "judged", step=1)
    store.record_policy_version(PolicyVersionRow(version=2, copy_of=0))
    # figures the page has never heard of are shown too
    store.record_gate_decision(GateRecord(1, 0, "accepted", "no worse than the twin",
                                          {"probe_candidate": 0.6, "probe_twin": 0.58, "probe_p_vs_twin": 0.4}, "twin"))
    store.save_preferences([  # as learning.preferences keeps them: each in its state
        Preference(t, n, ("turn-x",), 1, state=s, kind=k)  # type: ignore[arg-type]
        for t, n, s, k in (("be brief", 5, "applied", "length"), ("no lists", 1, "heard", "format"),
                           ("use metric units", 3, "heard", None), ("say please", 2, "dropped", None))])
    with serve(board_for(store, tmp_path, None)) as app:
        out = httpx.get(f"{app.url}/ui/api/progress").json()
    vs = {v["version"]: v for v in out["versions"]}
    assert sorted(vs) == [0, 1, 2]
    assert vs[0]["reactions"] == {"judged": 6, "up": 2, "down": 2, "neutral": 2, "mean_reward": 0.0}
    assert vs[1]["reactions"]["up"] == 3 and vs[1]["reactions"]["mean_reward"] == pytest.approx(0.5)
    assert vs[1]["step"] == 1 and vs[1]["gate"]["reference"] == "twin" and vs[1]["gate"]["serving"] == 0
    assert vs[1]["gate"]["figures"]["probe_p_vs_twin"] == 0.4
    assert vs[2]["restores"] == 0 and vs[2]["gate"] is None
    assert out["steps"][0]["step"] == 1 and out["steps"][0]["metrics"]["loss"] == 0.1
    assert {h["hint"] for h in out["hints"]} == {"be brief"}
    # the applied first, then the heard (most heard first), then the dropped; with the reason
    assert [(p["id"], p["text"], p["state"]) for p in out["preferences"]] == [
        (1, "be brief", "applied"), (3, "use metric units", "heard"), (2, "no lists", "heard"),
        (4, "say please", "dropped")]
    assert out["preferences"][1]["note"] == "not about the form of an answer: applied only if you confirm it"


def test_the_change_token_moves_with_every_thing_the_page_shows(store: Store, tmp_path: Path) -> None:
    board = board_for(store, tmp_path, None)
    tokens = [board.browse.token()]

    def moved() -> bool:
        tokens.append(board.browse.token())
        return tokens[-1] != tokens[-2]

    assert not moved()
    tid = store.record_turn(turn("t", "q", "a"))
    assert moved()
    store.attach_next_state(tid, [{"role": "user", "content": "more"}])
    assert moved()
    sid = judge(store, tid, 1.0)
    assert moved()
    store.mark_samples([sid], "dropped", "test")
    assert moved()
    store.record_gate_decision(GateRecord(1, 0, "rejected", "r"))
    assert moved()
    store.save_preferences([Preference("be brief", 1, (), 1)])
    assert moved()
    store.save_preferences([Preference("be brief", 2, ("t",), 1)])  # a hint counted for it
    assert moved()
    store.record_policy_version(PolicyVersionRow(version=1, copy_of=0))
    assert moved()
    assert not moved()


def test_actions_validate_their_bodies(store: Store, tmp_path: Path) -> None:
    calls: list[Any] = []

    async def rollback(version: int) -> dict[str, Any]:
        calls.append(("rollback", version))
        return {"version": 9, "restored": version, "previous": 8}

    def pause(paused: bool) -> dict[str, Any]:
        calls.append(("pause", paused))
        return {"paused": paused}

    async def preference(action: str, pref_id: int, user: str | None) -> dict[str, Any]:
        calls.append((action, pref_id))
        return {"id": pref_id, "state": "dropped"}

    board = board_for(store, tmp_path, KEY, rollback=rollback, pause=pause, preference=preference)
    with serve(board) as app:
        def post(path: str, body: Any) -> httpx.Response:
            return httpx.post(app.url + path, json=body, headers=BEARER)

        for bad in ({}, {"version": -1}, {"version": "1"}, {"version": True}, [1]):
            assert post("/ui/api/rollback", bad).status_code == 400
        assert post("/ui/api/training", {"paused": "yes"}).status_code == 400
        assert httpx.post(app.url + "/ui/api/rollback", json={"version": 1}).status_code == 401
        assert post("/ui/api/rollback", {"version": 1}).json()["restored"] == 1
        assert post("/ui/api/training", {"paused": True}).json() == {"paused": True}
        for bad in ({}, {"id": 0, "action": "forget"}, {"id": "1", "action": "forget"}, {"id": 1, "action": "delete"}):
            assert post("/ui/api/preferences", bad).status_code == 400
        assert post("/ui/api/preferences", {"id": 2, "action": "forget"}).json()["state"] == "dropped"
        now = httpx.get(app.url + "/ui/api/now", headers=BEARER).json()
    assert calls == [("rollback", 1), ("pause", True), ("forget", 2)]
    assert now["actions"] == {"rollback": True, "pause": True, "preferences": True}


def test_the_kept_reaction_sums_match_a_fresh_sum_as_samples_settle(store: Store, tmp_path: Path) -> None:
    from clawbridge.store.browse import Browse, reactions

    ids = seed_store(store, 9)
    browse = Browse(store)
    late = store.record_turn(turn("late", "q", "a"))
    pending = judge(store, late, 0.0, state="pending")  # no reward yet: it is being judged
    more = seed_store(store, 3, per_session=3)
    with store.engine.connect() as conn, conn.begin():
        assert browse.reactions(conn) == reactions(conn)
    store.set_sample_advantages(pending, (1.0, 1.0), reward=1.0)  # settles after newer samples
    judge(store, store.record_turn(turn("later", "q", "a", version=1)), -1.0)
    with store.engine.connect() as conn, conn.begin():
        kept, fresh = browse.reactions(conn), reactions(conn)
    assert kept == fresh and kept[0]["judged"] == len(ids) + len(more) + 1 and kept[1]["down"] == 1
    # SQLite commits ids in order, so the settled sums are kept; PostgreSQL sums afresh
    assert (browse.reactions.mark > 0) == (store.dialect == "sqlite")


def test_a_finished_run_s_data_directory_is_served_read_only(tmp_path: Path) -> None:
    from clawbridge.ui.live import data_dir_app

    with Store.open(f"sqlite:///{tmp_path / 'data' / 'clawbridge.db'}") as store:
        seed_store(store, 5)
    app, reopened = data_dir_app(Settings(data_dir=tmp_path / "data", model="tiny-random"))
    try:
        with Served(app) as served:
            assert httpx.get(f"{served.url}/ui").status_code == 200
            now = httpx.get(f"{served.url}/ui/api/now").json()
            assert now["status"]["live"] is False and now["status"]["version"] == 0
            assert len(httpx.get(f"{served.url}/ui/api/turns").json()["turns"]) == 5
            r = httpx.post(f"{served.url}/ui/api/rollback", json={"version": 0})
            assert r.status_code == 409 and r.json()["error"]["code"] == "read_only"
    finally:
        reopened.close()


def test_polls_between_two_changes_share_one_read(store: Store, tmp_path: Path) -> None:
    board = board_for(store, tmp_path, None)
    reads: list[int] = []

    def read() -> dict[str, Any]:
        reads.append(1)
        return board.browse.waiting()

    for _ in range(3):
        board.browse.memo("waiting", board.browse.token(), read)
    assert len(reads) == 1
    tid = store.record_turn(turn("m", "q", "a"))
    store.attach_next_state(tid, [{"role": "user", "content": "next"}])
    out = board.browse.memo("waiting", board.browse.token(), read)
    assert len(reads) == 2 and out["turns_to_judge"] == 1


def test_clawbridge_ui_names_a_data_directory_with_no_store(tmp_path: Path) -> None:
    from clawbridge.cli.main import app
    from typer.testing import CliRunner

    out = CliRunner().invoke(app, ["ui", "--data-dir", str(tmp_path / "nothing-here")])
    assert out.exit_code == 1 and "no store in" in out.output and "make demo" in out.output
    assert not (tmp_path / "nothing-here" / "clawbridge.db").exists()  # looking creates nothing
