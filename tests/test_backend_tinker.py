"""The Tinker backend against an offline Tinker at the SDK boundary (tests/fakes/fake_tinker.py):
real `tinker.types` in and out, the platform's summed PPO loss on a tiny LoRA model, faults."""

from __future__ import annotations

import pytest
import tinker
import torch
from clawbridge.backends.costs import BudgetExceeded, CostMeter, Prices
from clawbridge.backends.remote import PermanentBackendError, RetryPolicy
from clawbridge.backends.tinker import TinkerBackend
from clawbridge.loss import ppo_loss
from clawbridge.protocol import BackendError, ContextLengthExceeded
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams
from fakes.fake_tinker import FakeTinkerService, status_error, timeout_error
from fakes.reference import fixed_batch, max_diff, reference_step
from fakes.torch_platform import Hang, TinyPlatform
from helpers.cloud import FAST
from helpers.cloud import TINKER_BASE as BASE

PROMPT = (1, 520, 3121, 28, 1830, 446)


def make_backend(tokenizer, service: FakeTinkerService | None = None, **kw) -> TinkerBackend:
    return TinkerBackend(service_client=service or FakeTinkerService(), base_model=BASE,
                         tokenizer=tokenizer, retry=kw.pop("retry", FAST), **kw)


async def started(tokenizer, **kw) -> TinkerBackend:
    b = make_backend(tokenizer, **kw)
    await b.start()
    return b


async def test_sampling_returns_tokens_with_logprobs_that_score_reproduces(tokenizer) -> None:
    b = await started(tokenizer)
    (c,) = await b.sample(PROMPT, SamplingParams(max_tokens=6, seed=3))
    assert c.version == 0 and 1 <= len(c.tokens) == len(c.logprobs) <= 6
    scored = await b.score(PROMPT, c.tokens)
    assert scored == pytest.approx(list(c.logprobs), abs=1e-4)  # on-policy ratio is 1
    assert b.meter.snapshot()["by_activity"]["serve"]["sampled_tokens"] == len(c.tokens)  # type: ignore[index]


async def test_a_background_request_is_accepted_and_sampled_as_a_users(tokenizer) -> None:
    """Tinker's sampling client has no priority: the protocol's keyword is accepted, and a
    background request is the same call as a user's."""
    b = await started(tokenizer)
    params = SamplingParams(max_tokens=5, seed=4)
    (user,) = await b.sample(PROMPT, params)
    (background,) = await b.sample(PROMPT, params, priority="background")
    [chunk] = [c async for c in b.sample_stream(PROMPT, params, priority="background")]
    assert background.tokens == user.tokens == chunk.tokens


async def test_train_step_with_summed_loss_equals_the_local_token_mean_update(tokenizer) -> None:
    batch, spec, optim = fixed_batch(), LossSpec(), OptimSpec(learning_rate=1e-2, grad_clip_norm=1.0)
    service = FakeTinkerService()
    b = await started(tokenizer, service=service)
    before = service.platform.current_weights()
    metrics = await b.train_step(batch, spec, optim)
    after = service.platform.current_weights()
    expected = reference_step(batch, spec, optim)
    assert max_diff(before, after) > 1e-3  # the step moved the adapter
    assert max_diff(after, expected) < 1e-5
    assert 0.0 < metrics.clip_fraction < 1.0  # both branches of the clip were exercised
    assert metrics.tokens == sum(len(d.completion_ids) for d in batch)


async def test_the_scale_makes_summed_gradients_equal_token_mean_gradients() -> None:
    """The proof in numbers: d/dθ Σ_t l_t(A_t/N) = d/dθ (1/N) Σ_t l_t(A_t), clip included."""
    batch, spec = fixed_batch(1), LossSpec()
    n = sum(len(d.completion_ids) for d in batch)
    grads = []
    for summed in (True, False):
        p = TinyPlatform()
        items, news, olds, advs = [], [], [], []
        for d in batch:
            full = [*d.prompt_ids, *d.completion_ids]
            pad = len(d.prompt_ids) - 1
            adv = [0.0] * pad + [a / n for a in d.advantages]
            items.append((full[:-1], full[1:], {"logprobs": [0.0] * pad + list(d.logprobs), "advantages": adv}))
            news.append(p.target_logprobs(full[:-1], full[1:])[pad:])
            olds += d.logprobs
            advs += d.advantages
        if summed:
            p.forward_backward(items, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
        else:
            new = torch.cat(news)
            ppo_loss(new, torch.tensor(olds), torch.tensor(advs), torch.ones_like(new), spec).backward()
        grads.append(torch.cat([q.grad.flatten() for q in p.params.values() if q.grad is not None]))
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-4)


