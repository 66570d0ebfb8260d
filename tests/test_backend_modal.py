"""The Modal backend against the real Modal class run offline (tests/fakes/fake_modal.py): the
same engine as the local backend, Modal's serialisation, AuthError / InternalFailure faults, and
resume from the Volume on a cold start."""

from __future__ import annotations

from pathlib import Path

import pytest
from clawbridge.backends.costs import BudgetExceeded, CostMeter, Prices
from clawbridge.backends.local import LocalBackend
from clawbridge.backends.modal import ModalBackend
from clawbridge.backends.remote import PermanentBackendError
from clawbridge.types import OptimSpec, SamplingParams
from fakes.fake_modal import FakeEngine
from fakes.reference import fixed_batch
from helpers.cloud import MODAL_FAST as FAST
from modal.exception import AuthError, InternalFailure

pytestmark = pytest.mark.filterwarnings("ignore:.*executing locally.*")
PROMPT = (1, 520, 3121, 28, 1830, 446)


async def started(tokenizer, state: Path, **kw) -> tuple[ModalBackend, FakeEngine]:
    engine = FakeEngine(state)
    b = ModalBackend(engine=engine, tokenizer=tokenizer, model_name="tiny-random", context_length=32768,
                     retry=FAST, **kw)
    await b.start()
    return b, engine


async def test_samples_and_scores_come_from_the_engine_in_the_modal_class(tokenizer, tmp_path) -> None:
    b, _ = await started(tokenizer, tmp_path)
    (c,) = await b.sample(PROMPT, SamplingParams(max_tokens=4, seed=2))
    assert c.version == 0 and len(c.tokens) == len(c.logprobs) >= 1
    assert await b.score(PROMPT, c.tokens) == pytest.approx(list(c.logprobs), abs=1e-4)
    assert b.meter.snapshot()["by_activity"]["serve"]["gpu_seconds"] > 0  # type: ignore[index]


async def test_a_background_request_reaches_the_engine_in_the_modal_class_as_background(
    tokenizer, tmp_path, monkeypatch
) -> None:
    """The priority goes with the call: the container's engine serves its user first."""
    b, _ = await started(tokenizer, tmp_path)
    asked: list[str] = []
    real = LocalBackend.sample

    async def recorded(self, *args, priority="user", **kwargs):  # type: ignore[no-untyped-def]
        asked.append(priority)
        return await real(self, *args, priority=priority, **kwargs)

    monkeypatch.setattr(LocalBackend, "sample", recorded)
    params = SamplingParams(max_tokens=3, seed=5)
    (background,) = await b.sample(PROMPT, params, priority="background")
    [chunk] = [c async for c in b.sample_stream(PROMPT, params, priority="background")]
    (user,) = await b.sample(PROMPT, params)
    assert asked == ["background", "background", "user"]
    assert background.tokens == chunk.tokens == user.tokens


async def test_a_train_step_on_modal_equals_the_local_backends(tokenizer, tmp_path) -> None:
    batch, optim = fixed_batch(), OptimSpec(learning_rate=1e-2)
    b, _ = await started(tokenizer, tmp_path / "modal")
    local = LocalBackend("tiny-random", tmp_path / "local", lora_rank=8, lora_alpha=8, seed=0)
    await local.start()
    try:
        remote_metrics = await b.train_step(batch, optim=optim)
        local_metrics = await local.train_step(batch, optim=optim)
        assert remote_metrics.loss == pytest.approx(local_metrics.loss, rel=1e-5)
        probe = batch[0]
        assert await b.score(probe.prompt_ids, probe.completion_ids) == pytest.approx(
            await local.score(probe.prompt_ids, probe.completion_ids), abs=1e-5)
    finally:
        await local.close()


async def test_internal_failure_is_retried_and_auth_error_explains_the_fix(tokenizer, tmp_path) -> None:
    b, engine = await started(tokenizer, tmp_path)
    engine.faults.add("sample", InternalFailure("worker lost"))
    assert await b.sample(PROMPT, SamplingParams(max_tokens=2))
    assert engine.faults.calls["sample"] == 2
    engine.faults.add("score", AuthError("Token missing"))
    with pytest.raises(PermanentBackendError, match="modal token new"):
        await b.score(PROMPT, (5, 6))
    assert engine.faults.calls["score"] == 1


async def test_a_cold_start_resumes_from_the_state_on_the_volume(tokenizer, tmp_path) -> None:
    b, _ = await started(tokenizer, tmp_path)
    await b.train_step(fixed_batch(), optim=OptimSpec(learning_rate=5e-2))
    assert (await b.publish()).version == 1
    await b.save_state("step-1")
    probe = fixed_batch()[0]
    trained = await b.score(probe.prompt_ids, probe.completion_ids, model="policy")
    cold, _ = await started(tokenizer, tmp_path)  # a new container on the same Volume
    assert cold.version == 1
    assert await cold.score(probe.prompt_ids, probe.completion_ids) == pytest.approx(trained, abs=1e-5)


async def test_budget_in_gpu_seconds_stops_training_not_serving(tokenizer, tmp_path) -> None:
    meter = CostMeter.for_platform("modal", budget_usd=1e-9, prices=Prices(gpu_per_hour=3.95))
    b, _ = await started(tokenizer, tmp_path, meter=meter)
    with pytest.raises(BudgetExceeded):
        await b.train_step(fixed_batch())
    assert await b.sample(PROMPT, SamplingParams(max_tokens=2))


def test_remote_calls_without_credentials_fail_fast_with_auth_error(monkeypatch) -> None:
    from clawbridge.backends import modal_app

    for var in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", "/nonexistent/.modal.toml")
    with pytest.raises(AuthError):
        modal_app.Engine(model="tiny-random").info.remote()


async def test_a_cold_start_after_a_switch_serves_the_newest_and_trains_the_lineage_switched_to(
    tokenizer, tmp_path
) -> None:
    """The Volume remembers the switch: a new container serves the newest version (not the last
    checkpoint's) and trains on from what the switch loaded; versions keep one numbering."""
    from clawbridge.protocol import Lineages

    b, _ = await started(tokenizer, tmp_path)
    assert isinstance(b, Lineages)
    probe = fixed_batch()[0]
    await b.train_step(fixed_batch(), optim=OptimSpec(learning_rate=5e-2))
    assert (await b.publish()).version == 1
    a = await b.save_state("lineage-a")
    v1 = await b.score(probe.prompt_ids, probe.completion_ids)
    await b.switch(None, 0)
    await b.train_step(fixed_batch(2), optim=OptimSpec(learning_rate=5e-2))
    assert (await b.publish()).version == 2
    v2 = await b.score(probe.prompt_ids, probe.completion_ids)
    assert await b.score(probe.prompt_ids, probe.completion_ids, version=1) == pytest.approx(v1, abs=1e-6)

    cold, engine = await started(tokenizer, tmp_path)  # a new container on the same Volume
    assert cold.version == 2
    assert await cold.score(probe.prompt_ids, probe.completion_ids) == pytest.approx(v2, abs=1e-5)
    assert await cold.score(probe.prompt_ids, probe.completion_ids, version=1) == pytest.approx(v1, abs=1e-5)
    container = engine.obj._cached_user_cls_instance()
    trainable = await container.backend.engine.trainable_state()
    fresh = [float(w.abs().max()) for k, w in trainable.items() if "lora_B" in k]
    assert fresh and max(fresh) == 0  # B's adapter as the switch made it: fresh (B's step was never saved)
    await cold.switch(a)  # and A's state is on the Volume too
    assert (await cold.publish()).version == 3
    assert await cold.score(probe.prompt_ids, probe.completion_ids) == pytest.approx(v1, abs=1e-5)
