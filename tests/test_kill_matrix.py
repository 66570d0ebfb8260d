"""The kill matrix (issue 14): a trainer process is killed with SIGKILL at each boundary of a
training step or a rollback, then a new process resumes from the data directory. Whatever the
boundary and the checkpoint cadence: the restart serves the newest recorded version with the
weights recorded for it, versions only go up and are never reused, published weights are never
written over, no committed update is lost and no sample is trained twice. The same holds with
the store flapping at the commit (it fails, lands with its acknowledgement lost, or stays down
until the kill).

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
from helpers.learning import settings_for

CHILD = Path(__file__).with_name("kill_child.py")

CASES = [
    # (boundary, checkpoint_every)
    pytest.param("commit", 10, id="after-commit-default-cadence"),
    pytest.param("publish", 1, id="after-publish-before-commit"),
    pytest.param("train_step", 10, id="inside-train_step", marks=pytest.mark.slow),
    pytest.param("commit", 1, id="after-commit-before-checkpoint", marks=pytest.mark.slow),
    pytest.param("rollback", 1, id="during-rollback", marks=pytest.mark.slow),
    # the store flapping at the commit (kill_child.FLAPPING): a step whose commit fails is
    # retried, never half applied, and a kill while it waits loses nothing committed
    pytest.param("commit-flapping", 10, id="store-flapping-at-commit"),
    pytest.param("commit-down", 1, id="store-down-at-commit", marks=pytest.mark.slow),
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
    if boundary == "commit-flapping":  # the third step landed through the flapping, then the kill
        assert [s.step for s in steps_before] == [1, 2, 3] and max(int(n[1:]) for n in on_disk) == newest.version
    elif boundary == "commit-down":  # killed while the third step waited: published, not recorded
        assert [s.step for s in steps_before] == [1, 2] and max(int(n[1:]) for n in on_disk) > newest.version

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


# --- the same matrix on the cloud fakes: the platform outlives the client process ---------------


class Killed(BaseException):
    """The process dies here: nothing after this point runs (not even `except Exception`)."""


def arm_in_process(boundary: str, backend: Any, store: Store) -> None:
    if boundary in ("train_step", "publish", "rollback"):
        orig = getattr(backend, boundary)

        async def then_die(*a: Any, **kw: Any) -> Any:
            await orig(*a, **kw)
            raise Killed(boundary)

        setattr(backend, boundary, then_die)
    elif boundary.startswith("commit-"):  # the store flapping (kill_child.FLAPPING)
        from kill_child import flap

        def kill() -> None:
            raise Killed(boundary)

        flap(boundary, store, kill)
    else:
        orig_record = store.record_training_step

        def record_then_die(*a: Any, **kw: Any) -> Any:
            orig_record(*a, **kw)
            raise Killed(boundary)

        store.record_training_step = record_then_die  # type: ignore[method-assign]


@pytest.mark.parametrize("platform", ["tinker", "fireworks", pytest.param("modal", marks=pytest.mark.slow)])
@pytest.mark.parametrize("boundary", ["train_step", "publish", "commit", "rollback", "commit-flapping",
                                      pytest.param("commit-down", marks=pytest.mark.slow)])
async def test_a_kill_on_a_cloud_fake_loses_no_update_and_reuses_no_version(
    tmp_path: Path, tokenizer, boundary: str, platform: str
):
    from clawbridge.learning.promotion import resume
    from clawbridge.learning.trainer import Trainer
    from helpers.learning import judged_samples
    from kill_child import COMPLETION, PROMPT

    data = tmp_path / "data"
    data.mkdir()
    settings = settings_for(data, batch_size=2, checkpoint_every=10, max_staleness=1000)
    if platform == "tinker":
        from clawbridge.backends.tinker import TinkerBackend
        from fakes.fake_tinker import FakeTinkerService
        from helpers.cloud import FAST
        from helpers.cloud import TINKER_BASE as BASE

        service = FakeTinkerService()  # the cloud: it keeps every saved state across client restarts

        def backend_of() -> Any:
            return TinkerBackend(service_client=service, base_model=BASE, tokenizer=tokenizer, retry=FAST,
                                 state_index=data / "tinker-states.json")
    elif platform == "modal":
        from clawbridge.backends.modal import ModalBackend
        from fakes.fake_modal import FakeEngine
        from helpers.cloud import MODAL_FAST

        def backend_of() -> Any:  # a new engine on the same directory: a cold start on the Volume
            return ModalBackend(engine=FakeEngine(data / "volume"), tokenizer=tokenizer, model_name="tiny-random",
                                context_length=32768, retry=MODAL_FAST)
    else:
        from clawbridge.backends.fireworks import FireworksBackend
        from fakes.fake_fireworks import FakeFiretitanService
        from helpers.cloud import FAST as FW_FAST
        from helpers.cloud import FIREWORKS_BASE as FW_BASE

        firetitan = FakeFiretitanService()

        def backend_of() -> Any:
            return FireworksBackend(connect=lambda: firetitan, base_model=FW_BASE, tokenizer=tokenizer, retry=FW_FAST,
                                    state_index=data / "tinker-states.json")

    async def life() -> tuple[Store, Any, Trainer]:
        store = Store.open(settings.db_url)
        backend = backend_of()
        await backend.start()
        trainer = Trainer(settings.training, backend, store, resumed=await resume(backend, store))
        return store, backend, trainer

    store, backend, trainer = await life()
    judged_samples(store, 6)
    committed: dict[int, list[float]] = {}
    try:
        for k in range(3):
            if k == 2 and boundary != "rollback":
                arm_in_process(boundary, backend, store)
            r = await trainer.step_once()
            assert r is not None
            committed[r.version] = await backend.score(PROMPT, COMPLETION)
        arm_in_process("rollback", backend, store)
        await trainer.promotion.rollback(1)
        raise AssertionError("the rollback should have died")
    except Killed:
        pass
    store.close()  # the process is gone; what it committed stays

    probe = Store.open(settings.db_url)
    newest = probe.latest_version()
    steps_before = probe.training_steps()
    probe.close()
    assert newest is not None
    if boundary.startswith("commit-"):  # through the flapping (commit-flapping) or killed waiting
        assert [s.step for s in steps_before] == ([1, 2, 3] if boundary == "commit-flapping" else [1, 2])
    index = data / "tinker-states.json"
    states_before = json.loads(index.read_text()) if index.exists() else {}
    weights_before = adapters(data / "volume" / "engine") if platform == "modal" else {}

    store, backend, trainer = await life()
    try:
        assert backend.version == newest.version
        if newest.version in committed:
            assert await backend.score(PROMPT, COMPLETION) == pytest.approx(committed[newest.version], abs=1e-5)
        judged_samples(store, 4)
        new_versions = []
        for _ in range(2):
            r = await trainer.step_once()
            assert r is not None
            new_versions.append(r.version)
        versions = [v.version for v in store.versions()]
        steps = store.training_steps()
        samples = store.get_samples(list(range(1, 11)))
    finally:
        await backend.close()
        store.close()
    states_after = json.loads(index.read_text()) if index.exists() else {}
    weights_after = adapters(data / "volume" / "engine") if platform == "modal" else {}
    assert all(weights_after[n] == d for n, d in weights_before.items()), "published weights overwritten"
    assert all(states_after[name] == entry for name, entry in states_before.items()), ("saved states overwritten", {n: (e, states_after.get(n)) for n, e in states_before.items() if states_after.get(n) != e})
    highest_before = max([newest.version] + [int(e["version"]) for e in states_before.values()]
                         + [int(n[1:]) for n in weights_before])
    assert all(v > highest_before for v in new_versions), (new_versions, highest_before)
    assert versions == sorted(set(versions))
    afters = [s.version_after for s in steps]
    assert afters == sorted(set(afters)), afters
    assert steps[len(steps_before)].version_before == newest.version
    trained = [s for s in samples if s.state == "trained"]
    assert len({s.id for s in trained}) == len(trained) == sum(s.samples for s in steps)
