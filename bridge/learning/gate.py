"""The gate before every publish (docs/methods.md#keeping-the-model-good-the-anchor-and-the-gate):
asking versions the probes, scoring and remembering their answers; its rules and decision are
`gate_rules`, its statistics `stats`.

    train_step ─► publish candidate v(K+1) while the proxy keeps serving vK (the pin)
              ─► sample both on the probes ─► paired comparison per probe group (gate_rules)
              ─► accepted: serve v(K+1)
              ─► rejected: backend.rollback(K) (a copy of vK's weights, fresh optimizer) serves,
                 the candidate is recorded "rejected by the gate" with its figures

Probes are prompts with a scorer of an answer in [0, 1]: the general probe set (does the version
still answer everyday questions), and whatever the caller adds (the demo: the scenario's
truly-satisfied check on a validation split; an agent's recent prompts with a judge model).

**Harm is judged against what the user asked for** (`reference="twin"`, the default). The user's
preferences can cost answers by themselves: the base model asked for them (its **prompted twin**:
the user's preferences as the system instruction they are served with, `chat.instructions`) may
answer fewer general questions than plain v0. That difference is the **price** of the
preferences, shown wherever versions are, and held to gate_max_price (`GateRules`).

Probes come in two tiers. The first is always asked; it can only hold a candidate back, and only
at the stricter significance an early look needs (`stats.early`). In every other case
(`needs_more_probes`) the reserve (the rest of the general probe set) is asked too and the
decision is taken on both tiers. Every version (and the twin) answers a probe with that probe's
own seed (`question_seed`: the question's checksum offset by the settings' seed), so their
answers are coupled (the engines draw by inverse CDF from the seed's uniform numbers) and the
paired differences are mostly the versions', not the dice's; and different probes draw
independently, so the probe is not one correlated draw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clawbridge.chat.instructions import instructed
from clawbridge.learning.gate_rules import (
    GENERAL,
    Against,
    Comparison,
    Decision,
    GateRules,
    Reference,
    decide,
    needs_more_probes,
)
from clawbridge.learning.stats import paired_worse, price
from clawbridge.types import SamplingParams

if TYPE_CHECKING:
    from clawbridge.chat.renderer import Renderer
    from clawbridge.judges.pairwise import PairwiseJudge
    from clawbridge.judges.types import Message
    from clawbridge.protocol import Backend

log = logging.getLogger(__name__)

Recent = tuple[Sequence[int], Sequence["Message"]]  # a user's prompt: its rendered ids and its messages

Scorer = Callable[[str, "str | None"], float]  # (answer text, finish reason) -> score in [0, 1]
# who answers: a version, plain (None) or asked with the preferences' instruction (the twin)
Answerer = tuple[int, "str | None"]


@dataclass(frozen=True)
class GateProbe:
    group: str  # GENERAL ("probe", the general set), "validation", ...
    messages: tuple[dict[str, Any], ...]
    score: Scorer
    # answers per version for this probe (None: the gate's `samples`, or `reference_samples` for
    # v0 and the twin): a small group (a demo's validation split) gains power from more answers
    samples: int | None = None
    # the group measures the user's preference itself (a demo's validation split): against the
    # serving version its mean decides (rule `within`), so a candidate that keeps the preference
    # less well than what serves, by more than the margin, is held back even when the fall is not
    # significant, and the best validated version serves while a lineage fades
    measures_preference: bool = False


@dataclass(frozen=True)
class Asked:
    """What the user has asked for, and what each version is asked with: `wanted`, every applied
    or learned preference (the twin is asked with it); `served`, the instruction served now with
    the serving version (the applied preferences); `candidate`, the instruction the candidate
    would be served with (`served` less what its weights carry alone, `baking.Review`), so
    each answers the probes as the user would get it."""

    wanted: str | None = None
    served: str | None = None
    candidate: str | None = None


@dataclass(frozen=True)
class GateDecision:
    candidate: int
    serving: int
    decision: Decision
    reason: str
    figures: dict[str, float] = field(default_factory=dict)
    reference: Reference = "v0"  # what the general probe was judged against
    instruction: str | None = None  # the preferences the twin was asked with

    def record(self) -> dict[str, Any]:
        return {"version": self.candidate, "serving": self.serving, "decision": self.decision,
                "reason": self.reason, "figures": {k: round(v, 4) for k, v in self.figures.items()},
                "reference": self.reference, "asked": self.instruction}


class Gate:
    """Scores versions on the probes; remembers each version's scores (a version's weights never
    change, so the serving version, v0 and the twin are sampled once). v0 and the twin, asked
    once for every candidate, answer each probe `reference_samples` times. Its rules
    (`self.rules`) are built once from the settings and the probe groups."""

    def __init__(
        self,
        backend: Backend,
        renderer: Renderer,
        probes: Sequence[GateProbe],
        *,
        params: SamplingParams,
        samples: int = 1,
        reference_samples: int = 1,
        margin: float = 0.05,
        alpha: float = 0.1,
        alpha_base: float | None = None,
        reference: Reference = "twin",
        max_price: float = 0.15,
        non_inferiority: bool = True,
        pairwise: PairwiseJudge | None = None,
        reserve: Sequence[GateProbe] = (),
    ) -> None:
        if not probes and pairwise is None:
            raise ValueError("the gate needs probes or a pairwise judge")
        self.pairwise = pairwise
        self.backend = backend
        self.renderer = renderer
        self.tiers = [list(probes), list(reserve)] if reserve else [list(probes)]
        self.params = params
        self.samples = samples
        self.reference_samples = reference_samples
        self._told: set[tuple[int, str]] = set()  # prices the log has shown
        self.reference = reference
        groups: dict[str, bool] = {}
        for p in (p for tier in self.tiers for p in tier):
            groups[p.group] = groups.get(p.group, False) or p.measures_preference
        self.rules = GateRules.build(
            groups, reference=reference, margin=margin, alpha=alpha,
            alpha_base=alpha if alpha_base is None else alpha_base, max_price=max_price,
            non_inferiority=non_inferiority, recent=pairwise is not None)
        self._scores: dict[Answerer, list[list[float]]] = {}  # answerer -> scores of each tier asked
        self._asking: dict[Answerer, asyncio.Lock] = {}  # one asker per answerer: a second waits and reuses
        self.answers: dict[Answerer, list[str]] = {}  # the first answer per probe asked (for reading)

    @property
    def probes(self) -> list[GateProbe]:
        """The first tier: asked of every candidate."""
        return self.tiers[0]

    async def scores(self, version: int, tiers: int = 1, instruction: str | None = None,
                     samples: int | None = None) -> list[float]:
        """One score per probe of the first `tiers` tiers, in [0, 1]: the mean score over
        `samples` answers; `instruction`: asked with it (the twin). A tier is asked once."""
        answerer: Answerer = (version, instruction)
        async with self._asking.setdefault(answerer, asyncio.Lock()):  # the references, warmed meanwhile
            have = self._scores.setdefault(answerer, [])
            self.answers.setdefault(answerer, [])
            while len(have) < tiers:
                rated = await asyncio.gather(*(self._score(p, answerer, samples or self.samples)
                                               for p in self.tiers[len(have)]))
                have.append([s for s, _ in rated])
                self.answers[answerer].extend(a for _, a in rated)
            return [x for tier in have[:tiers] for x in tier]

    async def _score(self, probe: GateProbe, answerer: Answerer, samples: int) -> tuple[float, str]:
        version, instruction = answerer
        messages = instructed(probe.messages, instruction)  # the twin: the instruction as served
        prompt = self.renderer.render(messages)
        params = dataclasses.replace(self.params, seed=question_seed(self.params.seed, message_key(probe.messages)))
        comps = await self.backend.sample(prompt, params, n=probe.samples or samples, version=version,
                                          priority="background")
        texts = [(self.renderer.parse(c.tokens, c.finish_reason).content or "", c.finish_reason) for c in comps]
        return sum(probe.score(t, f) for t, f in texts) / len(texts), texts[0][0]

    async def general_scores(self, version: int, instruction: str | None = None,
                             samples: int | None = None) -> list[float]:
        """`version`'s score on each general probe question of every tier (asked with
        `instruction`: the twin), as the gate measures it (the same seeds, and cached: what the
        gate has asked is not asked again). What the demo shows as "the general probe"."""
        scores = await self.scores(version, len(self.tiers), instruction, samples)
        return [x for x, p in zip(scores, (p for t in self.tiers for p in t), strict=True) if p.group == GENERAL]

    def alias(self, version: int, same_as: int) -> None:
        """`version` holds `same_as`'s weights (a restored copy): reuse its scores."""
        for (v, instruction) in [k for k in self._scores if k[0] == same_as]:
            self._scores[(version, instruction)] = self._scores[(v, instruction)]
            self.answers[(version, instruction)] = self.answers[(v, instruction)]

    def forget(self, version: int) -> None:
        for key in [k for k in self._scores if k[0] == version]:
            self._scores.pop(key, None)
            self.answers.pop(key, None)
            self._asking.pop(key, None)

    async def _answer(self, prompt_ids: Sequence[int], version: int) -> str:
        key = ",".join(map(str, prompt_ids))
        params = dataclasses.replace(self.params, seed=question_seed(self.params.seed, key))
        [c] = await self.backend.sample(prompt_ids, params, n=1, version=version, priority="background")
        return self.renderer.parse(c.tokens, c.finish_reason).content or ""

    async def _compare(self, prompt: Recent, candidate: int, serving: int) -> float:
        """How often the judge prefers the candidate's answer to the serving version's."""
        assert self.pairwise is not None
        ids, messages = prompt
        a, b = await asyncio.gather(self._answer(ids, candidate), self._answer(ids, serving))
        return await self.pairwise.prefer(messages, a, b)

    async def general_rates(self, instruction: str | None, base: int = 0,
                            tiers: int | None = None) -> tuple[float, float]:
        """The general probe's rate of plain v0 and of the twin asked with `instruction`, on the
        first `tiers` tiers (all: None): the price of the preferences is their difference."""
        n = len(self.tiers) if tiers is None else tiers
        idx = [i for i, p in enumerate(p for t in self.tiers[:n] for p in t) if p.group == GENERAL]
        if not idx:
            return 0.0, 0.0
        plain = await self.scores(base, n, None, self.reference_samples)
        twin = plain if instruction is None else await self.scores(base, n, instruction, self.reference_samples)
        return sum(plain[i] for i in idx) / len(idx), sum(twin[i] for i in idx) / len(idx)

    async def evaluate(
        self, candidate: int, serving: int, base: int = 0, recent: Sequence[Recent] = (),
        asked: Asked = Asked(),
    ) -> GateDecision:
        """`recent`: the user's own recent prompts, replayed on both versions and compared by the
        pairwise judge (when there is one). `asked`: what the user asked for (`Asked`: the twin
        is asked with `wanted`, None: the twin is plain v0; the candidate and the serving version
        answers with `served`, the candidate with `candidate`)."""
        t0 = time.monotonic()
        twin = self.reference == "twin"
        instruction = asked.wanted if twin else None
        if twin and instruction is not None:
            plain, prompted = await self.general_rates(instruction, base)
            self._tell_price(base, instruction, plain, prompted)
            held = self.rules.price_held_back(plain, prompted)
            if held is not None:
                priced = {"probe_v0": plain, "probe_twin": prompted, "price_points": 100 * (plain - prompted),
                          "seconds": time.monotonic() - t0}
                return GateDecision(candidate, serving, "rejected", held, priced, "twin", instruction)
        comparisons: dict[str, Comparison] = {}
        figures: dict[str, float] = {}
        if self.pairwise is not None and recent and self.rules.recent is not None:
            wins = list(await asyncio.gather(*(self._compare(p, candidate, serving) for p in recent)))
            # paired per prompt: the candidate's share of the preference against the serving one's
            row = self.rules.recent
            fig = paired_worse(wins, [1.0 - w for w in wins], row.margin)
            comparisons[row.name] = Comparison(row, fig)
            figures.update(recent_candidate=fig.candidate, recent_n=float(len(wins)),
                           recent_p_vs_serving=fig.p_worse)
        total = sum(len(t) for t in self.tiers)
        tiers = 1
        found = await self._measure(candidate, serving, base, tiers, instruction, asked)
        while tiers < len(self.tiers) and needs_more_probes(
                {**comparisons, **found[0]}, sum(len(t) for t in self.tiers[:tiers]) / total):
            tiers += 1
            found = await self._measure(candidate, serving, base, tiers, instruction, asked)
        comparisons.update(found[0])
        figures.update(found[1])
        figures["probes_asked"] = float(sum(len(t) for t in self.tiers[:tiers]))
        decision, reason = decide(comparisons)
        figures["seconds"] = time.monotonic() - t0
        return GateDecision(candidate, serving, decision, reason, figures, self.reference, instruction)

    def _tell_price(self, base: int, instruction: str, plain: float, prompted: float) -> None:
        """The price, said once per set of preferences, whoever measured it first."""
        if (base, instruction) in self._told:
            return
        self._told.add((base, instruction))
        log.warning("your preferences %s cost %.0f points of general answers on this model: %.0f %% -> "
                    "%.0f %% of the probe answered when the base model is asked for them "
                    "(gate_max_price %.0f points)", _quoted(instruction), 100 * (plain - prompted),
                    100 * plain, 100 * prompted, 100 * (self.rules.max_price or 0.0))

    async def _measure(
        self, candidate: int, serving: int, base: int, tiers: int, instruction: str | None, asked: Asked,
    ) -> tuple[dict[str, Comparison], dict[str, float]]:
        """Each probe group's figures on the first `tiers` tiers against every reference its rows
        name (`self.rules`), and the comparisons whose rule decides. The serving version answers
        with the instruction served now, the candidate with the one it would be served with."""
        comparisons: dict[str, Comparison] = {}
        figures: dict[str, float] = {}
        probes = [p for tier in self.tiers[:tiers] for p in tier]
        cand = await self.scores(candidate, tiers, asked.candidate)
        v0 = await self.scores(base, tiers, None, self.reference_samples)
        served = asked.served
        refs: dict[Against, list[float]] = {
            "serving": v0 if base == serving and served is None else await self.scores(serving, tiers, served),
            "v0": v0}
        if self.reference == "twin":
            refs["twin"] = v0 if instruction is None else await self.scores(base, tiers, instruction,
                                                                            self.reference_samples)
        for g in sorted({p.group for p in probes}):
            idx = [i for i, p in enumerate(probes) if p.group == g]
            c = [cand[i] for i in idx]
            figures[f"{g}_candidate"] = sum(c) / len(c)
            for row in self.rules.of(g):
                fig = paired_worse(c, [refs[row.against][i] for i in idx], row.margin)
                figures[f"{g}_{row.against}"] = fig.reference
                figures[f"{g}_p_vs_{row.against}"] = fig.p_worse
                if row.rule == "proof":
                    figures[f"{g}_p_inferior_vs_{row.against}"] = fig.p_inferior
                if row.rule is not None:
                    comparisons[row.name] = Comparison(row, fig)
            if g == GENERAL and "twin" in refs:
                figures["price_points"] = 100 * price([v0[i] for i in idx], [refs["twin"][i] for i in idx])
        return comparisons, figures


