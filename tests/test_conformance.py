"""The Backend protocol suite: every backend in `conformance_helpers.CASES` must pass it on the
tiny model. What it pins down is what the trainer relies on: sampled logprobs are exactly the
policy's (ratio 1 on-policy), a train step moves probabilities the way the advantage says, its
gradient is the reference PPO loss's, versions are isolated, checkpoints resume exactly."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from clawbridge.local_gpu import models, precision
from clawbridge.loss import ppo_loss, token_logprobs
from clawbridge.protocol import Backend
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams
from conformance_helpers import CASES, BackendCase

pytestmark = pytest.mark.conformance

PROMPT = (1, 520, 3121, 28, 1830, 446, 17, 905)
OTHER_PROMPT = (1, 4093, 314, 2201, 28, 690)


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> BackendCase:
    return CASES[request.param]


@pytest.fixture
async def backend(case: BackendCase, tmp_path: Path, request: pytest.FixtureRequest):
    if case.unsupported is not None and (reason := case.unsupported(request.node.name)):
        pytest.skip(reason)
    global _tol
    _tol = case.logprob_tol
    b = await case.make(tmp_path)
    yield b
    await b.close()
    _tol = 2e-4


_tol = 2e-4  # the case under test's `logprob_tol`, for score vs sampled logprobs


def close(a: list[float] | tuple[float, ...], b: list[float] | tuple[float, ...], tol: float | None = None) -> bool:
    """Equal within `tol`; by default within what the backend's dtype allows between a score and a
    sampling of the same tokens. An explicit tol is for the same computation repeated."""
    tol = _tol if tol is None else tol
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=1.0, seed=1),
        SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=2),
        SamplingParams(max_tokens=12, temperature=1.3, top_k=50, seed=3),
        SamplingParams(max_tokens=12, temperature=0.5, top_k=20, top_p=0.8, seed=4),
    ],
    ids=["t1", "t0.7-top_p", "t1.3-top_k", "t0.5-both"],
)
async def test_score_of_sampled_tokens_equals_their_sampled_logprobs(backend: Backend, params: SamplingParams) -> None:
    (completion,) = await backend.sample(PROMPT, params)
    assert len(completion.tokens) == len(completion.logprobs) > 0
    scored = await backend.score(PROMPT, completion.tokens, temperature=params.temperature)
    assert close(scored, completion.logprobs), (scored, completion.logprobs)


async def test_greedy_logprobs_are_under_temperature_one(backend: Backend) -> None:
    (completion,) = await backend.sample(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    assert close(await backend.score(PROMPT, completion.tokens, temperature=1.0), completion.logprobs)


async def _train_on(backend: Backend, advantage: float) -> tuple[float, float]:
    """One step on a fresh on-policy sample with a constant advantage; its total logprob before
    and after (under the newly published policy)."""
    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=10, seed=11))
    datum = Datum(PROMPT, c.tokens, c.logprobs, (advantage,) * len(c.tokens))
    await backend.train_step([datum], LossSpec(), OptimSpec(learning_rate=1e-3))
    await backend.publish()
    after = await backend.score(PROMPT, c.tokens)
    return sum(c.logprobs), sum(after)


async def test_positive_advantage_raises_and_negative_lowers_the_tokens_probability(backend: Backend) -> None:
    before, after = await _train_on(backend, +1.0)
    assert after > before + 0.01
    before, after = await _train_on(backend, -1.0)
    assert after < before - 0.01


def _fixed_batch() -> list[Datum]:
    """Two sequences of different lengths and temperatures; recorded logprobs that put some
    tokens outside the clip range on both sides, and advantages of both signs."""
    g = torch.Generator().manual_seed(5)
    out = []
    for prompt, n, temperature in ((PROMPT, 9, 1.0), (OTHER_PROMPT, 14, 0.8)):
        completion = tuple(int(x) for x in torch.randint(100, 40000, (n,), generator=g))
        old = tuple(float(-10.8 + 0.6 * x) for x in torch.randn(n, generator=g))
        adv = tuple(float(x) for x in torch.randn(n, generator=g))
        out.append(Datum(prompt, completion, old, adv, temperature))
    return out


def _reference_gradient(case: BackendCase, weights: dict[str, torch.Tensor], batch: list[Datum], spec: LossSpec) -> dict[str, torch.Tensor]:
    """The gradient of `ppo_loss` over the whole batch by a plain torch + PEFT loop."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    spec_model = models.resolve(models.TINY)
    base = models.load_model(spec_model, seed=case.model_seed)
    precision.prepare(base, precision.DTYPES[case.dtype], "cpu")  # the engine's own arithmetic
    config = LoraConfig(r=case.lora_rank, lora_alpha=case.lora_alpha, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(base, config)
    set_peft_model_state_dict(model, weights)
    new, old, adv = [], [], []
    for d in batch:
        ids = torch.tensor([d.prompt_ids + d.completion_ids])
        logits = model(input_ids=ids).logits[0, len(d.prompt_ids) - 1 : -1]
        new.append(token_logprobs(logits, torch.tensor(d.completion_ids), d.temperature))
        old.append(torch.tensor(d.logprobs))
        adv.append(torch.tensor(d.advantages))
    new_t = torch.cat(new)
    loss = ppo_loss(new_t, torch.cat(old), torch.cat(adv), torch.ones_like(new_t), spec)
    loss.backward()
    return {
        name.replace(".default", ""): p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


async def test_train_step_gradient_equals_the_reference_ppo_gradient(case: BackendCase, backend: Backend) -> None:
    if case.trainable_weights is None:
        pytest.skip(f"{case.name} does not expose its LoRA weights")
    batch = _fixed_batch()
    spec = LossSpec()
    # an ordinary first step makes lora_B non-zero, so every LoRA matrix has a gradient
    await backend.train_step(batch, spec, OptimSpec(learning_rate=1e-2))
    before = await case.trainable_weights(backend)
    # Adam with betas 0 forgets its history (m = g, v = g^2); with eps >> |g| and lr == eps the
    # update is -g to 1e-6 relative: the weights' change shows the gradient itself
    probe = OptimSpec(learning_rate=1e6, beta1=0.0, beta2=0.0, eps=1e6, weight_decay=0.0, grad_clip_norm=0.0)
    metrics = await backend.train_step(batch, spec, probe)
    after = await case.trainable_weights(backend)
    reference = _reference_gradient(case, before, batch, spec)
    assert set(reference) == set(before)
    scale = max(float(g.abs().max()) for g in reference.values())
    assert scale > 1e-6
    for name, grad in reference.items():
        torch.testing.assert_close(before[name] - after[name], grad, rtol=1e-3, atol=1e-4 * scale, msg=name)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in reference.values()))
    assert metrics.grad_norm == pytest.approx(norm, rel=1e-3)
    assert metrics.tokens == sum(len(d.completion_ids) for d in batch)
    assert metrics.samples == len(batch)


