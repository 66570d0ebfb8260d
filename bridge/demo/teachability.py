"""Before training: can hints teach this preference, and what does asking for it cost?

Everything hint-guided learning trains towards is the model's own answer *asked for the
preference*: the OPD teacher and the rewrites get the user's correction as a system instruction
(`judges.hints.teacher_messages`). So two measurements of the base model, asked, say before a
ten-minute run what it can show:

- **teachability**: how often the base model asked for the preference meets it and answers the
  question (truly satisfied) on the held-out prompts, next to plain v0. A preference it rarely
  meets even when asked has nothing to learn from: the rewrites have nothing right to imitate
  and OPD nothing to pull towards (docs/learning.md#before-training-teachability-and-the-price).
- **the price**: the general probe's rate of plain v0 − that of the **prompted twin** (the base
  model asked for the preferences), paired by question and seed. It is what the preference costs
  by itself; the gate judges a candidate against the twin, so paying it is not harm
  (docs/methods.md#harm-is-judged-against-what-you-asked-for).

The instruction is the preferences the collector applies from the scenario's corrections
(`learning.preferences`), the same function, so the demo's twin and the gate's cannot drift.
Verdicts and lines are pure; asking goes through an `Ask` the caller supplies (the demo's is the
served model over the HTTP API).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clawbridge.judges.hints import teacher_messages
from clawbridge.learning import preferences

if TYPE_CHECKING:
    from clawbridge.demo.scenario import Scenario, Verdict

LITTLE = 0.15  # truly satisfied when asked below this: too few right answers to learn from
ADDS_LITTLE = 0.10  # asking gains less than this over plain: the model already does what it does

# (prompt, messages, n) -> n answers as (text, finish reason); the prompt keys the sampling seed
Ask = Callable[[str, list[dict[str, str]], int], Awaitable[list[tuple[str, "str | None"]]]]


def instruction(sc: Scenario) -> str:
    """What the twin is asked with: the preferences the collector applies when it has heard each
    of the scenario's corrections twice (the rules judge's hint is the user's reply)."""
    heard = [(text, f"unsatisfied[{i}]#{k}") for k in range(preferences.HEARINGS)
             for i, text in enumerate(sc.replies.unsatisfied)]
    asked = preferences.wanted_instruction(preferences.merge([], heard, 0))
    assert asked is not None  # a scenario has at least one correction
    return asked


@dataclass(frozen=True)
class Teachability:
    """Truly satisfied on the held-out prompts: plain v0, and v0 asked for the preference."""

    plain: float
    asked: float
    asked_preferred: float  # asked: the preference met (answered or not)
    asked_answered: float  # asked: the question answered (preference or not)
    answers: int  # asked answers behind the rates
    per_prompt: tuple[float, ...] = ()  # asked, truly satisfied per held-out prompt
    seconds: float = 0.0

    @property
    def little(self) -> bool:
        return self.asked < LITTLE or self.asked - self.plain < ADDS_LITTLE

    def verdict(self) -> str:
        """One plain line for the user (pure)."""
        a, p = f"{self.asked:.0%}", f"{self.plain:.0%}"
        if self.asked < LITTLE:
            return (f"teachability: asked for it, the model meets it in {a} of answers ({p} unasked): "
                    "there is little to learn from; see docs/learning.md")
        if self.asked - self.plain < ADDS_LITTLE:
            return (f"teachability: the model meets it in {p} of answers unasked and {a} asked: asking adds "
                    "little, so hints have little to teach; see docs/learning.md")
        return (f"teachability: asked for it, the model meets it in {a} of answers against {p} unasked: "
                f"hints can teach it (what the model shows when asked is about how far it goes)")

    def record(self) -> dict[str, object]:
        return {"plain": round(self.plain, 4), "asked": round(self.asked, 4),
                "asked_preferred": round(self.asked_preferred, 4), "asked_answered": round(self.asked_answered, 4),
                "answers": self.answers, "little": self.little, "verdict": self.verdict()}


@dataclass(frozen=True)
class Price:
    """The general probe, plain v0 against the prompted twin (the same questions and seeds)."""

    plain: tuple[float, ...]  # per probe question
    asked: tuple[float, ...]
    instruction: str

    @property
    def probe_plain(self) -> float:
        return sum(self.plain) / len(self.plain)

    @property
    def probe_asked(self) -> float:
        return sum(self.asked) / len(self.asked)

    @property
    def points(self) -> float:
        """Probe points the preference costs (negative: asking for it answers more)."""
        return 100 * (self.probe_plain - self.probe_asked)

    def line(self, max_price: float | None = None) -> str:
        """One plain line for the user (pure); `max_price`: the gate's maximum, when the gate
        judges against the twin."""
        n, a, p = len(self.plain), f"{self.probe_asked:.0%}", f"{self.probe_plain:.0%}"
        if self.points < 0.5:
            text = (f"the price: your preference costs no general answers on this model: {p} → {a} of {n} "
                    "probe questions answered when the base model is asked for it")
        else:
            text = (f"the price: your preference costs {self.points:.0f} points of general answers on this model: "
                    f"{p} → {a} of {n} probe questions answered when the base model is asked for it")
        if max_price is not None and self.points > 100 * max_price:
            text += (f"; above gate_max_price ({100 * max_price:.0f} points), so the gate holds every candidate "
                     "back: raise it to accept this price")
        return text

    def record(self, interval: tuple[float, float] | None) -> dict[str, object]:
        return {"probe_plain": round(self.probe_plain, 4), "probe_asked": round(self.probe_asked, 4),
                "points": round(self.points, 2),
                "interval": None if interval is None else [round(100 * x, 2) for x in interval],
                "probes": len(self.plain), "asked": self.instruction}


def rate(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


async def asked_heldout(sc: Scenario, ask: Ask, asked: str, samples: int, plain: float) -> Teachability:
    """`samples` answers of the base model asked with `asked` to each held-out prompt, rated as the
    simulated user rates them; `plain`: v0's own truly-satisfied rate, for the verdict."""
    t0 = time.monotonic()

    async def one(prompt: str) -> list[Verdict]:
        answers = await ask(prompt, teacher_messages(sc.messages(prompt), asked), samples)
        return [sc.rate(prompt, text, finish) for text, finish in answers]

    rated = await asyncio.gather(*(one(p) for p in sc.heldout_prompts))
    flat = [v for vs in rated for v in vs]
    return Teachability(
        plain=plain, asked=rate([v.truly for v in flat]), asked_preferred=rate([v.preferred for v in flat]),
        asked_answered=rate([v.answered for v in flat]), answers=len(flat),
        per_prompt=tuple(rate([v.truly for v in vs]) for vs in rated), seconds=time.monotonic() - t0,
    )


__all__ = ["ADDS_LITTLE", "LITTLE", "Ask", "Price", "Teachability", "asked_heldout", "instruction"]