def _quoted(instruction: str) -> str:
    return ", ".join(f"'{line}'" for line in instruction.splitlines())


def question_seed(seed: int | None, key: str) -> int | None:
    """The seed a question is asked with: its text's checksum offset by `seed` (None: unseeded).
    The same for every version asked it (paired answers), different across questions
    (independent ones). With `seed` 0 it is the demo's evaluation seed of that question."""
    return None if seed is None else (seed + zlib.crc32(key.encode())) % 2**32


def message_key(messages: Sequence[Any]) -> str:
    """What identifies a probe's question: the last message's text (the question itself, for a
    one-message probe), or the whole conversation where that is not plain text."""
    last = messages[-1].get("content") if messages else None
    if len(messages) == 1 and isinstance(last, str):
        return last
    return json.dumps(list(messages), sort_keys=True, default=str)


def probe_scorer(answered: Callable[[str], bool]) -> Scorer:
    """A general-probe scorer: 1 when the answer answers the question (a cut-off answer counts:
    the probe asks whether the model still answers, not how long it talks)."""
    return lambda text, _finish: 1.0 if answered(text) else 0.0


__all__ = ["Answerer", "Gate", "GateDecision", "GateProbe", "Recent", "Scorer", "message_key",
           "probe_scorer", "question_seed"]