async def test_publish_during_an_inflight_sample_leaves_it_on_the_old_version(backend: Backend) -> None:
    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=6, seed=21))
    datum = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    await backend.train_step([datum], LossSpec(), OptimSpec(learning_rate=1e-2))
    v1 = await backend.publish()
    assert v1.version == backend.version == 1
    params = SamplingParams(max_tokens=48, seed=22, stop_token_ids=())
    stream = backend.sample_stream(PROMPT, params)
    chunks = [await anext(stream)]  # admitted on v1
    await backend.train_step([datum], LossSpec(), OptimSpec(learning_rate=1e-2))
    v2 = await backend.publish()
    assert v2.version == 2
    chunks += [chunk async for chunk in stream]
    assert {chunk.version for chunk in chunks} == {1}
    tokens = tuple(t for chunk in chunks for t in chunk.tokens)
    logprobs = tuple(x for chunk in chunks for x in chunk.logprobs)
    # the same seed on v1 by number reproduces it; the new policy gives other logprobs
    (again,) = await backend.sample(PROMPT, params, version=1)
    assert again.version == 1 and again.tokens == tokens and close(again.logprobs, logprobs)
    newest = await backend.score(PROMPT, tokens)
    assert max(abs(a - b) for a, b in zip(newest, logprobs, strict=True)) > 1e-3
    (fresh,) = await backend.sample(PROMPT, SamplingParams(max_tokens=4, seed=23))
    assert fresh.version == 2


