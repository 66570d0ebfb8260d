"""The FSDP2 LoRA trainer under torchrun: two CPU ranks on gloo with the tiny model. The
distributed update equals the single-process one and the CPU engine's, the adapter it gathers
is a PEFT folder, and resumable state round-trips."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from clawbridge.local_gpu.fsdp import FSDPTrainer, TrainerError
from clawbridge.types import Datum, LossSpec, OptimSpec
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

RANK, ALPHA, SEED = 8, 16, 0
# uneven lengths and temperatures, more datums than ranks, one rank gets two micro-batches' worth
BATCH_1 = [
    Datum((1, 2, 3, 4), (5, 6, 7), (-1.0, -2.0, -3.0), (1.0, -1.0, 0.5)),
    Datum(
        (1, 2), (9, 10, 11, 12), (-11.0, -10.5, -11.2, -10.9), (0.5, 0.5, 0.5, 0.5), temperature=0.7
    ),
    Datum((3, 4, 5), (6,), (-10.8,), (1.0,)),
]
BATCH_2 = [
    Datum((7, 8, 9), (10, 11), (-10.8, -10.9), (-1.0, -1.0)),
    Datum((2, 3), (4, 5, 6, 7, 8), (-10.0, -11.0, -10.5, -10.7, -10.8), (1.0, 1.0, -0.5, 0.2, 0.3)),
]
OPTIM = OptimSpec(learning_rate=1e-2, grad_clip_norm=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainers(tmp_path_factory) -> AsyncIterator[tuple[FSDPTrainer, FSDPTrainer]]:
    logs = tmp_path_factory.mktemp("fsdp-logs")
    one, two = (
        FSDPTrainer(
            "tiny-random",
            nproc=n,
            lora_rank=RANK,
            lora_alpha=ALPHA,
            seed=SEED,
            threads=1,
            log_file=logs / f"world{n}.log",
            start_timeout_s=240,
        )
        for n in (1, 2)
    )
    try:
        await asyncio.gather(one.start(), two.start())
        yield one, two
    finally:
        await asyncio.gather(one.close(), two.close())


async def adapter(t: FSDPTrainer, path: Path) -> dict[str, torch.Tensor]:
    await t.save_adapter(path)
    return load_file(str(path / "adapter_model.safetensors"))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=atol, msg=k)


async def test_two_ranks_make_the_same_update_as_one_and_as_the_cpu_engine(trainers, tmp_path):
    from clawbridge.local_gpu import models
    from clawbridge.local_gpu.engine import Engine

    one, two = trainers
    assert (await two.info())["world_size"] == 2
    engine = Engine(
        models.resolve(models.TINY),
        data_dir=tmp_path / "engine",
        lora_rank=RANK,
        lora_alpha=ALPHA,
        seed=SEED,
        threads=1,
    )
    engine.start()
    try:
        for batch in (BATCH_1, BATCH_2):  # step 1 moves only B (B starts at 0); step 2 moves A too
            me, m1, m2 = await asyncio.gather(
                engine.train_step(batch, LossSpec(), OPTIM),
                one.train_step(batch, LossSpec(), OPTIM),
                two.train_step(batch, LossSpec(), OPTIM),
            )
            assert m2.tokens == m1.tokens == me.tokens == sum(len(d.completion_ids) for d in batch)
            for m in (m1, me):
                assert m2.loss == pytest.approx(m.loss, rel=1e-5, abs=1e-7)
                assert m2.clip_fraction == pytest.approx(m.clip_fraction)
                assert m2.grad_norm == pytest.approx(m.grad_norm, rel=1e-4)
        a1, a2 = await asyncio.gather(
            adapter(one, tmp_path / "one"), adapter(two, tmp_path / "two")
        )
        # one rank is the engine to the bit; two ranks sum gradients in another order, and
        # Adam's normalisation lifts that fp32 rounding to ~1e-5 after two steps at lr 1e-2
        assert_same(await engine.trainable_state(), a1, atol=1e-7)
        assert_same(a1, a2, atol=3e-5)
        assert any(float(v.abs().max()) > 0 for k, v in a2.items() if "lora_B" in k)  # it moved
    finally:
        engine.close()


async def test_the_gathered_adapter_is_a_peft_folder_that_peft_loads(trainers, tmp_path):
    from clawbridge.local_gpu import models
    from peft import PeftModel

    _, two = trainers
    state = await adapter(two, tmp_path / "a")
    assert all(".default." not in k for k in state)  # PEFT's saved key layout
    base = models.load_model(models.resolve(models.TINY), seed=SEED)
    model = PeftModel.from_pretrained(base, str(tmp_path / "a"))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    for k, v in state.items():
        torch.testing.assert_close(loaded[k.replace(".weight", ".default.weight")], v)


async def test_save_state_then_load_state_resumes_identically(trainers, tmp_path):
    _, two = trainers
    await two.train_step(BATCH_1, LossSpec(), OPTIM)
    await two.save_state(tmp_path / "ckpt")
    await two.train_step(BATCH_2, LossSpec(), OPTIM)
    after = await adapter(two, tmp_path / "after")
    await two.load_state(tmp_path / "ckpt")
    await two.train_step(BATCH_2, LossSpec(), OPTIM)
    assert_same(after, await adapter(two, tmp_path / "again"), atol=1e-7)


async def test_a_failure_on_the_ranks_is_reported_and_the_trainer_stays_up(trainers):
    _, two = trainers
    with pytest.raises(TrainerError, match=r"(?s)rank 0: .*rank 1: .*no trainer checkpoint"):
        await two.call("load_state", path="/nonexistent/checkpoint")
    m = await two.train_step(BATCH_2, LossSpec(kl_coef=0.1), OPTIM)  # and the KL path runs
    assert m.samples == 2


async def test_load_adapter_restores_a_saved_adapter_and_the_initial_one(trainers, tmp_path):
    _, two = trainers
    await two.train_step(BATCH_1, LossSpec(), OPTIM)
    kept = await adapter(two, tmp_path / "kept")
    await two.train_step(BATCH_2, LossSpec(), OPTIM)
    assert any(
        float((v - kept[k]).abs().max()) > 0
        for k, v in (await adapter(two, tmp_path / "moved")).items()
    )
    await two.load_adapter(tmp_path / "kept")
    assert_same(await adapter(two, tmp_path / "restored"), kept, atol=0)
    # version 0: the initial adapter, B = 0 (the base model's function)
    await two.load_adapter(None)
    initial = await adapter(two, tmp_path / "initial")
    assert all(float(v.abs().max()) == 0 for k, v in initial.items() if "lora_B" in k)
    assert any(float(v.abs().max()) > 0 for k, v in initial.items() if "lora_A" in k)


def mixed_batch() -> list[Datum]:
    """Samples of 200, 150, 90, 60, 40 and 30 tokens: each rank packs several into a row and
    stacks rows of unequal length (padded by a segment of their own) into one forward."""
    g = torch.Generator().manual_seed(11)
    out = []
    for n, temperature in ((200, 1.0), (150, 0.7), (90, 1.0), (60, 1.3), (40, 1.0), (30, 0.9)):
        p = n // 3
        ids = [int(x) for x in torch.randint(100, 4000, (n,), generator=g)]
        old = tuple(float(-8.3 + 0.6 * x) for x in torch.randn(n - p, generator=g))
        adv = tuple(float(x) for x in torch.randn(n - p, generator=g))
        out.append(Datum(tuple(ids[:p]), tuple(ids[p:]), old, adv, temperature))
    return out


def unpacked_loss_and_gradient(weights: dict[str, torch.Tensor], batch: list[Datum]):
    """ppo_loss and its gradient by a plain PEFT loop: each sample forwarded alone, unpadded."""
    from clawbridge.local_gpu import models
    from clawbridge.loss import ppo_loss, token_logprobs
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    base = models.load_model(models.resolve(models.TINY), seed=SEED)
    model = get_peft_model(
        base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0)
    )
    set_peft_model_state_dict(model, weights)
    new = []
    for d in batch:
        logits = model(input_ids=torch.tensor([d.prompt_ids + d.completion_ids])).logits[
            0, len(d.prompt_ids) - 1 : -1
        ]
        new.append(token_logprobs(logits, torch.tensor(d.completion_ids), d.temperature))
    new_t = torch.cat(new)
    old = torch.tensor([x for d in batch for x in d.logprobs])
    adv = torch.tensor([x for d in batch for x in d.advantages])
    loss = ppo_loss(new_t, old, adv, torch.ones_like(new_t), LossSpec())
    loss.backward()
    grads = {
        n.replace(".default", ""): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return float(loss.detach()), grads


async def test_packed_rows_give_the_loss_and_gradient_of_unpacked_samples(trainers, tmp_path):
    """The trainer packs samples into rows and stacks the rows; the loss and the gradient are
    those of every sample forwarded alone (observed through Adam with betas 0 and lr = eps =
    1e6, where the update is -g), on one rank and on two."""
    from clawbridge.local_gpu.packing import stacked_micro_batches

    batch = mixed_batch()
    rows = stacked_micro_batches(batch, 8192)
    # it does pack: three rows of two samples, stacked in one forward
    assert len(rows) == 1 and len(rows[0]) == 3 and all(len(r) == 2 for r in rows[0])
    probe = OptimSpec(
        learning_rate=1e6, beta1=0.0, beta2=0.0, eps=1e6, weight_decay=0.0, grad_clip_norm=0.0
    )
    for t in trainers:
        await t.load_adapter(None)
        # lora_B moves off 0: every matrix has a gradient
        await t.train_step(batch, LossSpec(), OPTIM)
        before = await adapter(t, tmp_path / f"before{t.nproc}")
        metrics = await t.train_step(batch, LossSpec(), probe)
        after = await adapter(t, tmp_path / f"after{t.nproc}")
        loss, grads = unpacked_loss_and_gradient(before, batch)
        assert metrics.loss == pytest.approx(loss, rel=1e-5)
        assert set(grads) == set(before)
        scale = max(float(g.abs().max()) for g in grads.values())
        for name, grad in grads.items():
            torch.testing.assert_close(
                before[name] - after[name], grad, rtol=1e-3, atol=1e-4 * scale, msg=name
            )
