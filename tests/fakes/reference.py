"""The local semantics, for checking the cloud fakes' updates: a fixed batch, and one step of
token-mean `clawbridge.loss.ppo_loss` + AdamW + clipping on a platform with the same weights."""

from __future__ import annotations

import random

import torch
from clawbridge.loss import ppo_loss
from clawbridge.types import Datum, LossSpec, OptimSpec

from .torch_platform import TinyPlatform


def fixed_batch(seed: int = 0) -> list[Datum]:
    """Three samples whose recorded logprobs are off-policy enough to hit both clip branches."""
    rng = random.Random(seed)
    out = []
    for i, adv in enumerate((1.0, -1.0, 0.5)):
        prompt = tuple(rng.randrange(3, 4000) for _ in range(4 + i))
        completion = tuple(rng.randrange(3, 4000) for _ in range(3 + 2 * i))
        logprobs = tuple(-10.8 + rng.uniform(-0.6, 0.6) for _ in completion)
        advantages = tuple(adv * (1 + 0.5 * j) for j in range(len(completion)))
        out.append(Datum(prompt, completion, logprobs, advantages))
    return out


def reference_step(batch: list[Datum], spec: LossSpec, optim: OptimSpec) -> dict[str, torch.Tensor]:
    ref = TinyPlatform()
    new, old, adv = [], [], []
    for d in batch:
        full = [*d.prompt_ids, *d.completion_ids]
        new.append(ref.target_logprobs(full[:-1], full[1:])[len(d.prompt_ids) - 1 :])
        old += d.logprobs
        adv += d.advantages
    new_t = torch.cat(new)
    loss = ppo_loss(new_t, torch.tensor(old), torch.tensor(adv), torch.ones_like(new_t), spec)
    loss.backward()
    params = list(ref.params.values())
    torch.nn.utils.clip_grad_norm_(params, optim.grad_clip_norm if optim.grad_clip_norm > 0 else float("inf"))
    opt = torch.optim.AdamW(params, lr=optim.learning_rate, betas=(optim.beta1, optim.beta2),
                            eps=optim.eps, weight_decay=optim.weight_decay)
    opt.step()
    ref.close()
    return ref.current_weights()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)