async def test_a_held_version_serves_until_released_while_the_newest_is_sampled_by_number(backend: Backend) -> None:
    """The gate's routing: a published candidate is not served while `serve` holds the version
    before it; it is still sampled by number, and releasing the hold serves the newest."""
    from clawbridge.protocol import UnknownVersion

    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=6, seed=31))
    datum = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    backend.serve(0)
    await backend.train_step([datum], LossSpec(), OptimSpec(learning_rate=1e-2))
    assert (await backend.publish()).version == 1
    assert backend.version == 0 and backend.newest == 1
    params = SamplingParams(max_tokens=4, seed=32)
    (held,) = await backend.sample(PROMPT, params)
    (streamed,) = [chunk async for chunk in backend.sample_stream(PROMPT, params)][-1:]
    (candidate,) = await backend.sample(PROMPT, params, version=1)
    assert held.version == streamed.version == 0 and candidate.version == 1
    with pytest.raises(UnknownVersion):
        backend.serve(2)  # never published
    assert backend.version == 0
    backend.serve(None)
    assert backend.version == backend.newest == 1
    (fresh,) = await backend.sample(PROMPT, params)
    assert fresh.version == 1


async def test_save_then_load_resumes_training_identically(case: BackendCase, tmp_path: Path) -> None:
    first = await case.make(tmp_path)
    try:
        (c,) = await first.sample(PROMPT, SamplingParams(max_tokens=10, seed=31))
        step1 = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
        step2 = Datum(PROMPT, c.tokens, c.logprobs, tuple((-1.0) ** i for i in range(len(c.tokens))))
        optim = OptimSpec(learning_rate=1e-3)
        await first.train_step([step1], LossSpec(), optim)
        await first.publish()
        await first.save_state("resume-me")
        expected = await first.train_step([step2], LossSpec(), optim)
        expected_lp = await _score_after_publish(first, c.tokens)
    finally:
        await first.close()
    second = await case.make(tmp_path)  # a restart on the same data
    try:
        await second.load_state("resume-me")
        assert second.version == 1
        got = await second.train_step([step2], LossSpec(), optim)
        got_lp = await _score_after_publish(second, c.tokens)
    finally:
        await second.close()
    assert expected.grad_norm > 0
    for field in ("loss", "clip_fraction", "approx_kl", "grad_norm"):
        assert getattr(got, field) == pytest.approx(getattr(expected, field), rel=1e-5, abs=1e-7), field
    assert close(got_lp, expected_lp, tol=1e-5)


async def _score_after_publish(backend: Backend, tokens: tuple[int, ...]) -> list[float]:
    await backend.publish()
    return await backend.score(PROMPT, tokens)


async def test_concurrent_samples_on_two_versions_share_the_backend(backend: Backend) -> None:
    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=5, seed=41))
    datum = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    await backend.train_step([datum], LossSpec(), OptimSpec(learning_rate=1e-2))
    await backend.publish()
    params = SamplingParams(max_tokens=8, seed=42)
    old, new = await asyncio.gather(
        backend.sample(PROMPT, params, version=0), backend.sample(PROMPT, params, version=1)
    )
    assert old[0].version == 0 and new[0].version == 1
    assert close(await backend.score(PROMPT, old[0].tokens, model="base"), old[0].logprobs)
    assert close(await backend.score(PROMPT, new[0].tokens), new[0].logprobs)


