"""The loss every backend reproduces (docs/design.md#the-loss), as pure torch functions.

    rho_t  = exp(logpi_theta(a_t) - logpi_old(a_t))          logpi_old: recorded at sampling
    l_t    = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)
    loss   = sum_t l_t / (number of completion tokens in the whole batch)   prompt tokens masked
           + kl_coef * mean_t KL_k3(pi_theta || pi_base)                     (0 by default)
           + topk_coef * KL_topk(pi_theta || pi_teacher) per position of a Datum with a teacher
             prompt, same normalisation                                      (topk 0 by default)

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


def topk_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, k: int, temperature: float = 1.0) -> torch.Tensor:
    """KL(pi_student || pi_teacher) per position over the teacher's top-k tokens plus one bin for
    the rest of the vocabulary (the hybrid top-k form of on-policy distillation); logits [n, V]
    of the same positions, both at `temperature`. Reverse KL is mode-seeking: the student moves
    its mass onto what the teacher is sure of, and is not asked to spread it over the teacher's
    long tail. Gradients flow through `student` only."""
    t = temperature if temperature > 0 else 1.0
    s_log = torch.log_softmax(student.float() / t, dim=-1)
    t_log = torch.log_softmax(teacher.detach().float() / t, dim=-1)
    top = t_log.topk(min(k, t_log.shape[-1]), dim=-1).indices
    s_top, t_top = s_log.gather(-1, top), t_log.gather(-1, top)

    def rest(top_logs: torch.Tensor) -> torch.Tensor:  # log(1 - sum p) of the top-k, stable
        mass = torch.logsumexp(top_logs, dim=-1).clamp(max=-1e-6)
        return torch.log(-torch.expm1(mass))

    s_bins = torch.cat([s_top, rest(s_top).unsqueeze(-1)], dim=-1)
    t_bins = torch.cat([t_top, rest(t_top).unsqueeze(-1)], dim=-1)
    return (s_bins.exp() * (s_bins - t_bins)).sum(-1)


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
