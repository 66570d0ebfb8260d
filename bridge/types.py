"""The records that cross module boundaries: frozen, plain, typed.

These are the contracts between the proxy, the store, the judges, the sample builder, the trainer
and every backend. Token sequences are tuples so a record can never be mutated after capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "tool_calls"]
Method = Literal["binary", "opd", "combine"]
TurnType = Literal["main", "side"]
SampleState = Literal["pending", "judged", "trained", "dropped"]


@dataclass(frozen=True)
class SamplingParams:
    """How to draw one completion. Recorded with the turn so training can reproduce the
    distribution the tokens were drawn from (the temperature in particular)."""

    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # alternatives per token to return (OpenAI `top_logprobs`)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Completion:
    """One sampled completion, exactly as sampled.

    `logprobs[i]` is the log-probability of `tokens[i]` under the distribution it was drawn from
    (temperature applied, before top-p/top-k truncation), so that the PPO ratio on-policy is 1.
    When a stop string ends generation, `tokens` includes the token that completed it; the
    renderer strips the stop text from the visible content.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: Literal["stop", "length"]
    version: int
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = None

    def as_chunk(self) -> TokenChunk:
        """The whole completion as one stream chunk (platforms that answer whole completions)."""
        return TokenChunk(self.tokens, self.logprobs, self.version, self.finish_reason, self.top_logprobs)


@dataclass(frozen=True)
class TokenChunk:
    """A piece of a streamed completion. The last chunk has `finish_reason` set."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    finish_reason: Literal["stop", "length"] | None = None
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = None


@dataclass(frozen=True)
class Datum:
    """One token-level training sample: a prompt, the completion the behaviour policy sampled,
    its recorded logprobs (log pi_old) and one advantage per completion token."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    advantages: tuple[float, ...]
    temperature: float = 1.0
    # the teacher's prompt for top-k distillation (LossSpec.topk): the base model's next-token
    # distribution under it + the completion is distilled at every completion position
    teacher_prompt_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if n == 0:
            raise ValueError("a Datum needs at least one completion token")
        if len(self.logprobs) != n or len(self.advantages) != n:
            raise ValueError(
                f"completion has {n} tokens but {len(self.logprobs)} logprobs and "
                f"{len(self.advantages)} advantages"
            )


@dataclass(frozen=True)
class LossSpec:
    """The PPO-clipped token-level loss of docs/design.md#the-loss; every backend reproduces it exactly."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0  # KL to the base model (adapter disabled); 0 by default
    # top-k distillation: + topk_coef * KL(pi_theta || teacher) over the teacher's top-k tokens
    # and one bin for the rest, at every completion position of a Datum with a teacher prompt
    topk: int = 0
    topk_coef: float = 1.0
    # whose distribution: the frozen base under the teacher prompt, or the policy being trained
    # (its weights at the start of the step, no gradient) under it: a target that moves with it
    topk_teacher: Literal["base", "policy"] = "base"


@dataclass(frozen=True)
class OptimSpec:
    """Adam(W) hyper-parameters for one optimizer step (Tinker's AdamParams shape)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # 0 disables clipping


@dataclass(frozen=True)
class StepMetrics:
    loss: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    tokens: int
    samples: int
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyVersion:
    """A servable version of the policy. Version 0 is the base model (no adapter)."""

    version: int
    path: str | None = None  # where its weights live (adapter dir, tinker:// path, ...)

    @property
    def name(self) -> str:
        return f"policy@v{self.version}"