async def test_rollback_publishes_an_earlier_versions_weights_as_a_new_version(backend: Backend) -> None:
    from clawbridge.loss import ppo_loss
    from clawbridge.protocol import UnknownVersion

    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=10, seed=51))
    push = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    optim = OptimSpec(learning_rate=1e-2)
    await backend.train_step([push], LossSpec(), optim)
    assert (await backend.publish()).version == 1
    v1_scores = await backend.score(PROMPT, c.tokens)
    probe = SamplingParams(max_tokens=8, seed=52)
    (v1_sample,) = await backend.sample(PROMPT, probe)
    await backend.train_step([push], LossSpec(), optim)
    assert (await backend.publish()).version == 2
    assert max(abs(a - b) for a, b in zip(await backend.score(PROMPT, c.tokens), v1_scores, strict=True)) > 1e-3

    stream = backend.sample_stream(PROMPT, SamplingParams(max_tokens=24, seed=53, stop_token_ids=()))
    chunks = [await anext(stream)]  # admitted on v2
    v3 = await backend.rollback(1)
    chunks += [chunk async for chunk in stream]
    assert {chunk.version for chunk in chunks} == {2}  # an in-flight request finishes on its version

    assert v3.version == backend.version == 3  # versions never go back
    assert close(await backend.score(PROMPT, c.tokens), v1_scores, tol=1e-5)
    (again,) = await backend.sample(PROMPT, probe)
    assert again.version == 3 and again.tokens == v1_sample.tokens
    assert close(again.logprobs, v1_sample.logprobs, tol=1e-5)

    # the next step starts from v1's weights: its loss is the PPO loss under v1's logprobs
    mixed = Datum(PROMPT, c.tokens, c.logprobs, tuple((-1.0) ** i for i in range(len(c.tokens))))
    metrics = await backend.train_step([mixed], LossSpec(), optim)
    expected = ppo_loss(torch.tensor(v1_scores, dtype=torch.float64), torch.tensor(c.logprobs, dtype=torch.float64),
                        torch.tensor(mixed.advantages, dtype=torch.float64), torch.ones(len(c.tokens), dtype=torch.float64),
                        LossSpec())
    assert metrics.loss == pytest.approx(float(expected), abs=_tol / 20)  # fp32: 1e-5
    assert (await backend.publish()).version == 4

    # v0 is the base model; a version never published changes nothing
    assert (await backend.rollback(0)).version == 5
    assert close(await backend.score(PROMPT, c.tokens), await backend.score(PROMPT, c.tokens, model="base"), tol=1e-5)
    for bad in (6, 42, -1):
        with pytest.raises(UnknownVersion):
            await backend.rollback(bad)
    assert backend.version == 5


# --- episodes and groups (issue 15): what the episode pipeline relies on, on every backend ------
TOOL_RESULT = (198, 27, 5023, 1180, 28, 2541, 198)  # a tool message's ids, spliced after turn 1


async def test_a_group_of_n_samples_trains_toward_its_better_episodes(backend: Backend) -> None:
    from clawbridge.learning.episodes import Step, group_advantages, step_rewards

    comps = await backend.sample(PROMPT, SamplingParams(max_tokens=8, seed=41), n=4)
    assert len(comps) == 4 and len({c.tokens for c in comps}) > 1
    for c in comps:  # every choice, not only the first, carries its own exact logprobs
        assert close(await backend.score(PROMPT, c.tokens), c.logprobs)
    outcomes = (1.0, 0.0, 1.0, 0.0)
    adv = group_advantages([step_rewards(o, [Step(len(c.tokens))]) for o, c in zip(outcomes, comps, strict=True)])
    assert adv is not None and [round(a[0], 4) for a in adv] == [1.0, -1.0, 1.0, -1.0]
    batch = [Datum(PROMPT, c.tokens, c.logprobs, (a[0],) * len(c.tokens)) for c, a in zip(comps, adv, strict=True)]
    metrics = await backend.train_step(batch, LossSpec(), OptimSpec(learning_rate=1e-3))
    assert metrics.tokens == sum(len(c.tokens) for c in comps) and metrics.samples == 4
    await backend.publish()
    moved = [sum(await backend.score(PROMPT, c.tokens)) - sum(c.logprobs) for c in comps]
    assert min(moved[0], moved[2]) > max(moved[1], moved[3]), moved


