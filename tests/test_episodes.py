"""Episodes and groups (issue 15): the reward math with hand-computed numbers, the store's states,
and the whole path through a live server — the SDK's groups (sync and async), the plain HTTP
routes, `n > 1` choices as a group — down to the samples the trainer would take."""

from __future__ import annotations

import asyncio
import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import clawbridge
import httpx
import pytest
from clawbridge.config import Settings
from clawbridge.learning.episodes import Step, group_advantages, length_penalty, step_rewards
from clawbridge.store import EpisodeError, NewEpisode, Sample, Store, TurnRecord
from live_server import LiveServer, with_learner

MODEL = "tiny-random"


# --- the math -------------------------------------------------------------------------------
def test_outcomes_of_one_turn_episodes_are_plain_grpo():
    # docs/design.md#methods / advantages.group_normalise: [1, -1, 1, 0] -> mean 0.25, population std 0.829
    rewards = [step_rewards(o, [Step(5)]) for o in (1.0, -1.0, 1.0, 0.0)]
    adv = group_advantages(rewards)
    assert adv is not None
    assert [round(a[0], 2) for a in adv] == [0.90, -1.51, 0.90, -0.30]


def test_the_outcome_is_broadcast_to_every_turn_and_normalised_over_the_group_steps():
    rewards = [step_rewards(1.0, [Step(3), Step(4)]), step_rewards(0.0, [Step(2), Step(9)])]
    assert rewards == [(1.0, 1.0), (0.0, 0.0)]
    adv = group_advantages(rewards)
    assert adv is not None
    # mean 0.5, std 0.5: every step of the winner +1, of the loser -1 (eps aside)
    assert all(math.isclose(a, 1.0, abs_tol=1e-5) for a in adv[0])
    assert all(math.isclose(a, -1.0, abs_tol=1e-5) for a in adv[1])


def test_integrated_reward_adds_lambda_over_m_times_the_sum_of_votes():
    steps = [Step(3, votes=(1, 1, -1)), Step(3, votes=(-1, -1, 0)), Step(3)]
    r = step_rewards(0.5, steps, lam=1.0)
    assert r == pytest.approx((0.5 + 1 / 3, 0.5 - 2 / 3, 0.5))
    assert step_rewards(0.5, steps, lam=0.0) == (0.5, 0.5, 0.5)  # off: the outcome alone
    assert step_rewards(0.5, steps, lam=0.5)[0] == pytest.approx(0.5 + 0.5 / 3)


def test_overlong_shaping_ramps_to_minus_one_and_is_off_by_default():
    assert length_penalty(10_000, 0, 0) == 0.0
    assert length_penalty(80, 100, 20) == 0.0
    assert length_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert length_penalty(120, 100, 20) == -1.0
    assert length_penalty(101, 100, 0) == -1.0 and length_penalty(100, 100, 0) == 0.0
    assert step_rewards(1.0, [Step(90), Step(10)], overlong=(100, 20)) == pytest.approx((0.5, 1.0))


def test_a_group_whose_rewards_are_all_equal_yields_nothing():
    assert group_advantages([(1.0, 1.0), (1.0,)]) is None
    assert group_advantages([(0.3,)]) is None
    assert group_advantages([]) is None


# --- the store ------------------------------------------------------------------------------
@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    else:
        url = request.getfixturevalue("pg_cluster").create_schema()
    with Store.open(url) as s:
        yield s


def test_an_episode_takes_one_outcome_and_a_closed_group_expires_the_rest(store: Store):
    g = store.open_group("g1", [NewEpisode(id=f"e{i}", session_id=f"e{i}") for i in range(3)], {"task": 1})
    assert g.size == 3 and g.state == "open" and [e.state for e in g.episodes] == ["open"] * 3
    assert store.groups_to_settle() == []
    assert store.set_outcome("e0", 0.25).outcome == 0.25
    with pytest.raises(EpisodeError) as e:
        store.set_outcome("e0", 1.0)
    assert e.value.status == 409
    with pytest.raises(EpisodeError) as e:
        store.set_outcome("nope", 1.0)
    assert e.value.status == 404
    g = store.close_group("g1")
    assert g.state == "closed"
    assert [(e.state, e.reason) for e in g.episodes[1:]] == [("expired", "the group closed before its outcome")] * 2
    with pytest.raises(EpisodeError) as e:
        store.set_outcome("e1", 1.0)
    assert e.value.status == 409 and "expired" in str(e.value)
    assert [x.id for x in store.groups_to_settle()] == ["g1"]
    store.settle_group("g1", "trained", "2 samples")
    assert store.groups_to_settle() == [] and store.get_group("g1").state == "trained"  # type: ignore[union-attr]
    with pytest.raises(EpisodeError):
        store.open_group("g1", [NewEpisode(id="e9", session_id="e9")])


