"""The Fireworks backend against an offline Fireworks training SDK (tests/fakes/fake_fireworks.py):
Fireworks' own types, NUM_LOSS_TOKENS normalisation on the server, 425 during hot-load."""

from __future__ import annotations

import pytest
from clawbridge.backends.fireworks import FireworksBackend
from clawbridge.backends.remote import PermanentBackendError
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams
from fakes.fake_fireworks import (
    FakeDeployment,
    FakeFiretitanService,
    FakeWeightSyncer,
    status_error,
)
from fakes.reference import fixed_batch, max_diff, reference_step
from helpers.cloud import FAST
from helpers.cloud import FIREWORKS_BASE as BASE

PROMPT = (1, 520, 3121, 28, 1830, 446)


async def serverless(tokenizer, service: FakeFiretitanService | None = None) -> FireworksBackend:
    svc = service or FakeFiretitanService()
    b = FireworksBackend(connect=lambda: svc, base_model=BASE, tokenizer=tokenizer, retry=FAST)
    await b.start()
    return b


async def dedicated(tokenizer, loading_requests: int = 2) -> tuple[FireworksBackend, FakeDeployment]:
    svc = FakeFiretitanService()
    deployment = FakeDeployment(svc.platform, loading_requests=loading_requests)
    b = FireworksBackend(
        connect=lambda: svc, base_model=BASE, mode="dedicated", tokenizer=tokenizer, retry=FAST,
        deployment_sampler=deployment, weight_syncer=lambda training: FakeWeightSyncer(training, deployment),
    )
    await b.start()
    return b, deployment


async def test_train_step_normalised_by_loss_tokens_equals_the_local_update(tokenizer) -> None:
    batch, spec, optim = fixed_batch(), LossSpec(), OptimSpec(learning_rate=1e-2)
    svc = FakeFiretitanService()
    b = await serverless(tokenizer, svc)
    metrics = await b.train_step(batch, spec, optim)
    assert svc.training is not None and svc.training.normalizations == ["num_loss_tokens"]
    assert max_diff(svc.platform.current_weights(), reference_step(batch, spec, optim)) < 1e-5
    assert 0.0 < metrics.clip_fraction < 1.0


async def test_policy_scores_come_from_forward_cross_entropy_and_match_sampling(tokenizer) -> None:
    b = await serverless(tokenizer)
    (c,) = await b.sample(PROMPT, SamplingParams(max_tokens=5, seed=1))
    assert c.version == 0 and len(c.tokens) == len(c.logprobs)
    assert await b.score(PROMPT, c.tokens) == pytest.approx(list(c.logprobs), abs=1e-4)


async def test_a_background_request_is_accepted_and_sampled_as_a_users(tokenizer) -> None:
    """Neither Fireworks sampler takes a priority: the protocol's keyword is accepted, and a
    background request is the same call as a user's (serverless and on a deployment)."""
    params = SamplingParams(max_tokens=5, seed=4)
    for b in (await serverless(tokenizer), (await dedicated(tokenizer, loading_requests=0))[0]):
        (user,) = await b.sample(PROMPT, params)
        (background,) = await b.sample(PROMPT, params, priority="background")
        [chunk] = [c async for c in b.sample_stream(PROMPT, params, priority="background")]
        assert background.tokens == user.tokens == chunk.tokens


async def test_serverless_publish_adds_a_version_and_keeps_the_base_for_scoring(tokenizer) -> None:
    b = await serverless(tokenizer)
    completion = (17, 401, 2032)
    base_lp = await b.score(PROMPT, completion)
    await b.train_step([Datum(PROMPT, completion, tuple(base_lp), (1.0, 1.0, 1.0))], optim=OptimSpec(learning_rate=5e-2))
    v1 = await b.publish()
    assert (v1.version, b.version) == (1, 1) and v1.path == "accounts/fake/snapshots/policy-v1"
    assert await b.score(PROMPT, completion, model="base") == pytest.approx(base_lp, abs=1e-5)
    assert await b.score(PROMPT, completion) != pytest.approx(base_lp, abs=1e-4)
    (old,), (new,) = await b.sample(PROMPT, SamplingParams(max_tokens=2), version=0), await b.sample(PROMPT, SamplingParams(max_tokens=2))
    assert (old.version, new.version) == (0, 1)


async def test_dedicated_requests_during_hot_load_wait_for_the_adapter_instead_of_failing(tokenizer) -> None:
    b, deployment = await dedicated(tokenizer, loading_requests=3)
    await b.train_step(fixed_batch(), optim=OptimSpec(learning_rate=1e-2))
    v1 = await b.publish()
    assert v1.version == 1
    (c,) = await b.sample(PROMPT, SamplingParams(max_tokens=3))  # the deployment answers 425 three times
    assert deployment.answered_425 == 3 and c.version == 1 and c.tokens


async def test_rate_limits_and_server_errors_are_retried(tokenizer) -> None:
    svc = FakeFiretitanService()
    b = await serverless(tokenizer, svc)
    svc.faults.add("forward_backward", status_error(429))
    svc.faults.add("optim_step", status_error(502))
    batch, optim = fixed_batch(), OptimSpec(learning_rate=1e-2)
    await b.train_step(batch, optim=optim)
    assert max_diff(svc.platform.current_weights(), reference_step(batch, LossSpec(), optim)) < 1e-5


async def test_a_key_without_training_api_access_says_so_at_start(tokenizer) -> None:
    svc = FakeFiretitanService(training_access=False)
    b = FireworksBackend(connect=lambda: svc, base_model=BASE, tokenizer=tokenizer, retry=FAST)
    with pytest.raises(PermanentBackendError, match="no Training API access"):
        await b.start()


