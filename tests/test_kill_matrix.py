"""The kill matrix (issue 14): a trainer process is killed with SIGKILL at each boundary of a
training step or a rollback, then a new process resumes from the data directory. Whatever the
boundary and the checkpoint cadence: the restart serves the newest recorded version with the
weights recorded for it, versions only go up and are never reused, published weights are never
written over, no committed update is lost and no sample is trained twice.

Each case runs two processes (`tests/kill_child.py`) on the tiny random model."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from clawbridge.store import Store
from test_collector import settings_for

CHILD = Path(__file__).with_name("kill_child.py")

CASES = [
    # (boundary, checkpoint_every)
    pytest.param("commit", 10, id="after-commit-default-cadence"),
    pytest.param("publish", 1, id="after-publish-before-commit"),
    pytest.param("train_step", 10, id="inside-train_step", marks=pytest.mark.slow),
    pytest.param("commit", 1, id="after-commit-before-checkpoint", marks=pytest.mark.slow),
    pytest.param("rollback", 1, id="during-rollback", marks=pytest.mark.slow),
]


def life(data_dir: Path, phase: str, boundary: str, every: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(CHILD), str(data_dir), phase, boundary, str(every)],
                          capture_output=True, text=True, timeout=600, env=env)


def adapters(data_dir: Path) -> dict[str, str]:
    """Published weights on disk: folder -> digest of its weights."""
    out = {}
    for f in sorted((data_dir / "adapters").glob("v*/adapter_model.safetensors")):
        out[f.parent.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def scores(data_dir: Path) -> dict[int, list[float]]:
    lines = (data_dir / "scores.jsonl").read_text().splitlines()
    return {json.loads(x)["version"]: json.loads(x)["score"] for x in lines}


@pytest.mark.parametrize("boundary,every", CASES)
def test_a_kill_at_any_boundary_loses_no_update_and_reuses_no_version(tmp_path: Path, boundary: str, every: int):
    data = tmp_path / "data"
    crash = life(data, "crash", boundary, every)
    assert crash.returncode == -signal.SIGKILL, crash.stderr[-3000:]

    store = Store.open(settings_for(data).db_url)
    newest = store.latest_version()
    steps_before = store.training_steps()
    store.close()
    assert newest is not None
    on_disk = adapters(data)
    committed = scores(data)

    restart = life(data, "restart", "-", every)
    assert restart.returncode == 0, restart.stderr[-3000:]
    report: dict[str, Any] = json.loads(restart.stdout.split("REPORT ", 1)[1])

    # the restart serves the newest recorded version, with the weights recorded for it
    assert report["version_at_start"] == newest.version
    if newest.version in committed:
        for got, want in zip(report["score_at_start"], committed[newest.version], strict=True):
            assert math.isclose(got, want, abs_tol=1e-5), (got, want)
    # published weights are never written over (an orphan left by the kill keeps its number)
    after = adapters(data)
    assert all(after[name] == digest for name, digest in on_disk.items()), "published weights were overwritten"

    store = Store.open(settings_for(data).db_url)
    try:
        versions = [v.version for v in store.versions()]
        steps = store.training_steps()
        samples = store.get_samples(list(range(1, 11)))
    finally:
        store.close()
    # versions only go up, each number once; the new ones above every version published before
    assert versions == sorted(set(versions))
    highest_before = max([newest.version] + [int(n[1:]) for n in on_disk])
    assert all(v > highest_before for v in report["steps"]), (report["steps"], highest_before)
    afters = [s.version_after for s in steps]
    assert afters == sorted(set(afters)), afters
    # training went on from the newest version: the first step after the restart starts there
    first_new = steps[len(steps_before)]
    assert first_new.version_before == newest.version, (first_new, newest)
    # no sample trained twice, and each trained sample belongs to a recorded step
    trained = [s for s in samples if s.state == "trained"]
    assert len({s.id for s in trained}) == len(trained) == sum(s.samples for s in steps)
    assert {s.step for s in trained} <= {s.step for s in steps}