async def test_rate_limit_then_success_is_retried(tokenizer) -> None:
    service = FakeTinkerService()
    b = await started(tokenizer, service=service)
    service.faults.add("sample", status_error(429))
    (c,) = await b.sample(PROMPT, SamplingParams(max_tokens=3))
    assert c.tokens and service.faults.calls["sample"] == 2


async def test_server_error_during_forward_backward_does_not_double_the_update(tokenizer) -> None:
    batch, optim = fixed_batch(), OptimSpec(learning_rate=1e-2)
    service = FakeTinkerService()
    b = await started(tokenizer, service=service)
    service.faults.add("forward_backward", status_error(503))
    service.faults.add("optim_step", status_error(500))
    await b.train_step(batch, LossSpec(), optim)
    assert max_diff(service.platform.current_weights(), reference_step(batch, LossSpec(), optim)) < 1e-5


async def test_a_call_that_hangs_past_its_timeout_is_retried(tokenizer) -> None:
    service = FakeTinkerService()
    b = await started(tokenizer, service=service, retry=RetryPolicy(attempts=2, initial_s=0.01, timeout_s=2.0))
    service.faults.add("compute_logprobs", Hang(3.0))
    assert len(await b.score(PROMPT, (5, 6, 7))) == 3
    assert service.faults.calls["compute_logprobs"] == 2


async def test_sdk_timeouts_are_retried_and_permanent_errors_are_not(tokenizer) -> None:
    service = FakeTinkerService()
    b = await started(tokenizer, service=service)
    service.faults.add("sample", timeout_error())
    await b.sample(PROMPT, SamplingParams(max_tokens=2))
    assert service.faults.calls["sample"] == 2
    for status in (400, 402):
        service.faults.add("sample", status_error(status))
        before = service.faults.calls["sample"]
        with pytest.raises(PermanentBackendError, match=str(status)):
            await b.sample(PROMPT, SamplingParams(max_tokens=2))
        assert service.faults.calls["sample"] == before + 1


async def test_persistent_server_errors_give_up_after_the_configured_attempts(tokenizer) -> None:
    service = FakeTinkerService()
    b = await started(tokenizer, service=service)
    service.faults.add("sample", *(status_error(502) for _ in range(3)))
    with pytest.raises(BackendError, match="502"):
        await b.sample(PROMPT, SamplingParams(max_tokens=2))
    assert service.faults.calls["sample"] == 3


async def test_publish_serves_new_requests_on_the_new_version_and_old_ones_on_theirs(tokenizer) -> None:
    b = await started(tokenizer, persist_every=2)
    completion = (17, 401, 2032)
    base_lp = await b.score(PROMPT, completion)
    await b.train_step([Datum(PROMPT, completion, tuple(base_lp), (1.0, 1.0, 1.0))], optim=OptimSpec(learning_rate=5e-2))
    v1 = await b.publish()
    assert (v1.version, v1.path, b.version) == (1, None, 1)
    assert await b.score(PROMPT, completion) != pytest.approx(base_lp, abs=1e-4)
    assert await b.score(PROMPT, completion, model="base") == pytest.approx(base_lp, abs=1e-5)
    (old,) = await b.sample(PROMPT, SamplingParams(max_tokens=2), version=0)
    (new,) = await b.sample(PROMPT, SamplingParams(max_tokens=2))
    assert (old.version, new.version) == (0, 1)
    v2 = await b.publish()
    assert v2.path == "tinker://fake-run/sampler_weights/policy-v2"  # persisted every 2 versions


async def test_resuming_from_state_continues_training_identically(tokenizer) -> None:
    batch, optim = fixed_batch(), OptimSpec(learning_rate=1e-2)
    service = FakeTinkerService()
    b = await started(tokenizer, service=service)
    await b.train_step(batch, optim=optim)
    path = await b.save_state("step-1")
    assert path == "tinker://fake-run/weights/step-1"
    await b.train_step(fixed_batch(2), optim=optim)
    straight = service.platform.current_weights()
    resumed = make_backend(tokenizer, service=service)  # a new process, same account
    await resumed.start()
    await resumed.load_state(path)
    await resumed.train_step(fixed_batch(2), optim=optim)
    assert max_diff(service.platform.current_weights(), straight) < 1e-6