async def test_resuming_from_state_continues_training_identically(tokenizer) -> None:
    optim = OptimSpec(learning_rate=1e-2)
    svc = FakeFiretitanService()
    b = await serverless(tokenizer, svc)
    await b.train_step(fixed_batch(), optim=optim)
    path = await b.save_state("step-1")
    await b.train_step(fixed_batch(2), optim=optim)
    straight = svc.platform.current_weights()
    await b.load_state(path)
    await b.train_step(fixed_batch(2), optim=optim)
    assert max_diff(svc.platform.current_weights(), straight) < 1e-6


def test_constructing_from_settings_connects_to_nothing(tmp_path, monkeypatch) -> None:
    from clawbridge.config import Settings
    from clawbridge.protocol import BackendError

    monkeypatch.delenv("FIREWORKS_API_KEY", raising=False)
    with pytest.raises(BackendError, match="FIREWORKS_API_KEY is not set"):
        FireworksBackend.from_settings(Settings(data_dir=tmp_path))
    monkeypatch.setenv("FIREWORKS_API_KEY", "fw_" + "k" * 30)
    b = FireworksBackend.from_settings(Settings(data_dir=tmp_path))
    assert b.service is None and b.mode == "serverless"  # the eager SDK constructor waits for start()


async def test_dedicated_rollback_hot_loads_the_old_weights_as_a_full_checkpoint(tokenizer) -> None:
    b, deployment = await dedicated(tokenizer, loading_requests=0)
    await b.train_step(fixed_batch(), optim=OptimSpec(learning_rate=1e-2))
    await b.publish()
    v1_weights = deployment.weights
    await b.train_step(fixed_batch(2), optim=OptimSpec(learning_rate=1e-2))
    await b.publish()
    v3 = await b.rollback(1)
    assert v3.version == b.version == 3
    assert max_diff(deployment.weights, v1_weights) == 0
    syncer = b._syncer
    assert syncer.checkpoint_types == ["base", "delta", "base"]  # the chain restarts at the rollback
    (c,) = await b.sample(PROMPT, SamplingParams(max_tokens=3))
    assert c.version == 3


async def test_an_older_version_is_scored_on_its_snapshot_and_the_trainers_on_forward(tokenizer, tmp_path) -> None:
    """`score(version=K)`: the trainer's forward while it holds vK's weights, vK's sampler snapshot
    otherwise; the snapshots stay in the index, so a restarted process opens them again."""
    svc = FakeFiretitanService()
    index = tmp_path / "fireworks_states.json"
    b = FireworksBackend(connect=lambda: svc, base_model=BASE, tokenizer=tokenizer, retry=FAST, state_index=index)
    await b.start()
    completion = (17, 401, 2032)
    optim = OptimSpec(learning_rate=5e-2)
    await b.train_step(fixed_batch(), optim=optim)
    await b.publish()
    v1 = await b.score(PROMPT, completion)  # right after the publish: the trainer's forward
    assert svc.faults.calls["compute_logprobs"] == 0
    await b.train_step(fixed_batch(2), optim=optim)
    assert await b.score(PROMPT, completion, version=1) == pytest.approx(v1, abs=1e-6)  # v1's snapshot
    assert svc.faults.calls["compute_logprobs"] == 1
    await b.publish()
    assert await b.score(PROMPT, completion) != pytest.approx(v1, abs=1e-4)

    restarted = FireworksBackend(connect=lambda: svc, base_model=BASE, tokenizer=tokenizer, retry=FAST,
                                 state_index=index)
    await restarted.start()
    await restarted.restore(2, None)
    assert 1 not in restarted._samplers
    assert await restarted.score(PROMPT, completion, version=1) == pytest.approx(v1, abs=1e-6)
    (c,) = await restarted.sample(PROMPT, SamplingParams(max_tokens=3, seed=4), version=1)
    assert c.version == 1


async def test_a_lineage_switch_loads_its_state_into_the_one_trainer_and_a_deployment_refuses_it(tokenizer) -> None:
    from clawbridge.protocol import BackendError, Lineages

    svc = FakeFiretitanService()
    b = await serverless(tokenizer, svc)
    assert isinstance(b, Lineages)
    optim = OptimSpec(learning_rate=1e-2)
    await b.train_step(fixed_batch(), optim=optim)
    a = await b.save_state("lineage-a")
    await b.switch(None, 0)  # v0's checkpoint: the fresh adapter
    await b.train_step(fixed_batch(1), optim=optim)
    await b.switch(a)
    await b.train_step(fixed_batch(2), optim=optim)
    assert svc.faults.calls["load_state"] == 1 and svc.faults.calls["load_state_with_optimizer"] == 1
    assert b.newest == b.version == 0
    straight = await serverless(tokenizer)
    await straight.train_step(fixed_batch(), optim=optim)
    await straight.train_step(fixed_batch(2), optim=optim)
    assert max_diff(svc.platform.current_weights(), straight.service.platform.current_weights()) < 1e-6

    d, _ = await dedicated(tokenizer, loading_requests=0)
    with pytest.raises(BackendError, match="serves one adapter"):
        await d.switch(None, 0)
    await d.publish()
    await d.train_step(fixed_batch(), optim=optim)
    with pytest.raises(BackendError, match="dedicated deployment keeps one adapter"):
        await d.score(PROMPT, (17, 401), version=1)
