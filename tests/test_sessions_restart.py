"""Open conversations continue across a restart (issue 14): the proxy's session index is
rebuilt from the store at start, so a tagged conversation's next request attaches its next
state, and an untagged one joins the conversation it extends instead of opening a new one."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from clawbridge.config import Settings
from clawbridge.server import build_backend
from clawbridge.serving.proxy import ProxyHooks
from clawbridge.store import Store
from live_server import LiveServer

MODEL = "tiny-random"


def server(data: Path) -> LiveServer:
    settings = Settings(model=MODEL, port=0, data_dir=data, train=False, default_max_tokens=4)
    return LiveServer(settings, build_backend(settings), hooks=ProxyHooks()).start()


def ask(live: LiveServer, messages: list[dict], headers: dict[str, str] | None = None) -> dict:
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "seed": 1},
                   headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def wait_for_next_states(store: Store, turn_ids: list[str], timeout: float = 10) -> list[object]:
    deadline = time.monotonic() + timeout
    while True:
        found = [store.get_turn(t) for t in turn_ids]
        states = [t.next_state if t else None for t in found]
        if all(states) or time.monotonic() > deadline:
            return states


def test_open_conversations_continue_across_a_restart(tmp_path: Path):
    data = tmp_path / "data"
    first = server(data)
    opened: dict[str, tuple[list[dict], dict]] = {}
    try:
        for i in range(3):  # tagged conversations
            msgs = [{"role": "user", "content": f"tagged question {i}"}]
            opened[f"tag-{i}"] = (msgs, ask(first, msgs, {"X-Session-Id": f"tag-{i}"}))
        for i in range(3):  # untagged: joined by structure only
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"untagged {i}"}]
            opened[f"untagged-{i}"] = (msgs, ask(first, msgs))
    finally:
        first.stop()

    store = Store.open(f"sqlite:///{(data / 'clawbridge.db').resolve()}")
    tagged_turns = [store.last_turn(name) for name in opened if name.startswith("tag")]
    untagged_turns = [t for s in store_sessions(store) for t in store.session_turns(s) if not t.tagged]
    store.close()
    assert len(untagged_turns) == 3 and all(tagged_turns)

    second = server(data)
    try:
        for name, (msgs, reply) in opened.items():
            follow = [*msgs, reply, {"role": "user", "content": f"thanks, and more on {name}?"}]
            ask(second, follow, {"X-Session-Id": name} if name.startswith("tag") else None)
        store = second.running.store  # type: ignore[union-attr]
        ids = [t.id for t in tagged_turns if t] + [t.id for t in untagged_turns]
        states = wait_for_next_states(store, ids)
        assert all(states), f"{sum(1 for s in states if not s)} of {len(ids)} next states lost across the restart"
        # the untagged follow-ups joined their conversations: no new session was opened
        for t in untagged_turns:
            turns = store.session_turns(t.session_id)
            assert len(turns) == 2, (t.session_id, len(turns))
        assert second.proxy.sessions.counts["matched"] == 3
    finally:
        second.stop()


def store_sessions(store: Store) -> list[str]:
    import sqlalchemy as sa
    from clawbridge.store import schema

    with store.engine.connect() as conn:
        return [r.id for r in conn.execute(sa.select(schema.sessions.c.id))]