async def test_budget_stops_training_and_never_serving(tokenizer) -> None:
    meter = CostMeter.for_platform("tinker", budget_usd=1e-6, prices=Prices(train_per_mtok=10.0))
    b = await started(tokenizer, meter=meter)
    await b.train_step(fixed_batch())
    with pytest.raises(BudgetExceeded):
        await b.train_step(fixed_batch())
    assert await b.sample(PROMPT, SamplingParams(max_tokens=2))


async def test_requests_beyond_the_context_and_unsupported_losses_fail_clearly(tokenizer) -> None:
    b = await started(tokenizer, context_length=16)
    with pytest.raises(ContextLengthExceeded):
        await b.sample(PROMPT, SamplingParams(max_tokens=11))
    with pytest.raises(BackendError, match="kl_coef"):
        await b.train_step(fixed_batch(), LossSpec(kl_coef=0.1))
    with pytest.raises(BackendError, match="top-k distillation"):
        await b.train_step(fixed_batch(), LossSpec(topk=20))


async def test_an_unknown_base_model_is_a_permanent_error_at_start(tokenizer) -> None:
    b = TinkerBackend(service_client=FakeTinkerService(), base_model="nope/nope", tokenizer=tokenizer, retry=FAST)
    with pytest.raises(PermanentBackendError, match="not available"):
        await b.start()


def test_from_settings_builds_a_real_service_client_without_network(monkeypatch, tmp_path) -> None:
    from clawbridge.config import Settings

    monkeypatch.setenv("TINKER_API_KEY", "tml-" + "x" * 40)
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")  # nothing listens: any call would fail
    b = TinkerBackend.from_settings(Settings(data_dir=tmp_path, budget_usd=5.0))
    assert type(b.service).__name__ == "ServiceClient" and b.meter.budget_usd == 5.0
    monkeypatch.delenv("TINKER_API_KEY")
    with pytest.raises(BackendError, match="TINKER_API_KEY is not set"):
        TinkerBackend.from_settings(Settings(data_dir=tmp_path))


async def test_rollback_after_a_restart_loads_the_versions_training_state_into_a_new_client(tokenizer, tmp_path) -> None:
    from clawbridge.protocol import UnknownVersion

    service = FakeTinkerService()
    index = tmp_path / "tinker_states.json"
    b = await started(tokenizer, service=service, state_index=index)
    await b.train_step(fixed_batch(), optim=OptimSpec(learning_rate=1e-2))
    await b.publish()
    v1_weights = service.platform.current_weights()
    await b.save_state("step-1")
    await b.train_step(fixed_batch(2), optim=OptimSpec(learning_rate=1e-2))
    await b.publish()
    restarted = make_backend(tokenizer, service=service, state_index=index)  # a new process
    await restarted.start()
    await restarted.load_state("step-1")
    restarted._version = 2  # as if it had resumed at v2 (the index still knows v1's state)
    v3 = await restarted.rollback(1)
    assert v3.version == 3 and service.faults.calls["create_training_client_from_state"] == 1
    assert max_diff(service.platform.current_weights(), v1_weights) == 0
    assert service.platform.optimizer is None  # weights only: the optimizer starts fresh
    with pytest.raises(UnknownVersion, match="never published"):
        await restarted.rollback(4)


async def test_a_sampler_weights_path_is_not_a_training_state(tokenizer) -> None:
    service = FakeTinkerService()
    b = await started(tokenizer, service=service)
    b._states.put("policy-v1", "tinker://fake-run/sampler_weights/ephemeral-1", 1)
    b._version = 1
    with pytest.raises(PermanentBackendError, match="no training weights"):
        await b.rollback(1)


async def test_switching_back_to_a_lineage_takes_up_its_training_client_again(tokenizer, tmp_path) -> None:
    """One training client per lineage: the one left is kept while it is exactly the state just
    saved of it, so the switch back costs no call; a state saved earlier is loaded into a new client."""
    from clawbridge.protocol import Lineages

    service = FakeTinkerService()
    b = await started(tokenizer, service=service, state_index=tmp_path / "index.json")
    assert isinstance(b, Lineages)
    optim = OptimSpec(learning_rate=1e-2)
    await b.train_step(fixed_batch(), optim=optim)
    early = await b.save_state("a-early")
    await b.train_step(fixed_batch(2), optim=optim)
    a = await b.save_state("a")
    a_weights = service.platform.current_weights()
    await b.switch(None, 0)  # B: a new LoRA run
    assert service.faults.calls["create_lora_training_client"] == 2
    await b.train_step(fixed_batch(1), optim=optim)
    assert (await b.publish()).version == 1
    loads = service.faults.calls["create_training_client_from_state_with_optimizer"]
    await b.switch(a)
    await b.switch(a)  # already that state: nothing to do
    assert service.faults.calls["create_training_client_from_state_with_optimizer"] == loads
    await b.train_step(fixed_batch(2), optim=optim)  # A's own run, weights and moments as it left them
    assert max_diff(service.platform.current_weights(), a_weights) > 0
    continued = service.platform.current_weights()

    straight = await started(tokenizer, service=FakeTinkerService())  # A alone, never switched
    for batch in (fixed_batch(), fixed_batch(2), fixed_batch(2)):
        await straight.train_step(batch, optim=optim)
    assert max_diff(continued, straight._training._platform.current_weights()) < 1e-6

    await b.switch("a-early")  # a state no client holds any more: loaded into a new one
    assert service.faults.calls["create_training_client_from_state_with_optimizer"] == loads + 1
    assert b.newest == b.version == 1
    assert early.endswith("a-early")


async def test_a_version_no_longer_open_is_opened_again_for_the_request_that_names_it(tokenizer, tmp_path) -> None:
    """Several users' versions serve at once: only the samplers used last stay open, and after a
    restart none but the restored one is. Any other is opened again from its training state (or
    its persisted sampler weights), and opening it leaves the trainable weights alone."""
    service = FakeTinkerService()
    index = tmp_path / "index.json"
    b = await started(tokenizer, service=service, state_index=index, persist_every=2)
    probe = SamplingParams(max_tokens=4, seed=5)
    completion = (17, 401, 2032)
    seen = {}
    for v in (1, 2, 3):
        await b.train_step(fixed_batch(v), optim=OptimSpec(learning_rate=1e-2))
        assert (await b.publish()).version == v
        seen[v] = (await b.sample(PROMPT, probe), await b.score(PROMPT, completion))

    restarted = make_backend(tokenizer, service=service, state_index=index, persist_every=2)
    await restarted.start()
    await restarted.restore(3, None)
    restarted._samplers.keep = 2  # v0's and one more: every other version is opened on request
    froms = service.faults.calls["create_training_client_from_state"]
    for v in (1, 2, 1):
        assert (await restarted.sample(PROMPT, probe, version=v), await restarted.score(PROMPT, completion, version=v)) \
            == seen[v]
    # v1 from its training state, twice (dropped in between); v2 from its persisted sampler weights
    assert service.faults.calls["create_training_client_from_state"] == froms + 2
    assert service.faults.calls["create_sampling_client"] == 3  # v0's at each start, then v2's
    assert restarted._samplers.versions() == [0, 1, 3]  # the newest stays open
    # the clients that opened v1 were runs of their own: the trainable one is v3's still, moments too
    await restarted.train_step(fixed_batch(4), optim=OptimSpec(learning_rate=1e-2))

    straight = await started(tokenizer, service=FakeTinkerService())
    for v in (1, 2, 3, 4):
        await straight.train_step(fixed_batch(v), optim=OptimSpec(learning_rate=1e-2))
    assert max_diff(service.platform.current_weights(), straight._training._platform.current_weights()) < 1e-6


async def test_behind_the_redaction_hook_switch_and_versioned_scores_reach_tinker(tokenizer) -> None:
    from clawbridge.backends.redact import protect
    from clawbridge.protocol import Lineages

    b = protect(await started(tokenizer), True)
    assert isinstance(b, Lineages)
    completion = (17, 401, 2032)
    base = await b.score(PROMPT, completion)
    await b.train_step(fixed_batch(), optim=OptimSpec(learning_rate=5e-2))
    await b.publish()
    await b.switch(None, 0)
    assert await b.score(PROMPT, completion, version=0) == pytest.approx(base, abs=1e-6)
    assert await b.score(PROMPT, completion, version=1) != pytest.approx(base, abs=1e-4)


async def test_a_lineage_saved_again_under_its_name_replaces_its_state(tokenizer) -> None:
    """The learner saves a lineage under one name each time it leaves it, from the client it keeps:
    the state is overwritten (a name reused without `overwrite` is refused by the service)."""
    service = FakeTinkerService()
    b = await started(tokenizer, service=service)
    first = await b.save_state("lineage-a")
    await b.train_step(fixed_batch(), optim=OptimSpec(learning_rate=1e-2))
    assert await b.save_state("lineage-a") == first
    trained = service.platform.current_weights()
    assert max_diff(service.platform.states[first][0], trained) == 0  # the state saved last
    with pytest.raises(tinker.ConflictError, match="already exists"):
        await b._training.save_state("lineage-a")