def test_episodes_without_an_outcome_expire_after_the_timeout_with_a_reason(store: Store):
    store.open_group("g2", [NewEpisode(id="a", session_id="a"), NewEpisode(id="b", session_id="b")])
    assert store.expire_episodes(datetime.now(UTC) - timedelta(hours=1), "late") == 0
    store.set_outcome("a", 1.0)
    assert store.expire_episodes(datetime.now(UTC) + timedelta(seconds=1), "no outcome within 1 s") == 1
    b = store.get_episode("b")
    assert b is not None and b.state == "expired" and b.reason == "no outcome within 1 s"
    assert [g.id for g in store.groups_to_settle()] == ["g2"]


def test_episode_turns_are_left_to_their_group_not_judged_one_by_one(store: Store):
    def turn(session: str) -> str:
        tid = store.record_turn(TurnRecord(
            session_id=session, messages=[{"role": "user", "content": "hi"}], prompt_ids=(1, 2),
            completion_ids=(3,), logprobs=(-0.5,), version=0, finish_reason="stop",
            response={"role": "assistant", "content": "x"},
        ))
        store.attach_next_state(tid, [{"role": "user", "content": "more"}])
        return tid

    plain, in_episode, choice = turn("plain"), turn("ep-s"), turn("plain2")
    store.open_group("g3", [NewEpisode(id="ep-s", session_id="ep-s"),
                            NewEpisode(id=choice, session_id="plain2", turn_id=choice)])
    assert {t.id for t in store.turns_awaiting_judgment()} == {plain}
    assert in_episode and store.get_episode(choice).turn_id == choice  # type: ignore[union-attr]


# --- through a live server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("episodes")
    settings = Settings(model=MODEL, data_dir=data, default_max_tokens=5, batch_size=1000,
                        method="combine", judge="rules", gate="off")
    with with_learner(settings, poll_s=0.1) as server:  # the learner's task stops before the store
        yield server


def store_of(live: LiveServer) -> Store:
    assert live.running is not None
    return live.running.store


