"""Hint-guided rewrites: the answer the hint asks for, trained as a demonstration.

On-policy distillation moves only the tokens the student sampled, so a behaviour the model never
shows gets no positive example; a rewrite is that example. The teacher (the same model with the
hint) draws k answers at the turn's own sampling settings; a draw must answer the question
(`rewrite_min_relevance`: its pointwise mutual information with the question, in nats) and be
what the hint asked for (`rewrite_min_lift`: nats a token the hint lifted it, both sides scored by
the teacher's model); a finished draw is kept before one cut at max_tokens, and among those the
one the hint lifted most (`rewrite_pick`). The kept draw is scored by the policy under the turn's
own prompt (its PPO old logprobs, so the ratio starts at 1) and trained there with advantage +w
on every token. Only `Backend.sample` and `Backend.score` are used, so rewrites are identical on
every backend. Why each rule: docs/methods.md#hint-guided-rewrites-rewrites-w_rewrite and the
sections after it.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import fmean
from typing import Literal

from clawbridge.chat.messages import AssistantMessage
from clawbridge.chat.renderer import Renderer
from clawbridge.judges import teacher_view
from clawbridge.judges.prompts import INTERNAL_CONTEXT_MARKER, message_text
from clawbridge.judges.types import Message
from clawbridge.learning.probes import is_echo
from clawbridge.protocol import Backend, ScoreModel
from clawbridge.store import Rewrite, StoredTurn
from clawbridge.types import Completion, SamplingParams


@dataclass(frozen=True)
class Draw:
    """One answer the teacher wrote, with its own sampling logprobs."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # the teacher's (with the hint), as sampled
    plain: tuple[float, ...] = ()  # the teacher's model under the turn's own prompt (no hint)
    alone: tuple[float, ...] = ()  # the teacher's with the hint but the question blanked
    echo: bool = False  # the draw says nothing the question did not
    finished: bool = True  # the draw ended by itself (not cut at max_tokens)

    @property
    def confidence(self) -> float:
        """The teacher's mean logprob per token (higher: surer)."""
        return fmean(self.logprobs) if self.logprobs else float("-inf")

    @property
    def lift(self) -> float:
        """How much more likely the hint made this draw, per token: mean(with − without the hint),
        one model."""
        if not self.ids or len(self.plain) != len(self.logprobs):
            return float("-inf")
        return fmean(t - s for t, s in zip(self.logprobs, self.plain, strict=True))

    @property
    def relevance(self) -> float:
        """How much the question explains this draw, in nats over the whole draw: sum(teacher −
        teacher without the question). +inf when not scored (no floor applies)."""
        if not self.alone:
            return float("inf")
        if len(self.alone) != len(self.logprobs):
            return float("-inf")
        return sum(t - a for t, a in zip(self.logprobs, self.alone, strict=True))


Pick = Literal["lift", "surest"]


def usable(draws: Sequence[Draw], own: Sequence[int] = (), min_relevance: float = float("-inf"),
           min_lift: float = float("-inf")) -> list[int]:
    """The draws a rewrite may train: non-empty, not the turn's own answer (that one is already
    what the policy said), not an echo of the question, explained by the question by at least
    `min_relevance` nats, and lifted by the hint by at least `min_lift` nats per token (a draw
    not yet scored without the hint has no lift, and passes only when there is no floor)."""
    own_ids = tuple(own)
    return [i for i, d in enumerate(draws)
            if d.ids and d.ids != own_ids and not d.echo and d.relevance >= min_relevance
            and (min_lift == float("-inf") or d.lift >= min_lift)]


def pick(draws: Sequence[Draw], own: Sequence[int] = (), rule: Pick = "lift",
         min_relevance: float = float("-inf"), min_lift: float = float("-inf")) -> int | None:
    """The index of the draw to train (pure), among the usable ones: a finished draw before a
    cut one, then the highest lift, or the teacher's surest with `surest`. None if none is usable."""
    ok = usable(draws, own, min_relevance, min_lift)
    if not ok:
        return None
    if rule == "surest":
        return max(ok, key=lambda i: (draws[i].finished, draws[i].confidence))
    return max(ok, key=lambda i: (draws[i].finished, draws[i].lift, draws[i].confidence))


def redraw_params(turn: StoredTurn, max_tokens: int = 0) -> SamplingParams:
    """The turn's own sampling settings, unseeded, for new answers to its prompt (a rewrite's
    teacher draws, the trainer's fresh draws); room for at least the turn's own answer, or
    `max_tokens` where that is set and less (`redraw_max_tokens`)."""
    sp = turn.sampling
    room = max(1, len(turn.completion_ids), sp.max_tokens)
    return SamplingParams(
        max_tokens=min(room, max_tokens) if max_tokens > 0 else room, temperature=sp.temperature,
        top_p=sp.top_p, top_k=sp.top_k, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
    )


def teacher_version(teacher: ScoreModel) -> int | None:
    """Where the teacher samples: the frozen base is version 0, the live policy the newest."""
    return 0 if teacher == "base" else None


