"""The gate before every publish (docs/methods.md#keeping-the-model-good-the-anchor-and-the-gate).

    train_step ─► publish candidate v(K+1) while the proxy keeps serving vK (the pin)
              ─► sample both on the probes ─► paired comparison per probe group
              ─► accepted: serve v(K+1)
              ─► rejected: backend.rollback(K) (a copy of vK's weights, fresh optimizer) serves,
                 the candidate is recorded "rejected by the gate" with its figures

Probes are prompts with a check that scores an answer in [0, 1]: the general probe set (does the
version still answer everyday questions), and whatever the caller adds (the demo: the scenario's
truly-satisfied check on a validation split; an agent's recent prompts with a judge model).

The decision is pure (`decide`): each comparison of a probe group with a reference carries its
rule (`Comparison`). Against the serving version, a candidate is held back when the mean
difference is below −margin AND a one-sided paired t-test says it is worse (p < alpha): evidence
of harm (`harm`). A group that measures the preference itself (`GateProbe.kept`: the demo's
validation split) is judged by its mean against the serving version instead (`within`): a
candidate that keeps the preference worse than what serves, by more than the margin, is held
back without the evidence eight prompts cannot give. Against v0 in the strict mode (`reference="v0"`), the burden of proof is the
candidate's: it serves only when shown to lose less than the margin (non-inferiority, p <
alpha_base; `proof`).

**Harm is judged against what the user asked for** (`reference="twin"`, the default). The user's
preferences can cost answers by themselves: the base model *asked* for them (its **prompted
twin**: the standing preferences as its system instruction, the instruction the OPD teacher gets)
may answer fewer general questions than plain v0. That difference is the **price** of the
preferences, shown wherever versions are. On the general probe the candidate is compared with the
twin, not v0: paying the price is not harm; falling more than the margin below the twin is
(`within`: the mean difference itself decides, on every probe, with the error rates measured in
docs/methods.md#harm-is-judged-against-what-you-asked-for). A price above `max_price` is not paid silently: candidates are held
back with that reason until the user raises it; and no candidate serves more than `max_price`
below v0.

Probes come in two tiers. The first is always asked; it can only hold a candidate back, and only
at the stricter significance an early look needs (`early`, O'Brien and Fleming's boundary). In
every other case (`doubtful`) the reserve (the rest of the general probe set) is asked too and
the decision is taken on both tiers: a candidate is accepted only on all of them. Sixteen probes
cannot tell a 15-point loss from noise (such a candidate looks no worse on them often enough, and
a gate that accepted there would serve exactly those lucky draws); fifty often can. Every
version (and the twin) answers a probe with that probe's own seed (`question_seed`: the question's
checksum offset by the settings' seed), so their answers are coupled (the engines draw by inverse
CDF from the seed's uniform numbers) and the paired differences are mostly the versions', not the
dice's; and different probes draw independently. One seed shared by every probe made the whole
probe one correlated draw: the same base model scored 57 % plain and 42.5 % as the twin under a
shared seed against 62 % and 57 % with a seed per question (108 questions), and the gate's price
came out at twice the demo's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Literal

from clawbridge.judges.hints import teacher_messages
from clawbridge.types import SamplingParams

if TYPE_CHECKING:
    from clawbridge.chat.renderer import Renderer
    from clawbridge.judges.pairwise import PairwiseJudge
    from clawbridge.judges.types import Message
    from clawbridge.protocol import Backend

log = logging.getLogger(__name__)

Recent = tuple[Sequence[int], Sequence["Message"]]  # a user's prompt: its rendered ids and its messages

Decision = Literal["accepted", "rejected"]
Check = Callable[[str, "str | None"], float]  # (answer text, finish reason) -> score in [0, 1]


@dataclass(frozen=True)
class GateProbe:
    group: str  # "probe" (the general set), "validation", "recent", ...
    messages: tuple[dict[str, Any], ...]
    check: Check
    # answers per version for this probe (None: the gate's `samples`, or `reference_samples` for
    # v0 and the twin): a small group (a demo's validation split) gains power from more answers
    samples: int | None = None
    # the group measures the user's preference itself (a demo's validation split): against the
    # serving version its mean decides (rule `within`), so a candidate that keeps the preference
    # less well than what serves, by more than the margin, is held back even when the fall is not
    # significant, and the best validated version serves while a lineage fades
    kept: bool = False


@dataclass(frozen=True)
class GroupFigures:
    candidate: float
    reference: float
    delta: float
    p_worse: float  # one-sided p-value of "the candidate is no worse" (small: it is worse)
    # one-sided p-value of "the candidate is worse by the margin or more" (small: it is shown to
    # lose less than the margin; the burden of proof a comparison with v0 puts on the candidate)
    p_inferior: float


Rule = Literal["harm", "proof", "within"]
Reference = Literal["twin", "v0"]


@dataclass(frozen=True)
class Comparison:
    """A probe group compared with one reference, and the rule that decides on it:
    `harm` holds the candidate back when it is shown worse beyond `margin` (p_worse < alpha);
    `proof` also when it is not shown within `margin` (p_inferior >= alpha; never at an early
    look); `within` when its mean falls more than `margin` below the reference (at an early look:
    only when shown so, 1 − p_inferior < the early alpha)."""

    figures: GroupFigures
    rule: Rule
    margin: float
    alpha: float
    what: str = ""  # how a reason names the reference ("the prompted twin"); default: the key


@dataclass(frozen=True)
class GateDecision:
    candidate: int
    serving: int
    decision: Decision
    reason: str
    figures: dict[str, float] = field(default_factory=dict)
    reference: Reference = "v0"  # what the general probe was judged against
    asked: str | None = None  # the preferences the twin was asked with

    def record(self) -> dict[str, Any]:
        return {"version": self.candidate, "serving": self.serving, "decision": self.decision,
                "reason": self.reason, "figures": {k: round(v, 4) for k, v in self.figures.items()},
                "reference": self.reference, "asked": self.asked}


# --- statistics (pure) -------------------------------------------------------------------------


def _t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with df degrees of freedom (regularised incomplete beta)."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return tail if t > 0 else 1.0 - tail


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b) by the continued fraction (Numerical Recipes' betacf)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)
    front = math.exp(ln)
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > 1e-30 else 1e-30)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > 1e-30 else 1e-30)
            c = 1.0 + num / c
            c = c if abs(c) > 1e-30 else 1e-30
            h *= d * c
        if abs(d * c - 1.0) < 1e-12:
            break
    return front * h / a


def paired_worse(
    candidate: Sequence[float], reference: Sequence[float], margin: float = 0.05
) -> GroupFigures:
    """Mean candidate − reference over paired probes and two one-sided paired t-tests of it:
    `p_worse` of "the mean difference is >= 0" (identical scores give 1: no evidence of harm), and
    `p_inferior` of "the mean difference is <= −margin" (non-inferiority: small only when the
    candidate is shown to lose less than the margin). Without spread, each p is 0 or 1 by which
    side of its bound the difference is on."""
    if len(candidate) != len(reference) or not candidate:
        raise ValueError("need the same, non-empty probes for both versions")
    d = [c - r for c, r in zip(candidate, reference, strict=True)]
    n = len(d)
    mean = sum(d) / n
    c_rate, r_rate = sum(candidate) / n, sum(reference) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n >= 2 else 0.0
    if sd == 0.0:
        return GroupFigures(c_rate, r_rate, mean, 1.0 if mean >= 0 else 0.0, 0.0 if mean > -margin else 1.0)
    se = sd / math.sqrt(n)
    return GroupFigures(c_rate, r_rate, mean, 1.0 - _t_sf(mean / se, n - 1), _t_sf((mean + margin) / se, n - 1))


def early(alpha: float, share: float) -> float:
    """The significance a rejection needs when only `share` of the probes are in: O'Brien and
    Fleming's boundary for a two-look sequential test, z = z_alpha / sqrt(share), so that a look
    at a third of the evidence rejects only a loss that all of it would almost surely confirm."""
    if share >= 1.0:
        return alpha
    z = NormalDist().inv_cdf(1.0 - alpha) / math.sqrt(max(share, 1e-9))
    return 1.0 - NormalDist().cdf(z)


def doubtful(comparisons: dict[str, Comparison], share: float = 1.0) -> bool:
    """More probes should decide: unless the candidate is shown worse at the stricter significance
    an early look at `share` of the probes needs (`early`). An early look never accepts (a
    candidate 15 points worse looks no worse than its reference on 16 questions often enough, and
    the gate would pick exactly those lucky draws), nor holds back for want of evidence."""
    if share >= 1.0:
        return False
    return decide(comparisons, share=share)[0] == "accepted"


def decide(comparisons: dict[str, Comparison], *, share: float = 1.0) -> tuple[Decision, str]:
    """Held back on the first comparison its rule holds against (module docstring); `share` < 1
    is an early look: only a loss shown beyond the margin at `early(alpha, share)` holds back.
    A gate that held back only a loss it could show served, among five candidates that each lost
    12 points of the probe, the one whose 50 answers happened to look fine: against v0 in the
    strict mode the candidate carries the burden of proof; against the twin the mean on all the
    probes decides, and the probes are many enough for the error rates to be small."""
    final = share >= 1.0
    for name, c in comparisons.items():
        g, alpha = c.figures, early(c.alpha, share)
        if c.rule == "within":
            shown = final or 1.0 - g.p_inferior < alpha
            if g.delta < -c.margin and shown:
                return "rejected", (f"{name}: {g.candidate:.0%} vs {g.reference:.0%} ({100 * g.delta:+.0f} pts), "
                                    f"more than {100 * c.margin:.0f} pts below {c.what or 'it'}")
        elif g.delta < -c.margin and g.p_worse < alpha:
            return "rejected", (f"{name}: {g.candidate:.0%} vs {g.reference:.0%} "
                                f"({100 * g.delta:+.0f} pts, p={g.p_worse:.3f})")
    if not final:
        return "accepted", "no probe group is worse beyond the margin"
    for name, c in comparisons.items():
        g = c.figures
        if c.rule == "proof" and g.p_inferior >= c.alpha:
            return "rejected", (f"{name}: {g.candidate:.0%} vs {g.reference:.0%} "
                                f"({100 * g.delta:+.0f} pts), not shown within {100 * c.margin:.0f} pts "
                                f"(p={g.p_inferior:.3f})")
    if any(c.rule == "within" for c in comparisons.values()):
        return "accepted", "no probe group is worse beyond the margin; the probe is within it of the prompted twin"
    if any(c.rule == "proof" for c in comparisons.values()):
        return "accepted", "no probe group is worse beyond the margin, and each is within it of v0"
    return "accepted", "no probe group is worse beyond the margin"


def price(plain: Sequence[float], asked: Sequence[float]) -> float:
    """What the preferences cost on the general probe: plain v0's rate − the twin's, as a rate
    difference over the same probes (positive: asking for them costs answers)."""
    if len(plain) != len(asked) or not plain:
        raise ValueError("need the same, non-empty probes for both")
    return (sum(plain) - sum(asked)) / len(plain)


# --- evaluation (I/O: the backend) ---------------------------------------------------------------


Who = tuple[int, "str | None"]  # a version, asked with an instruction (the twin) or plain (None)


class Gate:
    """Scores versions on the probes; remembers each version's scores (a version's weights never
    change, so the serving version, v0 and the twin are sampled once). v0 and the twin, asked
    once for every candidate, answer each probe `reference_samples` times."""

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
        self.margin = margin
        self.alpha = alpha
        self.alpha_base = alpha if alpha_base is None else alpha_base
        self.reference = reference
        self.max_price = max_price
        self.non_inferiority = non_inferiority
        self._scores: dict[Who, list[list[float]]] = {}  # who -> scores of each tier asked
        self.answers: dict[Who, list[str]] = {}  # the first answer per probe asked (for reading)

    @property
    def probes(self) -> list[GateProbe]:
        """The first tier: asked of every candidate."""
        return self.tiers[0]

    async def scores(self, version: int, tiers: int = 1, asked: str | None = None,
                     samples: int | None = None) -> list[float]:
        """One score per probe of the first `tiers` tiers, in [0, 1]: the mean check over
        `samples` answers; `asked`: with that instruction (the twin). A tier is asked once."""
        who: Who = (version, asked)
        have = self._scores.setdefault(who, [])
        self.answers.setdefault(who, [])
        while len(have) < tiers:
            rated = await asyncio.gather(*(self._score(p, who, samples or self.samples)
                                           for p in self.tiers[len(have)]))
            have.append([s for s, _ in rated])
            self.answers[who].extend(a for _, a in rated)
        return [x for tier in have[:tiers] for x in tier]

    async def _score(self, probe: GateProbe, who: Who, samples: int) -> tuple[float, str]:
        version, asked = who
        messages = list(probe.messages) if asked is None else teacher_messages(probe.messages, asked)
        prompt = self.renderer.render(messages)
        params = dataclasses.replace(self.params, seed=question_seed(self.params.seed, message_key(probe.messages)))
        comps = await self.backend.sample(prompt, params, n=probe.samples or samples, version=version)
        texts = [(self.renderer.parse(c.tokens, c.finish_reason).content or "", c.finish_reason) for c in comps]
        return sum(probe.check(t, f) for t, f in texts) / len(texts), texts[0][0]

    async def general(self, version: int, asked: str | None = None, samples: int | None = None) -> list[float]:
        """`version`'s score on each general probe question of every tier (asked with `asked`:
        the twin), as the gate measures it (the same seeds, and cached: what the gate has asked
        is not asked again). What the demo shows as "the general probe"."""
        scores = await self.scores(version, len(self.tiers), asked, samples)
        return [x for x, p in zip(scores, (p for t in self.tiers for p in t), strict=True) if p.group == "probe"]

    def alias(self, version: int, same_as: int) -> None:
        """`version` holds `same_as`'s weights (a restored copy): reuse its scores."""
        if (same_as, None) in self._scores:
            self._scores[(version, None)] = self._scores[(same_as, None)]
            self.answers[(version, None)] = self.answers[(same_as, None)]

    def forget(self, version: int) -> None:
        self._scores.pop((version, None), None)
        self.answers.pop((version, None), None)

    async def _answer(self, prompt_ids: Sequence[int], version: int) -> str:
        key = ",".join(map(str, prompt_ids))
        params = dataclasses.replace(self.params, seed=question_seed(self.params.seed, key))
        [c] = await self.backend.sample(prompt_ids, params, n=1, version=version)
        return self.renderer.parse(c.tokens, c.finish_reason).content or ""

    async def _compare(self, prompt: Recent, candidate: int, serving: int) -> float:
        """How often the judge prefers the candidate's answer to the serving version's."""
        assert self.pairwise is not None
        ids, messages = prompt
        a, b = await asyncio.gather(self._answer(ids, candidate), self._answer(ids, serving))
        return await self.pairwise.prefer(messages, a, b)

    async def price(self, asked: str | None, base: int = 0, tiers: int | None = None) -> tuple[float, float]:
        """The general probe's rate of plain v0 and of the twin asked with `asked`, on the first
        `tiers` tiers (all: None)."""
        n = len(self.tiers) if tiers is None else tiers
        idx = [i for i, p in enumerate(p for t in self.tiers[:n] for p in t) if p.group == "probe"]
        if not idx:
            return 0.0, 0.0
        plain = await self.scores(base, n, None, self.reference_samples)
        twin = plain if asked is None else await self.scores(base, n, asked, self.reference_samples)
        return sum(plain[i] for i in idx) / len(idx), sum(twin[i] for i in idx) / len(idx)

    async def evaluate(
        self, candidate: int, serving: int, base: int = 0, recent: Sequence[Recent] = (),
        asked: str | None = None,
    ) -> GateDecision:
        """`recent`: the user's own recent prompts, replayed on both versions and compared by the
        pairwise judge (when there is one). `asked`: the standing preferences (the twin's
        instruction; None: nothing asked, the twin is plain v0)."""
        t0 = time.monotonic()
        twin = self.reference == "twin"
        asked = asked if twin else None
        if twin and asked is not None:
            plain, prompted = await self.price(asked, base)
            if (base, asked) not in self._told:  # said once per set of preferences, whoever measured it
                self._told.add((base, asked))
                log.warning("your preferences %s cost %.0f points of general answers on this model: %.0f %% -> "
                            "%.0f %% of the probe answered when the base model is asked for them "
                            "(gate_max_price %.0f points)", _quoted(asked), 100 * (plain - prompted),
                            100 * plain, 100 * prompted, 100 * self.max_price)
            if plain - prompted > self.max_price:
                reason = (f"the preferences cost {100 * (plain - prompted):.0f} pts of the general probe "
                          f"(v0 {plain:.0%}, asked {prompted:.0%}), more than gate_max_price "
                          f"({100 * self.max_price:.0f} pts): raise it to accept this price")
                priced = {"probe_v0": plain, "probe_twin": prompted, "price_points": 100 * (plain - prompted),
                          "seconds": time.monotonic() - t0}
                return GateDecision(candidate, serving, "rejected", reason, priced, "twin", asked)
        comparisons: dict[str, Comparison] = {}
        figures: dict[str, float] = {}
        if self.pairwise is not None and recent:
            wins = list(await asyncio.gather(*(self._compare(p, candidate, serving) for p in recent)))
            # paired per prompt: the candidate's share of the preference against the serving one's
            fig = paired_worse(wins, [1.0 - w for w in wins], self.margin)
            comparisons["recent vs serving"] = Comparison(fig, "harm", self.margin, self.alpha)
            figures.update(recent_candidate=fig.candidate, recent_n=float(len(wins)),
                           recent_p_vs_serving=fig.p_worse)
        total = sum(len(t) for t in self.tiers)
        asked_tiers = 1
        found = await self._probe_figures(candidate, serving, base, asked_tiers, asked)
        while asked_tiers < len(self.tiers) and doubtful(
                {**comparisons, **found[0]}, sum(len(t) for t in self.tiers[:asked_tiers]) / total):
            asked_tiers += 1
            found = await self._probe_figures(candidate, serving, base, asked_tiers, asked)
        comparisons.update(found[0])
        figures.update(found[1])
        figures["probes_asked"] = float(sum(len(t) for t in self.tiers[:asked_tiers]))
        decision, reason = decide(comparisons)
        figures["seconds"] = time.monotonic() - t0
        return GateDecision(candidate, serving, decision, reason, figures, self.reference, asked)

    async def _probe_figures(
        self, candidate: int, serving: int, base: int, tiers: int, asked: str | None
    ) -> tuple[dict[str, Comparison], dict[str, float]]:
        """The paired comparisons per probe group on the first `tiers` tiers, each with its rule:
        the general probe against the twin (and, capped by the price, v0) when harm is judged
        against what the user asked for; every other group, and the probe in the strict mode,
        against the serving version (harm; a `kept` group: `within`) and v0 (`proof`, or `harm`
        without non_inferiority)."""
        comparisons: dict[str, Comparison] = {}
        figures: dict[str, float] = {}
        probes = [p for tier in self.tiers[:tiers] for p in tier]
        cand = await self.scores(candidate, tiers)
        v0 = await self.scores(base, tiers, None, self.reference_samples)
        refs = {"serving": v0 if base == serving else await self.scores(serving, tiers), "v0": v0}
        if self.reference == "twin":
            refs["twin"] = v0 if asked is None else await self.scores(base, tiers, asked, self.reference_samples)
        base_rule: Rule = "proof" if self.non_inferiority else "harm"
        for g in sorted({p.group for p in probes}):
            idx = [i for i, p in enumerate(probes) if p.group == g]
            kept = any(probes[i].kept for i in idx)
            c = [cand[i] for i in idx]
            figures[f"{g}_candidate"] = sum(c) / len(c)
            for ref_name, ref in refs.items():
                r = [ref[i] for i in idx]
                if ref_name == "twin" and g != "probe":
                    continue
                general = g == "probe" and self.reference == "twin"
                if general and ref_name == "twin":
                    rule: Rule | None = "within"
                    margin, alpha, what = self.margin, self.alpha, "the prompted twin"
                elif general and ref_name == "v0":
                    rule, margin, alpha, what = "within", self.max_price, self.alpha, "v0 (gate_max_price)"
                elif general:
                    rule = None  # paying the price is not harm: the serving version does not decide
                    margin, alpha, what = self.margin, self.alpha, ""
                elif ref_name == "v0":
                    rule, margin, alpha, what = base_rule, self.margin, self.alpha_base, ""
                elif kept:
                    rule, margin, alpha, what = "within", self.margin, self.alpha, "the serving version"
                else:
                    rule, margin, alpha, what = "harm", self.margin, self.alpha, ""
                fig = paired_worse(c, r, margin)
                figures[f"{g}_{ref_name}"] = fig.reference
                figures[f"{g}_p_vs_{ref_name}"] = fig.p_worse
                if ref_name == "v0" and rule == "proof":
                    figures[f"{g}_p_inferior_vs_v0"] = fig.p_inferior
                if rule is not None:
                    comparisons[f"{g} vs {ref_name}"] = Comparison(fig, rule, margin, alpha, what)
            if g == "probe" and "twin" in refs:
                figures["price_points"] = 100 * price([v0[i] for i in idx], [refs["twin"][i] for i in idx])
        return comparisons, figures


def _quoted(asked: str) -> str:
    return ", ".join(f"'{line}'" for line in asked.splitlines())


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


def probe_check(answered: Callable[[str], bool]) -> Check:
    """A general-probe check: 1 when the answer answers the question (a cut-off answer counts:
    the probe asks whether the model still answers, not how long it talks)."""
    return lambda text, _finish: 1.0 if answered(text) else 0.0


__all__ = ["Comparison", "Gate", "GateDecision", "GateProbe", "GroupFigures", "decide", "doubtful", "early",
           "message_key", "paired_worse", "price", "probe_check", "question_seed"]
