"""The store's side of several proxies (docs/scale-out.md), in one test process: conversations
continued through the store by two `Sessions` (two proxies' memories) that never see each other's
requests; the trainer lease; a SQLite store refusing a second serving process. The real
processes are in tests/test_scale_out.py."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from clawbridge.serving.sessions import NextState, Sessions, TurnTag
from clawbridge.store import Store, StoreInUse, TurnRecord
from pg import PgCluster


class Proxy:
    """What `serving.proxy.Proxy` does around a request on a shared store, without HTTP or a
    model: look the conversation up, admit, attach the next state, record the turns with their
    keys, complete."""

    def __init__(self, store: Store) -> None:
        self.store, self.sessions = store, Sessions()

    def ask(
        self, messages: Sequence[Mapping[str, Any]], replies: Sequence[str] = ("ok",), *,
        session: str | None = None, turn_type: str = "main", user: str = "default",
    ) -> tuple[str, list[str], NextState | None]:
        tag = TurnTag(session_id=session, turn_type=turn_type, user=user)  # type: ignore[arg-type]
        look = self.sessions.lookup(messages)
        adm = self.sessions.admit(tag, look, self.store.continuation(tag.session_id, look.reply_keys, user))
        if adm.next_state is not None:
            self.store.attach_next_state(adm.next_state.turn_id, list(adm.next_state.messages))
        answers = [{"role": "assistant", "content": r} for r in replies]
        keys = self.sessions.reply_keys(adm, answers)
        ids = []
        for answer, key in zip(answers, keys, strict=True):
            ids.append(self.store.record_turn(TurnRecord(
                session_id=adm.session_id, messages=[dict(m) for m in messages], prompt_ids=(1, 2),
                completion_ids=(3,), logprobs=(-0.5,), version=0, finish_reason="stop", response=answer,
                turn_type=adm.turn_type, tagged=session is not None,
                prompt_key=adm.fps[-1] if adm.fps else None, reply_key=key, user=adm.user,
            )))
        self.sessions.complete(adm, ids, answers, keys)
        return adm.session_id, ids, adm.next_state


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.fixture
def pg_store(pg_cluster: PgCluster) -> Iterator[Store]:
    with Store.open(pg_cluster.create_schema()) as s:
        yield s


def test_an_untagged_conversation_alternating_between_two_proxies_is_one_session_with_every_next_state(
    pg_store: Store,
):
    a, b = Proxy(pg_store), Proxy(pg_store)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, user("hi")]
    sids, ids = [], []
    for k in range(4):
        sid, [tid], ns = (a, b)[k % 2].ask(msgs, [f"answer {k}"])
        if k:
            assert ns is not None and ns.turn_id == ids[-1] and ns.matched
            assert ns.messages == ({"role": "user", "content": f"more {k}"},)
        sids.append(sid)
        ids.append(tid)
        msgs += [assistant(f"answer {k}"), user(f"more {k + 1}")]
    assert len(set(sids)) == 1
    turns = pg_store.session_turns(sids[0])
    assert [t.next_state is not None for t in turns] == [True, True, True, False]


def test_on_another_proxy_one_users_conversation_never_continues_anothers(pg_store: Store):
    a, b = Proxy(pg_store), Proxy(pg_store)
    sid, [t0], _ = a.ask([user("q")], ["r0"], user="alice")
    # bob's request on the other proxy is alice's conversation word for word, plus his reply
    bobs, _, ns = b.ask([user("q"), assistant("r0"), user("no!")], ["r1"], user="bob")
    assert bobs != sid and ns is None and pg_store.session_user(bobs) == "bob"
    same, _, ns = b.ask([user("q"), assistant("r0"), user("thanks")], ["r1"], user="alice")
    assert same == sid and ns is not None and (ns.turn_id, ns.messages) == (t0, (user("thanks"),))


def test_a_tagged_conversation_gets_its_next_states_wherever_its_turns_land(pg_store: Store):
    a, b = Proxy(pg_store), Proxy(pg_store)
    _, [t0], _ = a.ask([user("q")], ["r0"], session="s-1")
    _, [t1], ns = b.ask([user("q"), assistant("r0"), user("thanks")], ["r1"], session="s-1")
    assert ns is not None and (ns.turn_id, ns.messages) == (t0, (user("thanks"),))
    # a side request in between neither takes nor gives a next state
    _, _, side = a.ask([user("title please")], ["Title"], session="s-1", turn_type="side")
    assert side is None
    _, _, ns = a.ask([user("q"), assistant("r0"), user("thanks"), assistant("r1"), user("bye")], session="s-1")
    assert ns is not None and ns.turn_id == t1


def test_the_same_prompt_sampled_again_on_another_proxy_continues_nothing(pg_store: Store):
    a, b = Proxy(pg_store), Proxy(pg_store)
    history = [user("q"), assistant("r0"), user("more")]
    a.ask(history[:1], ["r0"], session="s")
    _, [t1], _ = a.ask(history, ["first try"], session="s")
    _, [t1b], resampled = b.ask(history, ["second try"], session="s")
    assert resampled is None  # the same history again: no one's next state
    # the request continuing the second try gives it its next state, on the first proxy
    _, _, ns = a.ask([*history, assistant("second try"), user("good")], session="s")
    assert ns is not None and ns.turn_id == t1b and ns.matched
    assert pg_store.get_turn(t1).next_state is None


def test_the_chosen_one_of_n_choices_gets_the_next_state_on_the_other_proxy(pg_store: Store):
    a, b = Proxy(pg_store), Proxy(pg_store)
    sid, [c0, c1], _ = a.ask([user("pick")], ["left", "right"])
    got_sid, _, ns = b.ask([user("pick"), assistant("right"), user("why right?")])
    assert got_sid == sid
    assert ns is not None and ns.turn_id == c1 and ns.messages == (user("why right?"),)
    assert pg_store.get_turn(c0).next_state is None


def test_rewritten_history_gives_what_follows_the_last_reply_to_the_newest_turn(pg_store: Store):
    a, b = Proxy(pg_store), Proxy(pg_store)
    a.ask([user("long story")], ["part 1"], session="s")
    _, [t1], _ = a.ask([user("long story"), assistant("part 1"), user("go on")], ["part 2"], session="s")
    # compaction: the agent replaced the history with a summary
    _, _, ns = b.ask([user("summary of it all"), assistant("ok, summarised"), user("now the end")], session="s")
    assert ns is not None and ns.turn_id == t1 and not ns.matched and ns.messages == (user("now the end"),)


def test_without_the_store_the_other_proxy_would_not_know_the_conversation(pg_store: Store):
    """What the lookup adds: the other proxy's memory alone opens a new session (issue 29)."""
    a, b = Proxy(pg_store), Proxy(pg_store)
    sid, _, _ = a.ask([user("hello")], ["hi"])
    alone = b.sessions.admit(TurnTag(), [user("hello"), assistant("hi"), user("and?")])
    assert alone.session_id != sid and alone.next_state is None


