"""The gate's rules as data (docs/methods.md#keeping-the-model-good-the-anchor-and-the-gate): which
probe group is compared with which reference, by which rule, at which margin and significance; and
one pure `decide` over the comparisons.

Rules (`Rule`), each holding a candidate back on one comparison:
- `harm`: shown worse beyond the margin (mean difference < −margin and p_worse < alpha);
- `proof`: also when not shown to lose less than the margin (p_inferior >= alpha; never at an
  early look): the burden of proof a comparison with v0 puts on the candidate in the strict mode;
- `within`: its mean falls more than the margin below the reference (at an early look: only when
  shown so, 1 − p_inferior < the early alpha).

The table (`GateRules.build`), per probe group:
- against the serving version: `harm`, or `within` for a group that measures the preference
  itself (`GateProbe.measures_preference`: the demo's validation split, too small to show a fall);
- against v0: `proof` (`harm` without non-inferiority) at `alpha_base`;
- the general probe when harm is judged against what the user asked for (reference "twin"):
  `within` the margin of the prompted twin, `within` gate_max_price of v0, and no rule against the
  serving version (paying the price of the preferences is not harm).
The price itself (plain v0's rate − the twin's on the general probe) is held to gate_max_price by
`GateRules.price_held_back`, before any candidate is asked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from clawbridge.learning.stats import GroupFigures, early

GENERAL = "probe"  # the general probe set's group (and the prefix of its figures)
RECENT = "recent"  # the user's recent prompts, compared pairwise by the judge model

Decision = Literal["accepted", "rejected"]
Rule = Literal["harm", "proof", "within"]
Reference = Literal["twin", "v0"]  # what the general probe is judged against (gate_reference)
Against = Literal["serving", "v0", "twin"]  # the version a group's candidate scores are paired with


@dataclass(frozen=True)
class GroupRule:
    """One row of the table: `group` compared with `against`, decided by `rule` (None: figures
    only); `label`: how a reason names the reference (default: "it")."""

    group: str
    against: Against
    rule: Rule | None
    margin: float
    alpha: float
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.group} vs {self.against}"


@dataclass(frozen=True)
class Comparison:
    """A row's comparison, measured: the figures its rule decides on."""

    row: GroupRule
    figures: GroupFigures


@dataclass(frozen=True)
class GateRules:
    """The table, built once per gate; `max_price`: the price of the preferences above which
    every candidate is held back (None: harm is judged against v0, no price is measured)."""

    rows: tuple[GroupRule, ...]  # the probe groups' rows, in the order they are judged
    max_price: float | None
    recent: GroupRule | None = None  # the user's recent prompts (with a pairwise judge)

    @classmethod
    def build(
        cls, groups: Mapping[str, bool], *, reference: Reference, margin: float, alpha: float,
        alpha_base: float, max_price: float, non_inferiority: bool, recent: bool = False,
    ) -> GateRules:
        """`groups`: each probe group and whether it measures the preference itself; `recent`:
        the user's recent prompts are compared pairwise (a row against the serving version)."""
        rows: list[GroupRule] = []
        v0_rule: Rule = "proof" if non_inferiority else "harm"
        for group in sorted(groups):
            if group == GENERAL and reference == "twin":
                rows += [GroupRule(group, "serving", None, margin, alpha),
                         GroupRule(group, "v0", "within", max_price, alpha, "v0 (gate_max_price)"),
                         GroupRule(group, "twin", "within", margin, alpha, "the prompted twin")]
                continue
            if groups[group]:
                rows.append(GroupRule(group, "serving", "within", margin, alpha, "the serving version"))
            else:
                rows.append(GroupRule(group, "serving", "harm", margin, alpha))
            rows.append(GroupRule(group, "v0", v0_rule, margin, alpha_base))
        return cls(tuple(rows), max_price if reference == "twin" else None,
                   GroupRule(RECENT, "serving", "harm", margin, alpha) if recent else None)

    def of(self, group: str) -> list[GroupRule]:
        return [r for r in self.rows if r.group == group]

    def price_held_back(self, plain: float, prompted: float) -> str | None:
        """Why every candidate is held back when the preferences cost more than `max_price` on
        the general probe (`plain`: v0's rate, `prompted`: the twin's); None: the price is paid."""
        if self.max_price is None or plain - prompted <= self.max_price:
            return None
        return (f"the preferences cost {100 * (plain - prompted):.0f} pts of the general probe "
                f"(v0 {plain:.0%}, asked {prompted:.0%}), more than gate_max_price "
                f"({100 * self.max_price:.0f} pts): raise it to accept this price")

    def describe(self) -> str:
        """The table, one row a line (what `clawbridge` would tell a reader of the gate)."""
        lines = [f"{'group vs reference':<24} {'rule':<7} {'margin':>6} {'alpha':>6}  label"]
        lines += [f"{r.name:<24} {r.rule or '-':<7} {r.margin:>6.3g} {r.alpha:>6.3g}  {r.label}".rstrip()
                  for r in ((self.recent,) if self.recent else ()) + self.rows]
        if self.max_price is not None:
            lines.append(f"price of the preferences (v0 - twin on {GENERAL}) at most {self.max_price:.3g}")
        return "\n".join(lines)


