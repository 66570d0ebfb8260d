"""POST /v1/feedback and `Session.feedback`: explicit rewards and hints for SDK users, through a
live server (tiny random model, real store) with the learning loop's hooks and collector."""

from __future__ import annotations

import time

import clawbridge
import httpx
import pytest
from clawbridge.config import Settings
from clawbridge.store import Store
from live_server import LiveServer, with_learner

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("feedback")
    settings = Settings(model=MODEL, data_dir=data, default_max_tokens=6, batch_size=1000,
                        method="combine", judge="rules")
    with with_learner(settings, poll_s=0.1) as server:  # the learner's task stops before the store
        yield server


def store_of(live: LiveServer) -> Store:
    assert live.running is not None
    return live.running.store


def ask(live: LiveServer, session: str, text: str = "Hi there") -> None:
    r = httpx.post(
        f"{live.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 6},
        headers={"X-Session-Id": session}, timeout=60,
    )
    assert r.status_code == 200, r.text


def wait_state(store: Store, turn_id: str, state: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    got = "missing"
    while time.monotonic() < deadline:
        rows = [s for s in store.pending_samples(state="judged") + store.pending_samples(state="pending")
                if s.turn_id == turn_id]
        got = rows[0].state if rows else "missing"
        if got == state:
            return got
        time.sleep(0.1)
    return got


def test_reward_on_the_last_turn_becomes_a_judged_sample_without_a_next_state(live: LiveServer):
    ask(live, "fb-1")
    r = httpx.post(f"{live.url}/v1/feedback", json={"session_id": "fb-1", "reward": 1}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "feedback" and body["reward"] == 1
    assert body["sample"]["new"] is True and body["sample"]["method"] == "combine"
    store = store_of(live)
    turn = store.last_turn("fb-1")
    assert turn is not None and body["turn_id"] == turn.id and turn.next_state is None
    [j] = [j for j in store.judgments(turn.id) if j.kind == "feedback"]
    assert j.judge == "user" and j.reward == 1.0 and '"reward":1' in j.votes[0].raw
    assert wait_state(store, turn.id, "judged") == "judged"
    [s] = [s for s in store.pending_samples() if s.turn_id == turn.id]
    assert s.reward == 1.0 and s.advantages is not None and set(s.advantages) == {1.0}


def test_hint_gets_teacher_logprobs_from_the_backend(live: LiveServer):
    ask(live, "fb-hint")
    r = httpx.post(f"{live.url}/v1/feedback", headers={"X-Session-Id": "fb-hint"},
                   json={"hint": "Answer in one short sentence, please."}, timeout=30)
    assert r.status_code == 200, r.text
    store = store_of(live)
    turn = store.last_turn("fb-hint")
    assert turn is not None
    assert wait_state(store, turn.id, "judged") == "judged"
    [s] = [s for s in store.pending_samples() if s.turn_id == turn.id]
    assert s.hint == "Answer in one short sentence, please."
    assert s.teacher_logprobs is not None and len(s.teacher_logprobs) == len(turn.completion_ids)
    assert s.advantages is not None and all(-1.0 <= a <= 1.0 for a in s.advantages)


def test_feedback_twice_on_a_turn_is_a_conflict(live: LiveServer):
    ask(live, "fb-dup")
    first = httpx.post(f"{live.url}/v1/feedback", json={"session_id": "fb-dup", "reward": -1}, timeout=30)
    again = httpx.post(f"{live.url}/v1/feedback", json={"session_id": "fb-dup", "reward": 1}, timeout=30)
    assert first.status_code == 200
    assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_feedback"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"session_id": "nobody-here", "reward": 1}, 404, "session_id"),
        ({"turn_id": "no-such-turn", "reward": 1}, 404, "turn_id"),
        ({"session_id": "fb-1", "reward": 2}, 400, "reward"),
        ({"session_id": "fb-1"}, 400, None),
        ({"reward": 1}, 400, None),
        ({"session_id": "fb-1", "reward": 1, "stars": 5}, 400, "stars"),
    ],
)
def test_bad_feedback_gets_an_openai_shaped_error(live: LiveServer, body: dict, status: int, param: str | None):
    r = httpx.post(f"{live.url}/v1/feedback", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_opted_out_turns_take_no_feedback(live: LiveServer):
    r = httpx.post(
        f"{live.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "private"}], "max_tokens": 4},
        headers={"X-Session-Id": "fb-private", "X-Train": "false"}, timeout=60,
    )
    assert r.status_code == 200
    fb = httpx.post(f"{live.url}/v1/feedback", json={"session_id": "fb-private", "reward": 1}, timeout=30)
    assert fb.status_code in (400, 404)


def test_sdk_session_feedback_targets_its_last_turn(live: LiveServer):
    cb = clawbridge.Client(live.url)
    with cb.session(user="sdk") as chat:
        chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one"}], max_tokens=4)
        chat.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "one"}, {"role": "assistant", "content": "x"},
                      {"role": "user", "content": "two"}],
            max_tokens=4,
        )
        out = chat.feedback(reward=-1, hint="Please answer with a single word.")
        last = store_of(live).last_turn(chat.session_id)
    assert last is not None and out["turn_id"] == last.id and out["hint"].startswith("Please")