# --- the trainer lease ---------------------------------------------------------------------------


def test_one_holder_at_a_time_and_a_takeover_once_the_claim_runs_out(store: Store):
    a = store.claim_lease("trainer", "a", ttl_s=0.6)
    assert a.holder == "a"
    assert store.claim_lease("trainer", "b", ttl_s=0.6).holder == "a"  # b waits
    time.sleep(0.3)
    renewed = store.claim_lease("trainer", "a", ttl_s=0.6)
    assert renewed.holder == "a" and renewed.expires_at > a.expires_at
    time.sleep(0.7)  # a stopped renewing: its claim ran out
    taken = store.claim_lease("trainer", "b", ttl_s=0.6)
    assert taken.holder == "b" and taken.acquired_at > a.acquired_at
    assert store.claim_lease("trainer", "a", ttl_s=0.6).holder == "b"  # a finds it gone
    assert not store.release_lease("trainer", "a")
    assert store.release_lease("trainer", "b")
    assert store.lease("trainer") is None
    assert store.claim_lease("trainer", "a", ttl_s=0.6).holder == "a"  # released: free at once


# --- SQLite: one serving process -----------------------------------------------------------------


def test_a_second_server_on_one_sqlite_store_is_refused_and_pointed_at_postgresql(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'clawbridge.db'}"
    first = Store.open(url)
    first.claim_serving()
    second = Store.open(url)  # opening to read is fine (clawbridge status, export, ui)
    try:
        with pytest.raises(StoreInUse, match=r"PostgreSQL \(--db postgresql\+psycopg://") as e:
            second.claim_serving()
        assert "one serving process" in str(e.value)
        first.close()  # the claim ends with the store (or the process)
        second.claim_serving()
    finally:
        second.close()
        first.close()


def test_a_postgresql_store_serves_any_number_of_processes(pg_store: Store):
    pg_store.claim_serving()
    with Store.open(str(pg_store.engine.url.render_as_string(hide_password=False))) as other:
        other.claim_serving()
        assert other.shared and pg_store.shared


def test_clawbridge_status_names_the_process_that_trains(pg_store: Store):
    from clawbridge.cli.main import app
    from typer.testing import CliRunner

    pg_store.claim_lease("trainer", "host-a:4242:beef", ttl_s=30)
    url = pg_store.engine.url.render_as_string(hide_password=False)
    result = CliRunner().invoke(app, ["status", "--db", url], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "trainer (lease)" in result.output and "host-a:4242:beef" in result.output


@pytest.mark.slow
def test_clawbridge_up_on_a_sqlite_store_another_process_serves_exits_1_and_says_use_postgresql(tmp_path: Path):
    import os
    import subprocess
    import sys

    from helpers.processes import free_port

    data = tmp_path / "data"
    held = Store.open(f"sqlite:///{data / 'clawbridge.db'}")
    held.claim_serving()  # this test process serves from it
    try:
        cli = Path(sys.executable).with_name("clawbridge")
        r = subprocess.run(
            ["timeout", "-s", "TERM", "240", str(cli), "up", "--backend", "local", "--model", "tiny-random",
             "--port", str(free_port()), "--data-dir", str(data), "--no-train"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    finally:
        held.close()
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"another process (pid {os.getpid()}) serves from the SQLite store" in r.stderr
    assert "use PostgreSQL" in r.stderr and "Traceback" not in r.stderr
