"""The loss every backend reproduces (docs/design.md#the-loss), as pure torch functions.

    rho_t  = exp(logpi_theta(a_t) - logpi_old(a_t))          logpi_old: recorded at sampling
    l_t    = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)
    loss   = sum_t l_t / (number of completion tokens in the whole batch)   prompt tokens masked
           + kl_coef * mean_t KL_k3(pi_theta || pi_base)                     (0 by default)

Backends that micro-batch call `ppo_token_losses` per micro-batch and divide the sum by the
token count of the whole batch, so the gradient is the same as one big batch. Platforms whose
built-in loss sums over tokens (Tinker, Fireworks) get advantages scaled by `sum_loss_scale`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from clawbridge.types import Datum, LossSpec


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] for every position; logits [..., V], targets [...]."""
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class TokenLosses:
    """Per-token terms of the loss, zero where the mask is zero."""

    loss: torch.Tensor  # l_t (+ kl term), summed by the caller
    clipped: torch.Tensor  # 1 where the clipped branch was taken
    approx_kl: torch.Tensor  # k3 estimate of KL(pi_old || pi_theta) per token


def ppo_token_losses(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
    base_logprobs: torch.Tensor | None = None,
) -> TokenLosses:
    mask = mask.to(new_logprobs.dtype)
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if spec.kl_coef:
        if base_logprobs is None:
            raise ValueError("kl_coef > 0 needs the base model's logprobs")
        d = base_logprobs - new_logprobs
        per_token = per_token + spec.kl_coef * (torch.exp(d) - d - 1.0)
    took_clip = (clipped < unclipped).to(new_logprobs.dtype)
    approx_kl = (ratio - 1.0) - log_ratio
    return TokenLosses(per_token * mask, took_clip * mask, approx_kl.detach() * mask)


def ppo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec = LossSpec(),
    base_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token-mean loss of one whole batch."""
    terms = ppo_token_losses(new_logprobs, old_logprobs, advantages, mask, spec, base_logprobs)
    return terms.loss.sum() / mask.sum().clamp(min=1)


def objective(ratio: float, advantage: float, spec: LossSpec = LossSpec()) -> float:
    """The per-token PPO objective min(rho*A, clip(rho)*A) for scalars (the negative loss)."""
    clipped = min(max(ratio, 1.0 - spec.clip_low), 1.0 + spec.clip_high)
    return min(ratio * advantage, clipped * advantage)


def batch_tokens(batch: Sequence[Datum]) -> int:
    return sum(len(d.completion_ids) for d in batch)


def sum_loss_scale(batch: Sequence[Datum]) -> float:
    """Factor for advantages sent to a platform whose loss SUMS over tokens, so its gradient
    equals the token-mean gradient of `ppo_loss` (the clip does not depend on A's scale)."""
    return 1.0 / max(batch_tokens(batch), 1)


def micro_batches(batch: Sequence[Datum], token_budget: int) -> list[list[Datum]]:
    """Consecutive groups of the batch whose padded size (rows x longest sequence) stays within
    `token_budget`, so memory is bounded; a longer single datum forms its own group. The loss
    is still normalised by the token count of the whole batch (see `ppo_token_losses`)."""
    groups: list[list[Datum]] = []
    current: list[Datum] = []
    longest = 0
    for d in batch:
        n = len(d.prompt_ids) + len(d.completion_ids)
        if current and (len(current) + 1) * max(longest, n) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(d)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups
