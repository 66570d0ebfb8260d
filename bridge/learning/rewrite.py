"""Hint-guided rewrites: the answer the hint asks for, trained as a demonstration (docs/methods.md).

On-policy distillation moves only the tokens the student sampled, so a behaviour the model never
shows (a sign-off it never writes, brevity it never chooses) gets no positive example, and a
batch of corrected answers is mostly "less of this": pushing sampled tokens down spreads their
probability over everything else, and a small model drifts into non-answers. A rewrite adds the
positive example:

    teacher = the same model with the hint in its prompt (judges.hints.teacher_messages)
    draw k answers from the teacher at the turn's own sampling settings
    keep the one the teacher itself is surest of (highest mean logprob per token)
    train it under the turn's OWN prompt (no hint) with advantage +w on every token

Its log pi_old is the policy's logprob of those tokens under the turn's prompt, scored when the
sample is judged, so the PPO ratio starts at 1 and the clip bounds how far one step moves it, as
for any sample. Everything here goes through `Backend.sample` and `Backend.score`, which every
backend has, so rewrites are identical on every platform.

Why the teacher's own confidence picks: the hinted teacher of a small model answers the hint
well in some draws and dodges it in others ("The answer is: 'too long.'"); the dodges are the
draws it is least sure of. Measured on the concise scenario's 20 held-out prompts x 4 draws with
the embedded model: all draws 29 % truly satisfied, the surest draw 50 % (docs/learning.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

from clawbridge.backends.base import Backend, ScoreModel
from clawbridge.chat.renderer import Renderer
from clawbridge.judges import teacher_messages
from clawbridge.store import Rewrite, StoredTurn
from clawbridge.types import Completion, SamplingParams


@dataclass(frozen=True)
class Draw:
    """One answer the teacher wrote, with its own sampling logprobs."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    @property
    def confidence(self) -> float:
        """The teacher's mean logprob per token (higher: surer)."""
        return fmean(self.logprobs) if self.logprobs else float("-inf")


def pick(draws: Sequence[Draw], own: Sequence[int] = ()) -> int | None:
    """The index of the draw to train (pure): the teacher's surest non-empty draw that differs
    from the turn's own answer (that one is already what the policy said). None if none is left."""
    own_ids = tuple(own)
    usable = [i for i, d in enumerate(draws) if d.ids and d.ids != own_ids]
    if not usable:
        return None
    return max(usable, key=lambda i: draws[i].confidence)


def teacher_version(teacher: ScoreModel) -> int | None:
    """Where the teacher samples: the frozen base is version 0, the live policy the newest."""
    return 0 if teacher == "base" else None


async def write_rewrite(
    backend: Backend,
    renderer: Renderer,
    turn: StoredTurn,
    hint: str,
    *,
    samples: int,
    weight: float,
    teacher: ScoreModel = "base",
) -> Rewrite | None:
    """Draw `samples` answers from the teacher for the turn's prompt with the hint, pick one, and
    score it under the turn's own prompt by the policy. None when no draw is usable."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    sp = turn.sampling
    params = SamplingParams(
        max_tokens=max(1, len(turn.completion_ids), sp.max_tokens), temperature=sp.temperature,
        top_p=sp.top_p, top_k=sp.top_k, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
    )
    prompt = renderer.render(teacher_messages(turn.messages, hint), turn.tools)
    completions: list[Completion] = await backend.sample(
        prompt, params, n=samples, version=teacher_version(teacher)
    )
    draws = [Draw(tuple(c.tokens), tuple(c.logprobs)) for c in completions]
    chosen = pick(draws, turn.completion_ids)
    if chosen is None:
        return None
    ids = draws[chosen].ids
    old = await backend.score(turn.prompt_ids, ids, model="policy", temperature=sp.temperature)
    if len(old) != len(ids):
        raise ValueError(f"backend scored {len(old)} of {len(ids)} rewrite tokens")
    return Rewrite(ids, tuple(old), (float(weight),) * len(ids))