def needs_more_probes(comparisons: Mapping[str, Comparison], share: float = 1.0) -> bool:
    """More probes should decide: unless the candidate is shown worse at the stricter significance
    an early look at `share` of the probes needs (`early`). An early look never accepts (a
    candidate 15 points worse looks no worse than its reference on 16 questions often enough, and
    the gate would pick exactly those lucky draws), nor holds back for want of evidence."""
    if share >= 1.0:
        return False
    return decide(comparisons, share=share)[0] == "accepted"


def decide(comparisons: Mapping[str, Comparison], *, share: float = 1.0) -> tuple[Decision, str]:
    """Held back on the first comparison its rule holds against (module docstring); `share` < 1
    is an early look: only a loss shown beyond the margin at `early(alpha, share)` holds back.
    Holding back only a loss that can be shown would serve, among several candidates that each
    lose beyond the margin, the one whose answers happen to look fine: so against v0 in the
    strict mode the candidate carries the burden of proof, and against the twin the mean on all
    the probes decides (the probes are many enough for its error rates to be small)."""
    final = share >= 1.0
    for name, c in comparisons.items():
        g, r = c.figures, c.row
        alpha = early(r.alpha, share)
        if r.rule == "within":
            shown = final or 1.0 - g.p_inferior < alpha
            if g.delta < -r.margin and shown:
                return "rejected", (f"{name}: {g.candidate:.0%} vs {g.reference:.0%} ({100 * g.delta:+.0f} pts), "
                                    f"more than {100 * r.margin:.0f} pts below {r.label or 'it'}")
        elif r.rule is not None and g.delta < -r.margin and g.p_worse < alpha:
            return "rejected", (f"{name}: {g.candidate:.0%} vs {g.reference:.0%} "
                                f"({100 * g.delta:+.0f} pts, p={g.p_worse:.3f})")
    if not final:
        return "accepted", "no probe group is worse beyond the margin"
    for name, c in comparisons.items():
        g, r = c.figures, c.row
        if r.rule == "proof" and g.p_inferior >= r.alpha:
            return "rejected", (f"{name}: {g.candidate:.0%} vs {g.reference:.0%} "
                                f"({100 * g.delta:+.0f} pts), not shown within {100 * r.margin:.0f} pts "
                                f"(p={g.p_inferior:.3f})")
    if any(c.row.against == "twin" for c in comparisons.values()):
        return "accepted", "no probe group is worse beyond the margin; the probe is within it of the prompted twin"
    if any(c.row.rule == "proof" for c in comparisons.values()):
        return "accepted", "no probe group is worse beyond the margin, and each is within it of v0"
    return "accepted", "no probe group is worse beyond the margin"


__all__ = ["GENERAL", "RECENT", "Against", "Comparison", "Decision", "GateRules", "GroupRule", "Reference", "Rule",
           "decide", "needs_more_probes"]
