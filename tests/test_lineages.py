"""Each user their own adapter (docs/learning.md#each-user-their-own-adapter): one base model and
one store, a lineage per user. Real training on the tiny model with the torch engine (fp32),
a real SQLite store, the trainer as the server builds it for each user. Every test here fails
if the separation is removed: a user's step training from another's weights, another's publish
making their samples stale, another's version serving them, or a switch losing the optimizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.learning.lineages import UserLineages, UserStore
from clawbridge.learning.trainer import Trainer
from clawbridge.local_gpu import models
from clawbridge.protocol import UnknownVersion
from clawbridge.store import Store
from clawbridge.store.records import DEFAULT_USER, TurnRecord
from clawbridge.types import SamplingParams
from helpers.learning import settings_for

PROBE_PROMPT, PROBE_ANSWER = (1, 2, 3, 4, 5), (6, 7, 8, 9)


def judged(store: Store, tokenizer, user: str, n: int, *, word: str, version: int = 0) -> list[int]:
    """`n` judged samples of `user`'s turns (each a session of its own), drawn by `version`."""
    ids = []
    for i in range(n):
        completion = tuple(tokenizer.encode(f" {word} {i}"))
        tid = store.record_turn(TurnRecord(
            session_id=f"{user}-{word}-{i}", messages=[{"role": "user", "content": f"{word} question {i}"}],
            prompt_ids=tuple(tokenizer.encode(f"{word} question {i}")), completion_ids=completion,
            logprobs=tuple(-1.0 for _ in completion), version=version, finish_reason="stop",
            response={"role": "assistant", "content": f"{word} {i}"}, sampling=SamplingParams(temperature=1.0),
            user=user,
        ))
        sid, _ = store.create_sample(tid, "combine", reward=1.0, advantages=(1.0,) * len(completion))
        ids.append(sid)
    return ids


async def started(data_dir: Path, **settings: object) -> tuple[LocalBackend, Store, UserLineages]:
    s = settings_for(data_dir, **settings)
    store = Store.open(s.db_url)
    backend = LocalBackend(models.TINY, data_dir, lora_rank=4, lora_alpha=4, seed=0)
    await backend.start()
    lineages = UserLineages(backend, store)
    await lineages.load()
    lock = asyncio.Lock()
    lineages.make_trainer = lambda lineage: Trainer(s.training, lineage.backend, lineage.store, lock=lock)  # type: ignore[arg-type]
    return backend, store, lineages


async def step(lineages: UserLineages, user: str) -> int:
    result = await lineages.trainer(lineages.get(user)).step_once()
    assert result is not None, f"{user} had no full batch"
    return result.version


async def probe(backend: LocalBackend, version: int) -> list[float]:
    return await backend.score(PROBE_PROMPT, PROBE_ANSWER, version=version)


async def test_each_users_steps_train_their_own_adapter_from_the_base(tmp_path: Path, tokenizer) -> None:
    backend, store, lineages = await started(tmp_path / "a", batch_size=2, max_staleness=0)
    ref_backend, ref_store, ref = await started(tmp_path / "b", batch_size=2, max_staleness=0)
    try:
        judged(store, tokenizer, "alice", 2, word="sunny")
        judged(store, tokenizer, "bob", 2, word="rainy")
        v_alice = await step(lineages, "alice")
        alice_before = await probe(backend, v_alice)
        v_bob = await step(lineages, "bob")
        # one numbering of versions, each stamped with its user; each user served their own
        assert (v_alice, v_bob) == (1, 2)
        assert [(v.version, v.user) for v in store.versions() if v.version] == [(1, "alice"), (2, "bob")]
        assert lineages.serving("alice") == 1 and lineages.serving("bob") == 2
        assert lineages.serving(None) == 0 and lineages.serving("carol") == 0  # no one else's adapter
        # alice's published weights are untouched by bob's training
        assert await probe(backend, v_alice) == alice_before
        # bob's step began from the base with a fresh optimizer: what bob alone on a new engine makes
        judged(ref_store, tokenizer, "bob", 2, word="rainy")
        assert await step(ref, "bob") == 1
        assert await probe(backend, v_bob) == pytest.approx(await probe(ref_backend, 1), abs=1e-5)
        assert await probe(backend, v_bob) != pytest.approx(alice_before, abs=1e-4)
        # each user's rows run on their own version as a registered adapter (one batch, a per-row
        # gather), with the logprobs their version scores; the default user's on the version itself
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=1)
        users = ("alice", "bob") * 4  # the first requests on each arrive together: one registration each
        registered, register = [], backend.engine.register_adapter

        async def counted(key: str, *a: object, **kw: object) -> None:
            registered.append(key)
            await register(key, *a, **kw)  # type: ignore[arg-type]

        backend.engine.register_adapter = counted  # type: ignore[method-assign]
        drawn = await asyncio.gather(*(lineages.get(u).backend.sample(PROBE_PROMPT, params) for u in users))
        # registering a key again while a request runs on it is refused (AdapterInUse): once each
        assert sorted(registered) == ["policy@v1", "policy@v2"]
        assert [c[0].version for c in drawn] == [1, 2] * 4
        assert {"policy@v1", "policy@v2"} <= set(backend.engine.adapter_stats().resident_keys)
        for [c], v in zip(drawn, (1, 2) * 4, strict=True):
            assert await backend.score(PROBE_PROMPT, c.tokens, version=v) == pytest.approx(list(c.logprobs), abs=1e-4)
    finally:
        for b, s in ((backend, store), (ref_backend, ref_store)):
            await b.close()
            s.close()


