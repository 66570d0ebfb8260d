"""The collector and the sample states across a restart: a process that judged turns is killed
(SIGKILL) before it trains; a fresh process resumes from the store with nothing lost, nothing
judged again and nothing trained twice. Tiny random model, rules judge, real SQLite store."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.learning.collector import combine_signal, judge_kinds
from clawbridge.learning.trainer import Trainer
from clawbridge.store import JudgeVote, Judgment, Store
from helpers.learning import collector_for, record_turns, settings_for


def test_judge_kinds_follow_the_method():
    assert judge_kinds("binary") == ("prm",)
    assert judge_kinds("opd") == ("hint",)
    assert judge_kinds("combine") == ("prm", "hint")


def test_explicit_feedback_outranks_the_judges():
    def j(kind: str, reward: float | None = None, hint: str | None = None) -> Judgment:
        return Judgment(turn_id="t", judge="x", kind=kind, votes=(JudgeVote(raw="r"),), reward=reward, hint=hint)  # type: ignore[arg-type]

    assert combine_signal([j("prm", 1.0), j("hint", hint="judge hint")]).reward == 1.0
    both = combine_signal([j("prm", 1.0), j("hint", hint="judge hint"), j("feedback", -1.0)])
    assert (both.reward, both.hint, both.source) == (-1.0, "judge hint", "feedback+judge")
    only = combine_signal([j("feedback", None, "say it shorter please")])
    assert (only.reward, only.hint, only.source) == (0.0, "say it shorter please", "feedback")
    assert combine_signal([]).reward == 0.0


@contextlib.asynccontextmanager
async def _judged_but_unsettled(data_dir: Path) -> AsyncIterator[tuple[Any, Store, LocalBackend, str, int]]:
    """A turn whose judgments are stored and whose sample is still pending (the state a crash
    leaves between the two): the settings, store, started backend, turn id and sample id."""
    settings = settings_for(data_dir)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        [tid] = record_turns(store, 1)
        sid, _ = store.create_sample(tid, "combine", state="pending")
        store.add_judgment(Judgment(turn_id=tid, judge="rules", kind="prm", votes=(JudgeVote(raw="+1", value=1),), reward=1.0))
        store.add_judgment(Judgment(turn_id=tid, judge="rules", kind="hint", votes=(JudgeVote(raw="none"),)))
        yield settings, store, backend, tid, sid
    finally:
        await backend.close()
        store.close()


async def test_a_sample_dropped_while_it_is_judged_is_left_dropped_without_an_error(
        data_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """A new version begins serving while the collector judges a turn of an old one: the
    trainer drops the turn's sample as stale meanwhile, and the collector's write finds it gone.
    The sample stays dropped, and that is no failure (no retry, no error logged)."""
    async with _judged_but_unsettled(data_dir) as (settings, store, backend, _tid, sid):
        settle = store.set_sample_advantages

        def stale_meanwhile(*args: object, **kwargs: object) -> None:
            assert store.drop_stale_samples(5) == 1  # what the trainer does when a newer version serves
            settle(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(store, "set_sample_advantages", stale_meanwhile)
        collector = collector_for(settings, backend, store)
        assert await collector.run_once() == 0
        [s] = store.get_samples([sid])
        assert (s.state, s.reason) == ("dropped", "stale")
        assert collector.stats.failures == 0 and not [r for r in caplog.records if r.levelname == "ERROR"]
        assert await collector.run_once() == 0  # nothing left to settle


async def test_a_pending_sample_with_stored_judgments_is_finished_without_judging_again(data_dir: Path):
    async with _judged_but_unsettled(data_dir) as (settings, store, backend, tid, sid):
        collector = collector_for(settings, backend, store)
        assert await collector.run_once() == 1
        [s] = store.get_samples([sid])
        assert s.state == "judged" and s.reward == 1.0 and s.advantages == (1.0,) * len(s.completion_ids)
        assert len(store.judgments(tid)) == 2  # nothing judged twice
        assert await collector.run_once() == 0


CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from helpers.learning import collector_for, settings_for
    from clawbridge.backends.local import LocalBackend
    from clawbridge.store import Store

    async def main():
        settings = settings_for(Path({data!r}))
        store = Store.open(settings.db_url)
        backend = LocalBackend.from_settings(settings)
        await backend.start()
        n = await collector_for(settings, backend, store).run_once()
        print("settled", n, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # between judging and training: no clean shutdown

    asyncio.run(main())
    """
)


@pytest.mark.timeout(240)
async def test_kill_between_judging_and_training_loses_nothing_and_trains_nothing_twice(data_dir: Path):
    settings = settings_for(data_dir)
    with Store.open(settings.db_url) as store:
        turns = record_turns(store, 6)  # replies: thanks, correction, neutral (x2)
    script = CHILD.format(tests=str(Path(__file__).parent), data=str(data_dir))
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=200,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert "settled 6" in child.stdout

    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        judged = store.pending_samples()
        dropped = [t for t in turns if t not in {s.turn_id for s in judged}]
        assert len(judged) == 4 and len(dropped) == 2  # the two neutral "ok" replies carry no signal
        votes_before = {t: len(store.judgments(t)) for t in turns}
        assert all(n == 2 for n in votes_before.values())  # a reward and a hint judgment each

        collector = collector_for(settings, backend, store)
        assert await collector.run_once() == 0  # resumed: nothing left to judge
        assert {t: len(store.judgments(t)) for t in turns} == votes_before

        trainer = Trainer(settings.training, backend, store)
        first, second = await trainer.step_once(), await trainer.step_once()
        assert first is not None and second is not None and await trainer.step_once() is None
        assert (first.version, second.version) == (1, 2)
        stats = store.stats()
        assert stats.samples["trained"] == 4 and stats.samples["judged"] == 0 and stats.samples["dropped"] == 2
        steps = store.training_steps()
        assert [s.samples for s in steps] == [2, 2]
        assert [v.version for v in store.versions()] == [1, 2]
    finally:
        await backend.close()
        store.close()
