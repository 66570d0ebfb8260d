"""One life of a trainer for the kill matrix (tests/test_kill_matrix.py), in its own process.

    python kill_child.py DATA_DIR crash BOUNDARY CHECKPOINT_EVERY
        resume, then train three steps; the third dies by SIGKILL at BOUNDARY (`rollback`: the
        three steps finish and a rollback to v1 dies; `commit-flapping`, `commit-down`: the store
        fails the third step's commit, see FLAPPING)
    python kill_child.py DATA_DIR restart - CHECKPOINT_EVERY
        resume, report what serves, then train two more steps

Each committed version's score of a fixed completion is appended to DATA_DIR/scores.jsonl, so
the parent can check that the weights a restart serves are the ones that were recorded."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from clawbridge.backends.local import LocalBackend
from clawbridge.learning.promotion import resume
from clawbridge.learning.trainer import Trainer
from clawbridge.store import Store
from helpers.learning import judged_samples, settings_for

PROMPT, COMPLETION = (1, 520, 3121, 28), (17, 401, 2032)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(boundary: str, backend: Any, store: Store) -> None:
    """Make the next call at `boundary` the process's last."""
    if boundary in ("train_step", "publish", "rollback"):
        orig = getattr(backend, boundary)

        async def then_die(*a: Any, **kw: Any) -> Any:
            await orig(*a, **kw)  # the update is made (train_step) or published (publish, rollback)
            die()

        setattr(backend, boundary, then_die)
    elif boundary == "commit":  # the step is committed; its checkpoint never happens
        orig_record = store.record_training_step

        def record_then_die(*a: Any, **kw: Any) -> Any:
            orig_record(*a, **kw)
            die()

        store.record_training_step = record_then_die  # type: ignore[method-assign]
    elif boundary in FLAPPING:
        flap(boundary, store, die)
    else:
        raise SystemExit(f"unknown boundary {boundary}")


# the store fails the step's commit: `commit-flapping` twice with nothing written, then once
# after the step landed (the acknowledgement lost), and the process dies once the retry finds
# the step recorded; `commit-down` every time, and the process dies while it waits the store out
FLAPPING = ("commit-flapping", "commit-down")


def flap(boundary: str, store: Store, kill: Any) -> None:
    """Make the store fail the next step's commit as `boundary` says, then `kill()`."""
    import sqlite3

    orig_record, orig_recorded, calls = store.record_training_step, store.step_recorded, []

    def record(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if boundary == "commit-down" and len(calls) == 3:
            kill()
        if boundary == "commit-flapping" and len(calls) == 3:
            orig_record(*a, **kw)
        raise sqlite3.OperationalError("database is locked")

    def recorded(*a: Any, **kw: Any) -> bool:
        found = orig_recorded(*a, **kw)
        if found:
            kill()
        return found

    store.record_training_step = record  # type: ignore[method-assign]
    store.step_recorded = recorded  # type: ignore[method-assign]


async def main(data_dir: Path, phase: str, boundary: str, checkpoint_every: int) -> None:
    # max_staleness: the test's turns are all recorded at v0; staleness is not what is tested here
    settings = settings_for(data_dir, batch_size=2, checkpoint_every=checkpoint_every, max_staleness=1000)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    trainer = Trainer(settings.training, backend, store, resumed=await resume(backend, store))
    scores = data_dir / "scores.jsonl"

    async def log_score(version: int) -> None:
        with scores.open("a") as f:
            f.write(json.dumps({"version": version, "score": await backend.score(PROMPT, COMPLETION)}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    report: dict[str, Any] = {"version_at_start": backend.version,
                              "score_at_start": await backend.score(PROMPT, COMPLETION)}
    if phase == "crash":
        judged_samples(store, 6)
        for k in range(3):
            if k == 2 and boundary != "rollback":
                arm(boundary, backend, store)
            r = await trainer.step_once()
            assert r is not None
            await log_score(r.version)
        arm("rollback", backend, store)
        await trainer.promotion.rollback(1)
        raise SystemExit("the rollback should have died")
    judged_samples(store, 4)
    report["steps"] = []
    for _ in range(2):
        r = await trainer.step_once()
        assert r is not None
        report["steps"].append(r.version)
        await log_score(r.version)
    await backend.close()
    store.close()
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])))