async def test_a_switch_back_resumes_a_users_weights_and_optimizer_exactly(tmp_path: Path, tokenizer) -> None:
    backend, store, lineages = await started(tmp_path / "a", batch_size=2, max_staleness=5)
    ref_backend, ref_store, ref = await started(tmp_path / "b", batch_size=2, max_staleness=5)
    try:
        judged(store, tokenizer, "alice", 2, word="sunny")
        judged(store, tokenizer, "bob", 2, word="rainy")
        await step(lineages, "alice")
        await step(lineages, "bob")  # a detour through bob's lineage
        judged(store, tokenizer, "alice", 2, word="windy", version=1)
        second = await step(lineages, "alice")
        # the same two steps of alice's with no detour
        judged(ref_store, tokenizer, "alice", 2, word="sunny")
        await step(ref, "alice")
        judged(ref_store, tokenizer, "alice", 2, word="windy", version=1)
        straight = await step(ref, "alice")
        assert await probe(backend, second) == pytest.approx(await probe(ref_backend, straight), abs=1e-5)
        assert lineages.board.switches == 3  # from the default user's (loaded at the start), to bob and back
    finally:
        for b, s in ((backend, store), (ref_backend, ref_store)):
            await b.close()
            s.close()


async def test_another_users_versions_never_make_a_users_samples_stale(tmp_path: Path, tokenizer) -> None:
    backend, store, lineages = await started(tmp_path, batch_size=2, max_staleness=0)
    try:
        bob = judged(store, tokenizer, "bob", 2, word="rainy")  # drawn by v0
        for word in ("sunny", "cloudy", "misty"):  # alice publishes three versions meanwhile
            judged(store, tokenizer, "alice", 2, word=word, version=lineages.serving("alice"))
            await step(lineages, "alice")
        assert lineages.serving("alice") == 3
        await step(lineages, "bob")
        assert {s.state for s in store.get_samples(bob)} == {"trained"}
        # bob's own publish does make bob's older samples stale
        late = judged(store, tokenizer, "bob", 2, word="foggy", version=0)
        judged(store, tokenizer, "bob", 2, word="hazy", version=4)
        await step(lineages, "bob")
        assert {s.state for s in store.get_samples(late)} == {"dropped"}
    finally:
        await backend.close()
        store.close()


