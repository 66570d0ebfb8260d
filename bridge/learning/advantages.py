"""The RL math: from a judged turn to one advantage per completion token (docs/design.md#methods).

Pure functions over plain numbers. Nothing here does I/O or knows where logprobs came from:
`student_lp` is always log pi_old, the behaviour logprob the proxy recorded while sampling, and
`teacher_lp` is the teacher's logprob of the same tokens with the hint in its prompt.

    binary   A_t = r                                          sample when r != 0
    opd      A_t = clip(teacher_t - old_t, -c, +c)            sample when a hint was accepted
    combine  A_t = w_opd * clip(teacher_t - old_t, +-c) + w_rl * r
                                                              sample when a hint was accepted
                                                              or r != 0
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from clawbridge.types import Method

Advantages = tuple[float, ...]


def binary_advantages(reward: float, n_tokens: int) -> Advantages:
    """The turn's reward on every completion token."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    return (float(reward),) * n_tokens


def opd_advantages(
    teacher_lp: Sequence[float], student_lp: Sequence[float], clip: float | None = 1.0
) -> Advantages:
    """Per-token log-ratio teacher/student, clipped to +-clip (None: unclipped).

    The clip keeps one token the hinted teacher finds far likelier (a gap of 5 or 10 nats is
    common for a token the hint names) from dominating the whole turn's gradient."""
    _same_length(teacher_lp, student_lp)
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be positive or None, got {clip}")
    gaps = (t - s for t, s in zip(teacher_lp, student_lp, strict=True))
    if clip is None:
        return tuple(gaps)
    return tuple(min(max(g, -clip), clip) for g in gaps)


def combine_advantages(
    teacher_lp: Sequence[float] | None,
    student_lp: Sequence[float],
    reward: float,
    w_opd: float = 1.0,
    w_rl: float = 1.0,
    clip: float | None = 1.0,
) -> Advantages:
    """w_opd * opd + w_rl * r per token; with no teacher (no hint accepted) only the reward
    term remains."""
    rl = w_rl * float(reward)
    if teacher_lp is None:
        return (rl,) * len(student_lp)
    return tuple(w_opd * a + rl for a in opd_advantages(teacher_lp, student_lp, clip))


def sample_advantages(
    method: Method,
    reward: float,
    hint_accepted: bool,
    teacher_lp: Sequence[float] | None,
    student_lp: Sequence[float],
    *,
    w_opd: float = 1.0,
    w_rl: float = 1.0,
    clip: float | None = 1.0,
) -> Advantages | None:
    """Whether a judged turn becomes a training sample, and its token advantages (None: no
    sample). `reward` is the PRM reward (plus any length shaping); `teacher_lp` is needed
    exactly when a hint was accepted and the method uses OPD.

    A sample whose advantages are all zero is not a sample: it adds no gradient and only dilutes
    the token mean of its batch (the fault of OpenClaw-RL's "at least one sample" rule)."""
    if method not in ("binary", "opd", "combine"):
        raise ValueError(f"unknown method {method!r}: use binary, opd or combine")
    uses_hint = hint_accepted and method != "binary"
    if uses_hint and teacher_lp is None:
        raise ValueError(f"method {method!r} with an accepted hint needs the teacher's logprobs")
    teacher = teacher_lp if uses_hint else None
    advantages: Advantages | None = None
    if method == "binary" and reward != 0:
        advantages = binary_advantages(reward, len(student_lp))
    elif method == "opd" and teacher is not None:
        advantages = opd_advantages(teacher, student_lp, clip)
    elif method == "combine" and (teacher is not None or reward != 0):
        advantages = combine_advantages(teacher, student_lp, reward, w_opd, w_rl, clip)
    if not advantages or all(a == 0.0 for a in advantages):
        return None
    return advantages


def scale_negatives(advantages: Sequence[float], w_negative: float) -> Advantages:
    """A_t <- w_negative * A_t where A_t < 0 (positive advantages unchanged).

    Pushing a sampled token down spreads its probability over every other token; on a small
    model a batch that is mostly "less of this" drifts into non-answers. With w_negative 0 a
    sample only ever raises what was approved, what the teacher prefers, and the hint-guided
    rewrite: [0.5, -1.0, 2.0] at 0.25 -> [0.5, -0.25, 2.0]."""
    if w_negative < 0:
        raise ValueError(f"w_negative must be >= 0, got {w_negative}")
    return tuple(a * w_negative if a < 0 else a for a in advantages)


def anchored(
    advantages: Sequence[float], student_lp: Sequence[float], base_lp: Sequence[float], coef: float
) -> Advantages:
    """The anchor to the base model, carried in the advantages (docs/methods.md):

        A_t <- A_t - coef * (log pi_old(a_t) - log pi_base(a_t))

    log pi_old − log pi_base is the per-token sample of KL(pi_old || pi_base) along the sampled
    answer, so this is the KL-regularised RL objective's reward shaping (the "KL in the reward"
    of RLHF), applied token by token. A token the trained policy made likelier than the base did
    is pushed back in proportion to how far it moved; one the base preferred is pulled up. It
    needs only `score(model="base")`, which every backend has, and rides in the advantages every
    backend already carries, so it is identical everywhere (the loss-side KL term of the spec
    needs the base model's logprobs inside the platform's loss, which Tinker and Fireworks'
    built-in losses cannot take)."""
    _same_length(base_lp, student_lp)
    if len(advantages) != len(student_lp):
        raise ValueError("one advantage per completion token")
    if coef == 0:
        return tuple(advantages)
    return tuple(a - coef * (s - b) for a, s, b in zip(advantages, student_lp, base_lp, strict=True))


def group_normalise(rewards: Sequence[float], eps: float = 1e-6) -> tuple[float, ...]:
    """GRPO: (r - mean) / (std + eps) over samples that share a prompt.

    The std is the POPULATION std (divide by n, not n - 1), as in GRPO implementations:
    [1, -1, 1, 0] -> mean 0.25, std 0.829 -> [0.90, -1.51, 0.90, -0.30]. A group whose rewards
    are all equal gives zeros (nothing to prefer), not a division by zero."""
    n = len(rewards)
    if n == 0:
        return ()
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return tuple((r - mean) / (std + eps) for r in rewards)


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    """DAPO soft overlong punishment: 0 up to max_len - cache_len, then a linear ramp down to
    -1 at max_len, and -1 beyond. Added to r when overlong shaping is on."""
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got {cache_len} and {max_len}")
    start = max_len - cache_len
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / cache_len
    return -1.0


def integrated_reward(outcome: float, votes: Sequence[int], lam: float = 1.0) -> float:
    """RLAnything's integrated reward: outcome + lam/m * sum(votes) over the m valid step
    votes (none: the outcome alone)."""
    if not votes:
        return float(outcome)
    return float(outcome) + lam * sum(votes) / len(votes)


def _same_length(teacher_lp: Sequence[float], student_lp: Sequence[float]) -> None:
    if len(teacher_lp) != len(student_lp):
        raise ValueError(
            f"teacher has {len(teacher_lp)} logprobs but the completion has {len(student_lp)}: "
            "score the teacher on exactly the sampled completion tokens"
        )