def question_of(messages: Sequence[Message]) -> tuple[int, str] | None:
    """The index and text of the last user message (the question an answer answers), skipping
    an agent's injected context as the judges do; None when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") == "user" and INTERNAL_CONTEXT_MARKER not in (text := message_text(m)):
            return i, text
    return None


def echoes(question: str, answer: AssistantMessage) -> bool:
    """A text answer that says nothing the question did not (a tool call never echoes)."""
    return not answer.tool_calls and bool(answer.content) and is_echo(question, answer.content or "")


def without_question(messages: Sequence[Message], at: int) -> list[dict[str, object]]:
    """A copy of the conversation with message `at`'s content blanked (pure)."""
    out = [copy.deepcopy(dict(m)) for m in messages]
    out[at]["content"] = ""
    return out


async def scored(
    backend: Backend, draws: Sequence[Draw], which: Sequence[int], prompt_ids: Sequence[int],
    into: Literal["plain", "alone"], *, model: ScoreModel, temperature: float,
) -> list[Draw]:
    """A copy of `draws` with draws `which` scored under `prompt_ids` by `model`, the scores put
    in their `plain` (the teacher's model without the hint) or `alone` (the teacher without the
    question) field; one concurrent `score` call per draw."""
    out = list(draws)
    got = await asyncio.gather(
        *(backend.score(prompt_ids, draws[i].ids, model=model, temperature=temperature) for i in which)
    )
    for i, lp in zip(which, got, strict=True):
        if len(lp) != len(draws[i].ids):
            raise ValueError(f"backend scored {len(lp)} of {len(draws[i].ids)} rewrite tokens")
        out[i] = replace(draws[i], plain=tuple(lp)) if into == "plain" else replace(draws[i], alone=tuple(lp))
    return out


async def write_rewrite(
    backend: Backend,
    renderer: Renderer,
    turn: StoredTurn,
    hint: str,
    *,
    samples: int,
    weight: float,
    teacher: ScoreModel = "base",
    rule: Pick = "lift",
    min_relevance: float = float("-inf"),
    min_lift: float = float("-inf"),
    max_tokens: int = 0,
) -> Rewrite | None:
    """Draw `samples` answers from the teacher for the turn's prompt with the hint; drop the
    turn's own answer, echoes of the question and draws the question explains by less than
    `min_relevance` nats (scored by the teacher with the question blanked); score the rest
    under the turn's own prompt by the teacher's model for the lift, and drop those the hint
    lifted by less than `min_lift` nats per token; pick one and score it by the policy for its
    PPO old logprobs. The draws cut at max_tokens are scored only when no finished one passes
    (`pick` would not choose them). None when none is usable."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    params = redraw_params(turn, max_tokens)
    # the teacher is asked with the instruction the turn was served with too; `turn` is the
    # student's view (`baking.student_view`): its prompt_ids are the prompt without it
    prompt = renderer.render(teacher_view(turn.messages, hint, turn.instruction), turn.tools)
    completions: list[Completion] = await backend.sample(
        prompt, params, n=samples, version=teacher_version(teacher), priority="background"
    )
    question = question_of(turn.messages)
    draws = [Draw(tuple(c.tokens), tuple(c.logprobs), finished=c.finish_reason != "length",
                  echo=question is not None and echoes(question[1], renderer.parse(c.tokens, c.finish_reason)))
             for c in completions]

    # the question blanked, for the relevance floor (None: no floor, or no question to blank)
    blank = (renderer.render(teacher_view(without_question(turn.messages, question[0]), hint, turn.instruction), turn.tools)
             if question is not None and min_relevance > float("-inf") else None)
    lifted = rule == "lift" or min_lift > float("-inf")  # the surest needs no scores beyond the teacher's own

    async def kept(which: list[int]) -> list[int]:
        """`which`'s draws that pass both floors (`usable`), scored as far as the floors need."""
        nonlocal draws
        if blank is not None and which:
            draws = await scored(backend, draws, which, blank, "alone", model=teacher, temperature=params.temperature)
            passed = set(usable(draws, turn.completion_ids, min_relevance))
            which = [i for i in which if i in passed]
        if lifted and which:
            draws = await scored(backend, draws, which, turn.prompt_ids, "plain", model=teacher, temperature=params.temperature)
            passed = set(usable(draws, turn.completion_ids, min_relevance, min_lift))
            which = [i for i in which if i in passed]
        return which

    # `pick` takes a finished draw over any cut one, so the cut draws are scored only when no
    # finished one is kept: the same pick, for the scores of the draws it can choose from (a cut
    # draw is the longest, max_tokens)
    ok = usable(draws, turn.completion_ids)
    ok = await kept([i for i in ok if draws[i].finished]) or await kept([i for i in ok if not draws[i].finished])
    chosen = pick([draws[i] for i in ok], (), rule) if ok else None
    if chosen is None:
        return None
    d = draws[ok[chosen]]
    old = await backend.score(turn.prompt_ids, d.ids, model="policy", temperature=params.temperature)
    if len(old) != len(d.ids):
        raise ValueError(f"backend scored {len(old)} of {len(d.ids)} rewrite tokens")
    return Rewrite(d.ids, tuple(old), (float(weight),) * len(d.ids))