async def test_the_learner_trains_the_user_trained_longest_ago_first(tmp_path: Path, tokenizer) -> None:
    from clawbridge.learning.learner import Learner
    from clawbridge.server import bind_learner

    backend, store, lineages = await started(tmp_path, batch_size=2)
    learner = Learner(settings_for(tmp_path, batch_size=2, gate="off"))
    bind_learner(learner, backend, store, lineages=lineages)  # each user's trainer as the server builds it
    try:
        judged(store, tokenizer, "alice", 6, word="sunny")  # three batches waiting
        judged(store, tokenizer, "bob", 2, word="rainy")  # one
        order = []
        while (result := await learner.step_once()) is not None:
            order.append((learner.last_user, result.version))
        # bob's one batch does not wait behind alice's three; each user's versions are their own
        assert order == [("alice", 1), ("bob", 2), ("alice", 3), ("alice", 4)]
        assert lineages.serving("alice") == 4 and lineages.serving("bob") == 2
        assert [t.backend.user for t in learner.trainers()] == [DEFAULT_USER, "alice", "bob"]  # type: ignore[attr-defined]
        # bob's adapter starts again from the base (his data deleted, say): alice's is untouched
        reset = await learner.rollback(backend, store, 0, "bob")
        assert (reset.version, reset.previous) == (5, 2) and lineages.serving("bob") == 5
        assert store.policy_version(5).user == "bob" and lineages.serving("alice") == 4
        assert await probe(backend, 5) == await backend.score(PROBE_PROMPT, PROBE_ANSWER, model="base")
        with pytest.raises(UnknownVersion):  # nobody rolls back to another user's version
            await learner.rollback(backend, store, 4, "bob")
    finally:
        await backend.close()
        store.close()


async def test_a_restart_serves_each_user_their_newest_and_trains_on_from_it(tmp_path: Path, tokenizer) -> None:
    backend, store, lineages = await started(tmp_path, batch_size=2)
    judged(store, tokenizer, "alice", 2, word="sunny")
    judged(store, tokenizer, "bob", 2, word="rainy")
    await step(lineages, "alice")
    await step(lineages, "bob")
    alice = await probe(backend, 1)
    await backend.close()
    store.close()
    backend, store, lineages = await started(tmp_path, batch_size=2)  # the same data dir and store
    try:
        assert {u: lineages.serving(u) for u in ("alice", "bob", DEFAULT_USER)} == {"alice": 1, "bob": 2, DEFAULT_USER: 0}
        judged(store, tokenizer, "alice", 2, word="windy", version=1)
        assert await step(lineages, "alice") == 3  # the numbering goes on
        assert await probe(backend, 1) == alice
        assert UserStore(store, "alice").latest_version().version == 3
        assert UserStore(store, "bob").latest_version().version == 2
    finally:
        await backend.close()
        store.close()


async def test_a_server_serves_each_user_their_own_version_and_shows_them_to_the_operator(
        tmp_path: Path, tokenizer) -> None:
    import json

    import httpx
    import openai
    from clawbridge.config import Settings
    from clawbridge.server import build_backend
    from live_server import LiveServer

    backend, store, lineages = await started(tmp_path, batch_size=2)
    judged(store, tokenizer, "alice", 2, word="sunny")
    judged(store, tokenizer, "bob", 2, word="rainy")
    await step(lineages, "alice")
    await step(lineages, "bob")
    await backend.close()
    store.close()
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-alice-1": "alice", "sk-bob-1": "bob"}}))
    settings = Settings(model=models.TINY, port=0, data_dir=tmp_path, api_key="sk-admin-1", api_keys_file=keys,
                        default_max_tokens=4, train=False, lora_rank=4, lora_alpha=4)
    live = await asyncio.to_thread(lambda: LiveServer(settings, build_backend(settings)).start())
    try:
        def ask(key: str, **headers: str) -> None:
            client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, default_headers=headers)
            client.chat.completions.create(model=live.proxy.model_name, messages=[{"role": "user", "content": "Hi"}])

        def status(key: str) -> dict:
            return httpx.get(f"{live.url}/v1/status", headers={"Authorization": f"Bearer {key}"}).json()

        await asyncio.to_thread(ask, "sk-alice-1")
        await asyncio.to_thread(ask, "sk-bob-1")
        await asyncio.to_thread(ask, "sk-admin-1", **{"X-Session-User": "carol"})
        await asyncio.to_thread(ask, "sk-admin-1")
        await asyncio.to_thread(live.settle)
        import sqlalchemy as sa
        from clawbridge.store import schema as t
        with live.running.store.engine.connect() as conn:  # type: ignore[union-attr]
            served = dict(conn.execute(sa.select(t.sessions.c.user_name, t.turns.c.version)
                                       .join(t.turns, t.turns.c.session_id == t.sessions.c.id)).all())
        assert served == {"alice": 1, "bob": 2, "carol": 0, DEFAULT_USER: 0}
        assert (await asyncio.to_thread(status, "sk-alice-1"))["version"] == 1
        assert (await asyncio.to_thread(status, "sk-bob-1"))["version"] == 2
        assert (await asyncio.to_thread(status, "sk-admin-1"))["users"] == {"alice": 1, "bob": 2, "carol": 0,
                                                                          DEFAULT_USER: 0}
    finally:
        await asyncio.to_thread(live.stop)