def wait_settled(live: LiveServer, group_id: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        g = httpx.get(f"{live.url}/v1/groups/{group_id}", timeout=30).json()
        if g["state"] in ("trained", "dropped") or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


def samples_of(store: Store, turn_ids: set[str]) -> list[Sample]:
    rows = store.pending_samples(state="judged") + store.pending_samples(state="dropped")
    return [s for s in rows if s.turn_id in turn_ids]


def run_episode(ep: Any, turns: int) -> None:
    """A multi-turn run: each request resends the history, the exact reply, and a new message
    (a tool result would do the same)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find the capital of France."}]
    for k in range(turns):
        r = ep.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"observation {k}: keep going"}]


def test_a_group_of_multi_turn_episodes_trains_every_turn_with_its_group_advantage(live: LiveServer):
    cb = clawbridge.Client(live.url)
    with cb.group(n=3, task={"goal": "capital"}) as g:
        assert len(g) == 3 and g.id.startswith("grp-") and g.task == {"goal": "capital"}
        for ep, outcome in zip(g, (1.0, 0.0, 0.5), strict=True):
            run_episode(ep, turns=2)
            out = ep.outcome(outcome)
            assert out["state"] == "scored" and out["outcome"] == outcome
    info = wait_settled(live, g.id)
    assert info["state"] == "trained", info
    store = store_of(live)
    by_ep = {ep.id: [t for t in store.session_turns(ep.session_id) if t.turn_type == "main"] for ep in g}
    assert all(len(ts) == 2 for ts in by_ep.values())
    turns = {t.id: t for ts in by_ep.values() for t in ts}
    samples = {s.turn_id: s for s in samples_of(store, set(turns))}
    assert set(samples) == set(turns)  # one sample row per assistant turn, none judged alone
    # step rewards 1,1,0,0,.5,.5: mean .5, population std .408 -> +-1.2247 and 0 (dropped)
    for ep, expect in zip(g, (1.2247, -1.2247, None), strict=True):
        for t in by_ep[ep.id]:
            s = samples[t.id]
            assert store.judgments(t.id) == []  # the per-turn judges never saw it
            if expect is None:
                assert s.state == "dropped" and "zero advantage" in (s.reason or "")
                continue
            assert s.state == "judged" and s.method == "combine"
            assert s.advantages is not None and len(s.advantages) == len(t.completion_ids)
            assert all(a == pytest.approx(expect, abs=1e-3) for a in s.advantages)
            # the exact sampled tokens of every turn, as the proxy recorded them
            assert s.completion_ids == t.completion_ids and s.logprobs == t.logprobs
            assert s.prompt_ids == t.prompt_ids


def test_a_group_whose_outcomes_are_all_equal_is_dropped_with_the_reason(live: LiveServer):
    cb = clawbridge.Client(live.url)
    with cb.group(n=2, task="same") as g:
        for ep in g:
            run_episode(ep, turns=1)
            ep.outcome(1.0)
    info = wait_settled(live, g.id)
    assert info["state"] == "dropped" and "all 2 step rewards equal" in info["reason"]
    store = store_of(live)
    tids = {t.id for ep in g for t in store.session_turns(ep.session_id)}
    rows = samples_of(store, tids)
    assert len(rows) == 2 and all(s.state == "dropped" and "equal" in (s.reason or "") for s in rows)


def test_plain_http_routes_and_an_episode_left_without_outcome(live: LiveServer):
    url = live.url
    r = httpx.post(f"{url}/v1/groups", json={"n": 3, "task": "curl", "id": "grp-http"}, timeout=30)
    assert r.status_code == 201, r.text
    eps = r.json()["episodes"]
    assert [e["state"] for e in eps] == ["open"] * 3 and all(e["session_id"] == e["id"] for e in eps)
    for e, outcome in zip(eps[:2], (1.0, -1.0), strict=True):
        c = httpx.post(f"{url}/s/{e['id']}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
        assert c.status_code == 200 and c.json()["choices"][0]["turn_id"].startswith("turn-")
        o = httpx.post(f"{url}/v1/episodes/{e['id']}/outcome", json={"outcome": outcome}, timeout=30)
        assert o.status_code == 200 and o.json()["state"] == "scored"
    again = httpx.post(f"{url}/v1/episodes/{eps[0]['id']}/outcome", json={"outcome": 1}, timeout=30)
    assert again.status_code == 409 and again.json()["error"]["code"] == "episode_conflict"
    assert httpx.post(f"{url}/v1/episodes/nope/outcome", json={"outcome": 1}, timeout=30).status_code == 404
    bad = httpx.post(f"{url}/v1/episodes/{eps[2]['id']}/outcome", json={"outcome": "great"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "outcome"
    assert httpx.post(f"{url}/v1/groups", json={"n": 0}, timeout=30).status_code == 400
    assert httpx.post(f"{url}/v1/groups", json={"n": 1, "id": "grp-http"}, timeout=30).status_code == 409
    closed = httpx.post(f"{url}/v1/groups/grp-http/close", timeout=30).json()
    assert closed["episodes"][2]["state"] == "expired" and "closed" in closed["episodes"][2]["reason"]
    info = wait_settled(live, "grp-http")
    assert info["state"] == "trained", info
    assert httpx.get(f"{url}/v1/groups/none", timeout=30).status_code == 404


def test_n_choices_form_a_group_whose_choices_are_addressed_by_turn_id(live: LiveServer):
    cb = clawbridge.Client(live.url)
    with cb.session() as chat:
        r = chat.chat.completions.create(model=MODEL, n=3, max_tokens=5,
                                         messages=[{"role": "user", "content": "Pick a number."}])
    ids = [c.turn_id for c in r.choices]  # type: ignore[attr-defined]
    assert len(set(ids)) == 3 and all(i.startswith("turn-") for i in ids)
    group = cb.get_group(r.id)
    assert [e["turn_id"] for e in group["episodes"]] == ids
    cb.outcome(ids[0], 1.0)
    cb.outcome(ids[1], 0.0)
    cb.close_group(r.id)  # the third choice expires with the reason
    info = wait_settled(live, r.id)
    assert info["state"] == "trained" and info["episodes"][2]["state"] == "expired"
    rows = {s.turn_id: s for s in samples_of(store_of(live), set(ids))}
    assert set(rows) == set(ids[:2])
    assert rows[ids[0]].advantages is not None and rows[ids[0]].advantages[0] == pytest.approx(1.0, abs=1e-4)
    assert rows[ids[1]].advantages is not None and rows[ids[1]].advantages[0] == pytest.approx(-1.0, abs=1e-4)


def test_the_async_sdk_runs_episodes_concurrently(live: LiveServer):
    async def main() -> str:
        async with clawbridge.AsyncClient(live.url) as cb, cb.group(4, task="async") as g:
            async def one(ep: clawbridge.AsyncEpisode, outcome: float) -> None:
                r = await ep.chat.completions.create(
                    model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "go"}])
                assert r.choices[0].turn_id.startswith("turn-")  # type: ignore[attr-defined]
                await ep.outcome(outcome)

            await asyncio.gather(*(one(ep, float(i % 2)) for i, ep in enumerate(g)))
            assert g.id is not None
            return g.id

    gid = asyncio.run(main())
    info = wait_settled(live, gid)
    assert info["state"] == "trained" and [e["outcome"] for e in info["episodes"]] == [0.0, 1.0, 0.0, 1.0]


def test_feedback_takes_a_graded_reward(live: LiveServer):
    cb = clawbridge.Client(live.url)
    with cb.session() as chat:
        chat.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        out = chat.feedback(0.5)
    assert out["reward"] == 0.5


def test_a_hint_on_an_episode_step_adds_hint_opd_to_its_group_advantage(live: LiveServer):
    cb = clawbridge.Client(live.url)
    hint = "Call the calculator first, then answer with the number only."
    with cb.group(n=2, task="hinted") as g:
        for ep, outcome in zip(g, (0.0, 1.0), strict=True):
            run_episode(ep, turns=1)
            if ep.index == 0:
                fb = ep.feedback(hint=hint)
                assert fb["sample"] is None and fb["episode"] == ep.id  # the group trains it
            ep.outcome(outcome)
    assert wait_settled(live, g.id)["state"] == "trained"
    store = store_of(live)
    [t0] = [t for t in store.session_turns(g[0].session_id) if t.turn_type == "main"]
    [s] = samples_of(store, {t0.id})
    assert s.state == "judged" and s.hint == hint and s.teacher_logprobs is not None
    assert s.advantages is not None and len(s.advantages) == len(t0.completion_ids)
    # w_opd * clip(teacher - old, +-1) + w_rl * A, with A = -1 for the worse episode
    for a, te, old in zip(s.advantages, s.teacher_logprobs, t0.logprobs, strict=True):
        assert a == pytest.approx(max(-1.0, min(1.0, te - old)) - 1.0, abs=1e-4)


def test_every_answer_names_its_turn_streamed_or_not(live: LiveServer):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers={"X-Session-Id": "named-1"}, timeout=60)
    assert r.headers["x-turn-id"] == r.json()["choices"][0]["turn_id"]
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**body, "stream": True},
                      headers={"X-Session-Id": "named-2"}, timeout=60) as s:
        tid = s.headers["x-turn-id"]
        s.read()
    deadline = time.monotonic() + 20
    while (turn := store_of(live).last_turn("named-2")) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert turn is not None and turn.id == tid


def test_metrics_count_groups_episodes_and_their_samples(live: LiveServer):
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    for name in ("episode_groups_trained", "episode_groups_dropped", "episodes_expired", "episode_samples"):
        assert f"clawbridge_{name} " in text, name
