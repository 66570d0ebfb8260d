"""The gate before every publish (DESIGN.md §6, "Keeping the model good").

    train_step ─► publish candidate v(K+1) while the proxy keeps serving vK (the pin)
              ─► sample both on the probes ─► paired comparison per probe group
              ─► accepted: serve v(K+1)
              ─► rejected: backend.rollback(K) (a copy of vK's weights, fresh optimizer) serves,
                 the candidate is recorded "rejected by the gate" with its figures

Probes are prompts with a check that scores an answer in [0, 1]: the general probe set (does the
version still answer everyday questions), and whatever the caller adds (the demo: the scenario's
truly-satisfied check on a validation split; an agent's recent prompts with a judge model).

The decision is pure (`decide`): for each group, the per-probe difference candidate − reference is
tested with one-sided paired t-tests. Against the serving version, a candidate is held back when
the mean difference is below −margin AND the test says it is worse (p < alpha): evidence of harm.
Against v0, the base, the burden of proof is the candidate's: it serves only when shown to lose
less than the margin (non-inferiority, p < alpha_base), so that neither small losses adding up
step after step nor one lucky set of answers among many candidates' can serve a worse model.

Probes come in two tiers. The first is always asked; it can only hold a candidate back, and only
at the stricter significance an early look needs (`early`, O'Brien and Fleming's boundary). In
every other case (`doubtful`) the reserve (the rest of the general probe set) is asked too and
the decision is taken on both tiers: a candidate is accepted only on all of them. Sixteen probes
cannot tell a 15-point loss from noise (such a candidate looks no worse on them often enough, and
a gate that accepted there would serve exactly those lucky draws); fifty often can. Both
versions answer each probe with the same sampling seed, so their answers are coupled (the
engines draw by inverse CDF from the seed's uniform numbers) and the paired differences are
mostly the versions', not the dice's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Literal

from clawbridge.types import SamplingParams

if TYPE_CHECKING:
    from clawbridge.chat.renderer import Renderer
    from clawbridge.judges.pairwise import PairwiseJudge
    from clawbridge.judges.types import Message
    from clawbridge.protocol import Backend

Recent = tuple[Sequence[int], Sequence["Message"]]  # a user's prompt: its rendered ids and its messages

Decision = Literal["accepted", "rejected"]
GATE_KEY = "gate.decisions"  # store meta: every decision, oldest first
Check = Callable[[str, "str | None"], float]  # (answer text, finish reason) -> score in [0, 1]


@dataclass(frozen=True)
class GateProbe:
    group: str  # "probe" (the general set), "validation", "recent", ...
    messages: tuple[dict[str, Any], ...]
    check: Check


@dataclass(frozen=True)
class GroupFigures:
    candidate: float
    reference: float
    delta: float
    p_worse: float  # one-sided p-value of "the candidate is no worse" (small: it is worse)
    # one-sided p-value of "the candidate is worse by the margin or more" (small: it is shown to
    # lose less than the margin; the burden of proof a comparison with v0 puts on the candidate)
    p_inferior: float


@dataclass(frozen=True)
class GateDecision:
    candidate: int
    serving: int
    decision: Decision
    reason: str
    figures: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {"version": self.candidate, "serving": self.serving, "decision": self.decision,
                "reason": self.reason, "figures": {k: round(v, 4) for k, v in self.figures.items()}}


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


def doubtful(
    comparisons: dict[str, GroupFigures], margin: float, alpha: float, alpha_base: float | None = None,
    share: float = 1.0,
) -> bool:
    """More probes should decide: unless the candidate is shown worse at the stricter significance
    an early look at `share` of the probes needs (`early`). An early look never accepts (a
    candidate 15 points worse looks no worse than its reference on 16 questions often enough, and
    the gate would pick exactly those lucky draws), nor holds back for want of evidence."""
    if share >= 1.0:
        return False
    strict_base = None if alpha_base is None else early(alpha_base, share)
    return decide(comparisons, margin, early(alpha, share), strict_base, non_inferiority=False)[0] == "accepted"


def decide(
    comparisons: dict[str, GroupFigures], margin: float, alpha: float, alpha_base: float | None = None,
    *, non_inferiority: bool = True,
) -> tuple[Decision, str]:
    """Held back when some comparison is worse by more than `margin` with p < `alpha`, or (with
    `non_inferiority`, which an early look leaves out) when a comparison with v0 (named
    "... vs v0", at `alpha_base` when given) does not show the candidate within the margin:
    against the serving version the gate asks for evidence of harm, against the base for evidence
    of safety. A gate that held back only a loss it could show served, among five candidates that
    each lost 12 points of the probe, the one whose 50 answers happened to look fine; what all the
    steps together cost is guarded from the other side (the candidate carries the burden of
    proof)."""

    def level(name: str) -> float:
        return alpha_base if alpha_base is not None and name.endswith(" vs v0") else alpha

    for name, g in comparisons.items():
        if g.delta < -margin and g.p_worse < level(name):
            return "rejected", (f"{name}: {g.candidate:.0%} vs {g.reference:.0%} "
                                f"({100 * g.delta:+.0f} pts, p={g.p_worse:.3f})")
    if not non_inferiority:
        return "accepted", "no probe group is worse beyond the margin"
    for name, g in comparisons.items():
        if name.endswith(" vs v0") and g.p_inferior >= level(name):
            return "rejected", (f"{name}: {g.candidate:.0%} vs {g.reference:.0%} "
                                f"({100 * g.delta:+.0f} pts), not shown within {100 * margin:.0f} pts "
                                f"(p={g.p_inferior:.3f})")
    return "accepted", "no probe group is worse beyond the margin, and each is within it of v0"


# --- evaluation (I/O: the backend) ---------------------------------------------------------------


class Gate:
    """Scores versions on the probes; remembers each version's scores (a version's weights never
    change, so the serving version and v0 are sampled once)."""

    def __init__(
        self,
        backend: Backend,
        renderer: Renderer,
        probes: Sequence[GateProbe],
        *,
        params: SamplingParams,
        samples: int = 1,
        margin: float = 0.05,
        alpha: float = 0.1,
        alpha_base: float | None = None,
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
        self.margin = margin
        self.alpha = alpha
        self.alpha_base = alpha_base
        self.non_inferiority = non_inferiority
        self._scores: dict[int, list[list[float]]] = {}  # version -> scores of each tier asked
        self.answers: dict[int, list[str]] = {}  # the first answer per probe asked (for reading)

    @property
    def probes(self) -> list[GateProbe]:
        """The first tier: asked of every candidate."""
        return self.tiers[0]

    async def scores(self, version: int, tiers: int = 1) -> list[float]:
        """One score per probe of the first `tiers` tiers, in [0, 1]: the mean check over
        `samples` answers. A tier is asked of a version once."""
        have = self._scores.setdefault(version, [])
        self.answers.setdefault(version, [])
        while len(have) < tiers:
            rated = await asyncio.gather(*(self._score(p, version) for p in self.tiers[len(have)]))
            have.append([s for s, _ in rated])
            self.answers[version].extend(a for _, a in rated)
        return [x for tier in have[:tiers] for x in tier]

    async def _score(self, probe: GateProbe, version: int) -> tuple[float, str]:
        prompt = self.renderer.render(list(probe.messages))
        comps = await self.backend.sample(prompt, self.params, n=self.samples, version=version)
        texts = [(self.renderer.parse(c.tokens, c.finish_reason).content or "", c.finish_reason) for c in comps]
        return sum(probe.check(t, f) for t, f in texts) / len(texts), texts[0][0]

    def alias(self, version: int, same_as: int) -> None:
        """`version` holds `same_as`'s weights (a restored copy): reuse its scores."""
        if same_as in self._scores:
            self._scores[version] = self._scores[same_as]
            self.answers[version] = self.answers[same_as]

    def forget(self, version: int) -> None:
        self._scores.pop(version, None)
        self.answers.pop(version, None)

    async def _answer(self, prompt_ids: Sequence[int], version: int) -> str:
        [c] = await self.backend.sample(prompt_ids, self.params, n=1, version=version)
        return self.renderer.parse(c.tokens, c.finish_reason).content or ""

    async def _compare(self, prompt: Recent, candidate: int, serving: int) -> float:
        """How often the judge prefers the candidate's answer to the serving version's."""
        assert self.pairwise is not None
        ids, messages = prompt
        a, b = await asyncio.gather(self._answer(ids, candidate), self._answer(ids, serving))
        return await self.pairwise.prefer(messages, a, b)

    async def evaluate(
        self, candidate: int, serving: int, base: int = 0, recent: Sequence[Recent] = ()
    ) -> GateDecision:
        """`recent`: the user's own recent prompts, replayed on both versions and compared by the
        pairwise judge (when there is one)."""
        t0 = time.monotonic()
        comparisons: dict[str, GroupFigures] = {}
        figures: dict[str, float] = {}
        if self.pairwise is not None and recent:
            wins = list(await asyncio.gather(*(self._compare(p, candidate, serving) for p in recent)))
            # paired per prompt: the candidate's share of the preference against the serving one's
            fig = paired_worse(wins, [1.0 - w for w in wins], self.margin)
            comparisons["recent vs serving"] = fig
            figures.update(recent_candidate=fig.candidate, recent_n=float(len(wins)),
                           recent_p_vs_serving=fig.p_worse)
        asked = 1
        probe_figures = await self._probe_figures(candidate, serving, base, asked)
        total = sum(len(t) for t in self.tiers)
        while asked < len(self.tiers) and doubtful({**comparisons, **probe_figures[0]}, self.margin, self.alpha,
                                                   self.alpha_base, sum(len(t) for t in self.tiers[:asked]) / total):
            asked += 1
            probe_figures = await self._probe_figures(candidate, serving, base, asked)
        comparisons.update(probe_figures[0])
        figures.update(probe_figures[1])
        figures["probes_asked"] = float(sum(len(t) for t in self.tiers[:asked]))
        decision, reason = decide(comparisons, self.margin, self.alpha, self.alpha_base,
                                  non_inferiority=self.non_inferiority)
        figures["seconds"] = time.monotonic() - t0
        return GateDecision(candidate, serving, decision, reason, figures)

    async def _probe_figures(
        self, candidate: int, serving: int, base: int, tiers: int
    ) -> tuple[dict[str, GroupFigures], dict[str, float]]:
        """The paired comparisons per probe group on the first `tiers` tiers."""
        comparisons: dict[str, GroupFigures] = {}
        figures: dict[str, float] = {}
        probes = [p for tier in self.tiers[:tiers] for p in tier]
        cand = await self.scores(candidate, tiers)
        refs = {"serving": await self.scores(serving, tiers)}
        # always a comparison with v0, at alpha_base: when v0 serves, the serving comparison is
        # that one too (with only "vs serving", v0's first candidate escaped the stricter test)
        refs["v0"] = refs["serving"] if base == serving else await self.scores(base, tiers)
        for g in sorted({p.group for p in probes}):
            idx = [i for i, p in enumerate(probes) if p.group == g]
            c = [cand[i] for i in idx]
            figures[f"{g}_candidate"] = sum(c) / len(c)
            for ref_name, ref in refs.items():
                r = [ref[i] for i in idx]
                fig = paired_worse(c, r, self.margin)
                comparisons[f"{g} vs {ref_name}"] = fig
                figures[f"{g}_{ref_name}"] = fig.reference
                figures[f"{g}_p_vs_{ref_name}"] = fig.p_worse
                if ref_name == "v0":
                    figures[f"{g}_p_inferior_vs_v0"] = fig.p_inferior
        return comparisons, figures


def probe_check(answered: Callable[[str], bool]) -> Check:
    """A general-probe check: 1 when the answer answers the question (a cut-off answer counts:
    the probe asks whether the model still answers, not how long it talks)."""
    return lambda text, _finish: 1.0 if answered(text) else 0.0


__all__ = ["GATE_KEY", "Gate", "GateDecision", "GateProbe", "GroupFigures", "decide", "doubtful", "early", "paired_worse",
           "probe_check"]
