"""Choosing the active judges from settings, and running the ones a method needs on a turn."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass

from clawbridge.backends import redact
from clawbridge.chat.renderer import Renderer
from clawbridge.config import JudgeSettings
from clawbridge.judges.clients import BackendJudgeClient, JudgeClient, OpenAIJudgeClient
from clawbridge.judges.hints import HintJudge, HintScorer
from clawbridge.judges.prm import PRMJudge
from clawbridge.judges.rules import RulesJudge
from clawbridge.judges.teacher import Teacher
from clawbridge.judges.types import HintJudgment, HintSource, Judgment, RewardJudge, TurnContext
from clawbridge.protocol import Backend, HostsJudge

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Judges:
    """The reward judge and the hint source in use; the pipeline does not care which."""

    reward: RewardJudge
    hint: HintSource

    async def run(
        self, turn: TurnContext, kinds: Collection[str],
    ) -> tuple[Judgment | None, HintJudgment | None]:
        """The judgments of the kinds asked for ("prm": a reward, "hint": a hint), concurrently;
        which kinds a method needs is the learner's to say (`learning.collector.judge_kinds`)."""
        async def reward() -> Judgment | None:
            return await self.reward.judge(turn) if "prm" in kinds else None

        async def hint() -> HintJudgment | None:
            return await self.hint.hint(turn) if "hint" in kinds else None

        judgment, hinted = await asyncio.gather(reward(), hint())
        return judgment, hinted

    async def aclose(self) -> None:
        """Close the judges' HTTP clients (shared ones once)."""
        clients = {id(c): c for c in (getattr(self.reward, "client", None), getattr(self.hint, "client", None)) if c}
        for client in clients.values():
            close = getattr(client, "aclose", None)
            if close is not None:
                await close()


def build_judges(
    settings: JudgeSettings,
    backend: Backend | None = None,
    *,
    seed: int,
    teacher: Teacher | None = None,
    scorer: HintScorer | None = None,
    renderer: Renderer | None = None,
) -> Judges:
    """The judges the settings ask for. `hint_selection="overlap"` scores candidates with
    `scorer`, or the teacher's agreement; without either it falls back to the longest hint.
    `renderer`: the server's own, for a judge that asks the backend itself (`judge="backend"`)."""
    kind = settings.kind
    if kind == "rules":
        rules = RulesJudge()
        return Judges(reward=rules, hint=rules)
    client: JudgeClient
    if kind == "http":
        if not settings.judge_url or not settings.judge_model:
            raise ValueError("judge 'http' needs --judge-url and --judge-model")
        key = settings.judge_api_key.get_secret_value() if settings.judge_api_key else None
        # an endpoint off the machine, like a cloud backend: redacted when the user asks for it
        client = OpenAIJudgeClient(settings.judge_url, settings.judge_model, key,
                                   redactor=redact.DEFAULT if settings.redact else None)
    else:
        if backend is None:
            raise ValueError("judge 'backend' needs the active backend")
        if isinstance(backend, HostsJudge):  # the GPU stack's PRM SGLang server
            url, model = backend.judge_endpoint
            client = OpenAIJudgeClient(url, model, None)
        elif renderer is not None:
            client = BackendJudgeClient(backend, renderer, version=0)
        else:
            raise ValueError("judge 'backend' needs the server's renderer")
    if scorer is None and teacher is not None:
        scorer = teacher.agreement
    selection = settings.hint_selection
    if selection == "overlap" and scorer is None:
        log.warning("hint selection 'overlap' needs the teacher; choosing the longest hint instead")
        selection = "longest"
    return Judges(
        reward=PRMJudge(client, votes=settings.prm_votes, seed=seed),
        hint=HintJudge(client, votes=settings.hint_votes, selection=selection, scorer=scorer, seed=seed),
    )
