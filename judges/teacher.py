"""The OPD teacher: the turn's prompt with the hint appended, scored on the student's own
completion tokens (docs/methods.md). The one teacher scorer: the collector and the episodes'
hint OPD take `logprobs` for their advantages; `agreement` is a hint scorer for
`HintJudge(selection="overlap")`. The composition root builds one and hands it to each.

The Backend protocol scores only the given tokens (no top-k), so agreement stands in for
OpenClaw-RL's top-k overlap with what the protocol can measure: minus the mean clipped gap
|teacher - student| over the sampled tokens. Both prefer the hint whose teacher stays closest to
the student's own distribution, which keeps the OPD update small and on-policy.
"""

from __future__ import annotations

from collections import OrderedDict

from clawbridge.chat.renderer import Renderer
from clawbridge.judges.hints import teacher_view
from clawbridge.judges.types import TurnContext
from clawbridge.protocol import Backend, ScoreModel


class Teacher:
    def __init__(
        self,
        backend: Backend,
        renderer: Renderer,
        *,
        model: ScoreModel = "base",
        clip: float = 1.0,
        cache_size: int = 64,
    ) -> None:
        self.backend = backend
        self.renderer = renderer
        self.model = model
        self.clip = clip
        self._cache: OrderedDict[tuple[object, ...], list[float]] = OrderedDict()
        self._cache_size = cache_size

    def prompt_ids(self, turn: TurnContext, hint: str | None) -> list[int]:
        """The teacher's prompt: the turn's, with the instruction it was served with and the hint
        (`teacher_view`)."""
        return self.renderer.render(teacher_view(turn.messages, hint, turn.instruction), turn.tools)

    async def logprobs(self, turn: TurnContext, hint: str | None, *, backend: Backend | None = None) -> list[float]:
        """log p_teacher(completion_ids[i] | prompt + instruction + hint, completion_ids[:i]).
        Cached for the last few (prompt, hint, completion) so scoring candidates and training
        share one call. `backend`: the turn's user's lineage, whose policy a "policy" teacher is."""
        if not turn.completion_ids:
            raise ValueError("the teacher needs the turn's completion ids")
        prompt = self.prompt_ids(turn, hint)
        # the live policy's scores change with its version; the frozen base's never do
        backend = backend or self.backend  # a user's own lineage, for the live policy (`learning.lineages`)
        version = backend.version if self.model == "policy" else 0
        key = (tuple(prompt), turn.completion_ids, self.model, version, turn.temperature)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        lp = await backend.score(
            prompt, turn.completion_ids, model=self.model, temperature=turn.temperature
        )
        if len(lp) != len(turn.completion_ids):
            raise ValueError(f"backend scored {len(lp)} of {len(turn.completion_ids)} tokens")
        self._cache[key] = lp
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return lp

    async def agreement(self, turn: TurnContext, hint: str) -> float:
        """Minus the mean clipped |teacher - student| gap: 0 is full agreement."""
        if len(turn.logprobs) != len(turn.completion_ids):
            raise ValueError("agreement needs the turn's sampled logprobs")
        teacher = await self.logprobs(turn, hint)
        gaps = [min(abs(t - s), self.clip) for t, s in zip(teacher, turn.logprobs, strict=True)]
        return -sum(gaps) / len(gaps)
