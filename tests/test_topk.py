"""Top-k distillation (`opd_topk`): the loss term's math, and the embedded engine learning the
teacher's distribution from it on a real model (what a sample distils: test_distillation.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.loss import topk_reverse_kl
from clawbridge.types import Datum, LossSpec, OptimSpec
from helpers.learning import settings_for


def full_kl(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (torch.softmax(s, -1) * (torch.log_softmax(s, -1) - torch.log_softmax(t, -1))).sum(-1)


def test_over_the_whole_vocabulary_it_is_the_reverse_kl_and_zero_at_the_teacher():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(4, 30, generator=g), torch.randn(4, 30, generator=g)
    assert torch.allclose(topk_reverse_kl(s, t, 30), full_kl(s, t), atol=1e-5)
    assert torch.allclose(topk_reverse_kl(s, t, 30, temperature=0.5), full_kl(s / 0.5, t / 0.5), atol=1e-5)
    assert torch.allclose(topk_reverse_kl(t, t, 5), torch.zeros(4), atol=1e-6)


def test_the_rest_of_the_vocabulary_is_one_bin():
    """Two distributions that agree on the teacher's top-2 and on the total mass of the rest,
    but not on how the rest is spread, are equal to it; moving mass out of the top-2 is not."""
    t = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    spread = torch.log(torch.tensor([[0.5, 0.3, 0.19, 0.01]]))
    assert topk_reverse_kl(spread, t, 2).item() == pytest.approx(0.0, abs=1e-6)
    assert full_kl(spread, t).item() > 0.05
    worse = torch.log(torch.tensor([[0.3, 0.3, 0.2, 0.2]]))
    p, q = torch.tensor([0.3, 0.3, 0.4]), torch.tensor([0.5, 0.3, 0.2])
    assert topk_reverse_kl(worse, t, 2).item() == pytest.approx(float((p * (p / q).log()).sum()), abs=1e-5)


def test_gradients_reach_the_student_only():
    s, t = torch.randn(3, 10, requires_grad=True), torch.randn(3, 10, requires_grad=True)
    topk_reverse_kl(s, t, 4).sum().backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and t.grad is None


async def test_the_engine_moves_the_policy_to_the_teacher_it_is_given(data_dir: Path):
    """A real train_step on the tiny model: the teacher is the base model under another prompt;
    distilling it on a completion brings the policy's distribution at those positions towards
    the teacher's (the KL the step reports falls), and a Datum without a teacher prompt adds
    nothing to the term."""
    backend = LocalBackend.from_settings(settings_for(data_dir))
    await backend.start()
    try:
        prompt, teacher, completion = (1, 520, 3121, 28), (1, 77, 900, 41, 520, 3121, 28), (17, 401, 2032, 9, 88)
        lp = tuple(await backend.score(prompt, completion))
        d = Datum(prompt, completion, lp, (0.0,) * len(completion), temperature=1.0, teacher_prompt_ids=teacher)
        spec, optim = LossSpec(topk=8), OptimSpec(learning_rate=2e-2)
        kls = [(await backend.train_step([d], spec, optim)).extra["topk_kl"] for _ in range(6)]
        assert kls[0] > 0 and kls[-1] < 0.5 * kls[0]
        plain = Datum(prompt, completion, lp, (0.0,) * len(completion), temperature=1.0)
        assert (await backend.train_step([plain], spec, optim)).extra["topk_kl"] == 0.0
    finally:
        await backend.close()


async def test_a_policy_teacher_is_the_trained_adapter_as_the_step_found_it(data_dir: Path):
    """`topk_teacher` "policy": the teacher's logits come from the adapter being trained, not
    the base. Once steps have moved the adapter, the policy under its own prompt is its own
    teacher (KL 0), while the base under that prompt is not."""
    backend = LocalBackend.from_settings(settings_for(data_dir))
    await backend.start()
    try:
        prompt, other, completion = (1, 520, 3121, 28), (1, 77, 900, 41, 520, 3121, 28), (17, 401, 2032, 9, 88)
        lp = tuple(await backend.score(prompt, completion))
        zeros = (0.0,) * len(completion)
        moved = Datum(prompt, completion, lp, zeros, temperature=1.0, teacher_prompt_ids=other)
        for _ in range(4):  # the policy learns the base's distribution under another prompt
            await backend.train_step([moved], LossSpec(topk=8), OptimSpec(learning_rate=2e-2))
        own = Datum(prompt, completion, lp, zeros, temperature=1.0, teacher_prompt_ids=prompt)
        still = OptimSpec(learning_rate=1e-12)
        by_policy = (await backend.train_step([own], LossSpec(topk=8, topk_teacher="policy"), still)).extra["topk_kl"]
        by_base = (await backend.train_step([own], LossSpec(topk=8), still)).extra["topk_kl"]
        # the tiny random model's distributions are nearly uniform: its KLs are ~1e-6, so relative
        assert by_base > 0 and by_policy <= 1e-3 * by_base
    finally:
        await backend.close()
