"""`hint_selection = overlap` takes effect: the learner builds the teacher it needs, and the
turn the judges see carries the completion the teacher scores (it carried neither before)."""

from __future__ import annotations

from pathlib import Path

from clawbridge.backends.local import LocalBackend
from clawbridge.judges.hints import HintJudge
from clawbridge.learning.learner import Learner
from clawbridge.server import bind_learner
from clawbridge.store import Store
from helpers.learning import record_turns, settings_for


async def test_overlap_selection_ranks_hints_with_the_teacher(tmp_path: Path):
    settings = settings_for(tmp_path, judge="backend", hint_selection="overlap", gate="off")
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        [tid] = record_turns(store, 1)
        learner = Learner(settings)
        bind_learner(learner, backend, store)
        assert learner.collector is not None
        hint = learner.collector.judges.hint
        assert isinstance(hint, HintJudge) and hint.selection == "overlap" and hint.scorer is not None
        turn = store.get_turn(tid)
        assert turn is not None
        ctx = learner.collector.context(turn)
        assert ctx.completion_ids == tuple(turn.completion_ids) and len(ctx.logprobs) == len(ctx.completion_ids)
        near = await hint.scorer(ctx, "Answer in one short sentence.")
        assert -1.0 <= near <= 0.0  # minus the mean clipped gap between teacher and student
    finally:
        await backend.close()
        store.close()