async def test_a_multi_turn_episode_trains_on_the_exact_sampled_tokens_of_every_turn(backend: Backend) -> None:
    from clawbridge.learning.episodes import Step, group_advantages, step_rewards

    (t1,) = await backend.sample(PROMPT, SamplingParams(max_tokens=6, seed=51, stop_token_ids=()))
    prompt2 = PROMPT + t1.tokens + TOOL_RESULT  # turn 2 sees turn 1's reply and a tool result
    (t2,) = await backend.sample(prompt2, SamplingParams(max_tokens=6, seed=52, stop_token_ids=()))
    # the behaviour logprobs of turn 2 are its own, with turn 1's tokens as (masked) prompt
    assert close(await backend.score(prompt2, t2.tokens), t2.logprobs)
    (o1,) = await backend.sample(OTHER_PROMPT, SamplingParams(max_tokens=6, seed=53, stop_token_ids=()))
    rewards = [step_rewards(1.0, [Step(len(t1.tokens)), Step(len(t2.tokens))]), step_rewards(0.0, [Step(len(o1.tokens))])]
    adv = group_advantages(rewards)
    assert adv is not None
    batch = [Datum(PROMPT, t1.tokens, t1.logprobs, (adv[0][0],) * len(t1.tokens)),
             Datum(prompt2, t2.tokens, t2.logprobs, (adv[0][1],) * len(t2.tokens)),
             Datum(OTHER_PROMPT, o1.tokens, o1.logprobs, (adv[1][0],) * len(o1.tokens))]
    metrics = await backend.train_step(batch, LossSpec(), OptimSpec(learning_rate=1e-3))
    # only the sampled tokens count: turn 1's tokens inside turn 2's prompt are not trained twice
    assert metrics.tokens == len(t1.tokens) + len(t2.tokens) + len(o1.tokens)
    await backend.publish()
    assert sum(await backend.score(PROMPT, t1.tokens)) > sum(t1.logprobs) + 0.01
    assert sum(await backend.score(prompt2, t2.tokens)) > sum(t2.logprobs) + 0.01


# --- several users' adapters (protocol.Lineages): one numbering, versions scored by number -------


async def test_an_older_version_scores_as_it_did_when_it_was_the_newest(backend: Backend) -> None:
    from clawbridge.protocol import BackendError

    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=10, seed=71))
    push = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    optim = OptimSpec(learning_rate=1e-2)
    v0_scores = await backend.score(PROMPT, c.tokens)
    await backend.train_step([push], LossSpec(), optim)
    assert (await backend.publish()).version == 1
    v1_scores = await backend.score(PROMPT, c.tokens)
    await backend.train_step([push], LossSpec(), optim)
    assert (await backend.publish()).version == 2
    v2_scores = await backend.score(PROMPT, c.tokens)
    assert max(abs(a - b) for a, b in zip(v2_scores, v1_scores, strict=True)) > 1e-3
    assert close(await backend.score(PROMPT, c.tokens, version=1), v1_scores, tol=1e-5)
    assert close(await backend.score(PROMPT, c.tokens, version=0), v0_scores, tol=1e-5)
    assert close(await backend.score(PROMPT, c.tokens, version=2), v2_scores, tol=1e-5)
    # "base" is the base whatever the version; None is the newest, even while an older one serves
    assert close(await backend.score(PROMPT, c.tokens, model="base", version=2), v0_scores, tol=1e-5)
    backend.serve(1)
    assert close(await backend.score(PROMPT, c.tokens), v2_scores, tol=1e-5)
    backend.serve(None)
    with pytest.raises(BackendError):
        await backend.score(PROMPT, c.tokens, version=3)  # never published


async def _lineage_a(backend: Backend) -> tuple[Datum, Datum, OptimSpec]:
    """Lineage A's first step and publish, on a sample of the base; its second step's datum."""
    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=10, seed=61))
    optim = OptimSpec(learning_rate=1e-2)
    first = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    await backend.train_step([first], LossSpec(), optim)
    assert (await backend.publish()).version == 1
    return first, Datum(PROMPT, c.tokens, c.logprobs, tuple((-1.0) ** i for i in range(len(c.tokens)))), optim