async def test_the_two_users_demo_gives_each_users_gain_and_the_crosstalk(tmp_path: Path) -> None:
    """The plumbing on the tiny model (its figures mean nothing): both users converse as
    themselves, each lineage trains a step of its own, each user's last version is theirs, and
    the control runs each alone on a fresh server."""
    import json

    from clawbridge.demo import scenario, two_users
    from test_demo import TINY

    shy = {**TINY, "name": "shy", "check": {"must_finish": False, "must_match": [r"\A\S+\Z"]},
           "replies": {"satisfied": ["Thanks, perfect."], "unsatisfied": ["Please answer in one word."]}}
    pair = (("alice", scenario.Scenario.model_validate(TINY)), ("bob", scenario.Scenario.model_validate(shy)))
    settings = two_users.two_users_settings(tmp_path / "data", pair, model="tiny-random")
    result = await two_users.run_two_users(settings, pair=pair, rounds=1, control=True)
    summary = json.loads(json.dumps(result.summary()))
    alice, bob = summary["users"]["alice"], summary["users"]["bob"]
    assert (alice["scenario"], alice["other_scenario"], bob["scenario"]) == ("tiny", "shy", "shy")
    for u in (alice, bob):
        lo, hi = u["truly_interval"]
        assert -1 <= lo <= u["truly_after"] - u["truly_before"] <= hi <= 1
        assert u["crosstalk"] == pytest.approx(u["other_after"] - u["other_control"], abs=1e-3)
        clo, chi = u["crosstalk_interval"]
        assert -1 <= clo <= u["crosstalk"] <= chi <= 1 and 0 <= u["truly_control"] <= 1
    from clawbridge.store import Store
    with Store.open(settings.db_url) as store:  # each user's step trained their own lineage
        assert {st.user for st in store.training_steps()} == {"alice", "bob"}
        assert {v.user for v in store.versions() if v.version} == {"alice", "bob"}
        for name, u in (("alice", alice), ("bob", bob)):  # each is served their own version (v0: held back)
            assert u["version"] == 0 or store.policy_version(u["version"]).user == name
    for name in ("alice", "bob"):
        with Store.open(settings.model_copy(update={"data_dir": settings.data_dir / f"alone-{name}"}).db_url) as solo:
            assert {st.user for st in solo.training_steps()} == {name}  # the other never talked there
    rows = dict(two_users.result_table(result))
    assert any("crosstalk" in v for v in rows.values())


async def test_each_users_candidate_is_gated_against_their_own_twin(tmp_path: Path, tokenizer) -> None:
    """The gate asks the twin with the candidate's own user's preferences, never another's, and
    what users share is asked once (v0's answers, cached by version and instruction)."""
    from clawbridge.learning.learner import Learner
    from clawbridge.server import bind_learner
    from clawbridge.store import Preference

    backend, store, lineages = await started(tmp_path, batch_size=2)
    settings = settings_for(tmp_path, batch_size=2, gate="on", gate_probes=4, gate_probes_max=4, gate_max_tokens=4)
    learner = Learner(settings)
    bind_learner(learner, backend, store, lineages=lineages)
    try:
        for user, text in (("alice", "Answer in one short sentence."), ("bob", "Use bullet points.")):
            store.save_preferences([Preference(text, 2, ("t1", "t2"), 0, state="applied", kind="length")], user)
        judged(store, tokenizer, "alice", 2, word="sunny")
        judged(store, tokenizer, "bob", 2, word="rainy")
        while await learner.step_once() is not None:
            pass
        asked = {d.user: d.asked for d in store.history().decisions}
        assert asked == {"alice": "Answer in one short sentence.", "bob": "Use bullet points."}
        assert {d.user for d in store.history("bob").decisions} == {"bob"}
        gate = learner.trainer.promotion.gate  # type: ignore[union-attr]
        assert gate is not None and all(t.promotion.gate is gate for t in learner.trainers())  # one gate for all
        assert sum(1 for version, instruction in gate.answers if version == 0 and instruction is None) == 1
    finally:
        await backend.close()
        store.close()