async def test_two_lineages_train_apart_over_one_numbering_of_versions(case: BackendCase, backend: Backend,
                                                                         tmp_path: Path) -> None:
    from clawbridge.protocol import Lineages

    assert isinstance(backend, Lineages)
    first, second, optim = await _lineage_a(backend)
    a_state = await backend.save_state("lineage-a")
    tokens = first.completion_ids
    va_scores = await backend.score(PROMPT, tokens, version=1)
    probe = SamplingParams(max_tokens=8, seed=62)
    (va_sample,) = await backend.sample(PROMPT, probe, version=1)

    # B, a fresh adapter: nothing published or served changes, and B's first step starts from the base
    await backend.switch(None, 0)
    assert backend.newest == backend.version == 1
    (o,) = await backend.sample(OTHER_PROMPT, SamplingParams(max_tokens=10, seed=63), version=0)
    pull = Datum(OTHER_PROMPT, o.tokens, o.logprobs, tuple(-1.0 - 0.1 * i for i in range(len(o.tokens))))
    base = torch.tensor(await backend.score(OTHER_PROMPT, o.tokens, model="base"), dtype=torch.float64)
    expected = ppo_loss(base, torch.tensor(o.logprobs, dtype=torch.float64),
                        torch.tensor(pull.advantages, dtype=torch.float64), torch.ones(len(o.tokens), dtype=torch.float64),
                        LossSpec())
    metrics = await backend.train_step([pull], LossSpec(), optim)
    assert metrics.loss == pytest.approx(float(expected), abs=_tol / 20)
    assert (await backend.publish()).version == 2  # one numbering: B's first version is v2
    assert backend.newest == backend.version == 2

    # A's version is A's still: scored and sampled by number, untouched by B's step
    assert close(await backend.score(PROMPT, tokens, version=1), va_scores, tol=1e-5)
    assert max(abs(a - b) for a, b in zip(await backend.score(PROMPT, tokens, version=2), va_scores, strict=True)) > 1e-3
    (again,) = await backend.sample(PROMPT, probe, version=1)
    assert again.version == 1 and again.tokens == va_sample.tokens
    assert close(again.logprobs, va_sample.logprobs, tol=1e-5)

    # back to A from its state: its next step is the step A would have taken without B between
    await backend.switch(a_state)
    assert backend.newest == backend.version == 2
    got = await backend.train_step([second], LossSpec(), optim)
    assert (await backend.publish()).version == 3
    got_lp = await backend.score(PROMPT, tokens, version=3)
    assert close(await backend.score(PROMPT, tokens, version=1), va_scores, tol=1e-5)

    reference = await case.make(tmp_path / "reference")  # one lineage, never switched
    try:
        ref_first, ref_second, _ = await _lineage_a(reference)
        assert ref_first == first
        want = await reference.train_step([ref_second], LossSpec(), optim)
        await reference.publish()
        want_lp = await reference.score(PROMPT, tokens)
    finally:
        await reference.close()
    assert want.grad_norm > 0
    for field in ("loss", "clip_fraction", "approx_kl", "grad_norm"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-5, abs=1e-7), field
    assert close(got_lp, want_lp, tol=1e-5)


async def test_a_lineage_switched_to_from_a_published_version_trains_on_from_its_weights(backend: Backend) -> None:
    """`switch(None, K)`: vK's weights with a fresh optimizer; the newest stays the newest."""
    first, second, optim = await _lineage_a(backend)
    tokens = first.completion_ids
    v1_scores = await backend.score(PROMPT, tokens)
    await backend.train_step([first], LossSpec(), optim)
    assert (await backend.publish()).version == 2
    await backend.switch(None, 0)  # another lineage, from the base
    await backend.switch(None, 1)  # and A's again, from v1's weights
    assert backend.newest == 2
    metrics = await backend.train_step([second], LossSpec(), optim)
    expected = ppo_loss(torch.tensor(v1_scores, dtype=torch.float64), torch.tensor(second.logprobs, dtype=torch.float64),
                        torch.tensor(second.advantages, dtype=torch.float64),
                        torch.ones(len(tokens), dtype=torch.float64), LossSpec())
    assert metrics.loss == pytest.approx(float(expected), abs=_tol / 20)
    assert (await backend.publish()).version == 3
