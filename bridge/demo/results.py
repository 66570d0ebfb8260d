"""What the preference demo measures: one served version (`VersionEval`) and the whole run
(`DemoResult`: before/after with paired intervals, teachability, the price and the twin, the
`--json` document). Plain data; `runner` fills them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clawbridge.demo import report
from clawbridge.demo.report import r4
from clawbridge.demo.scenario import paired_interval
from clawbridge.demo.teachability import Price, Teachability


@dataclass(frozen=True)
class VersionEval:
    """One served version on the held-out prompts (per-prompt rates, each over eval_samples)."""

    version: int
    rate: float  # the preference met
    per_prompt: tuple[float, ...]
    samples: int
    seconds: float
    on_topic: float = 0.0  # the answer answers the question
    truly: float = 0.0  # both: what the user would call satisfied
    truly_per_prompt: tuple[float, ...] = ()
    on_topic_per_prompt: tuple[float, ...] = ()
    probe: float | None = None  # the general probe set's on-topic rate (v0 and the last version)
    probe_per_prompt: tuple[float, ...] = ()  # per probe question, for the paired interval
    conversations: int = 0  # training conversations before this version served
    # as served (instant preferences): the user's applied preferences as an instruction on top of
    # the weights; the weights alone where none was served (`instruction` None)
    instruction: str | None = None
    served_truly: float | None = None

    @property
    def served(self) -> float:
        """Truly satisfied as the user was served."""
        return self.truly if self.served_truly is None else self.served_truly


@dataclass
class DemoResult:
    scenario: str
    model: str
    method: str
    before: float
    after: float
    delta: float
    interval: tuple[float, float]
    steps: int
    versions: list[VersionEval]
    seconds: float
    train_conversations: int
    train_satisfied: int
    heldout_prompts: int
    eval_samples: int
    truly_interval: tuple[float, float] = (0.0, 0.0)
    gate: list[dict[str, Any]] = field(default_factory=list)
    plot: str | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)
    teachability: Teachability | None = None
    price: Price | None = None  # v0 plain and the prompted twin on the general probe
    parts: dict[str, float] = field(default_factory=dict)  # wall seconds per part of the run
    dtype: str = "fp32"  # the engine's arithmetic (engine_dtype as the CPU resolved it)

    @property
    def improved(self) -> bool:
        return self.truly_interval[0] > 0

    @property
    def first(self) -> VersionEval:
        return self.versions[0]

    @property
    def last(self) -> VersionEval:
        return self.versions[-1]

    @property
    def probe_interval(self) -> tuple[float, float] | None:
        """95 % interval of the general probe's change, v0 to the last version, paired per
        question (both answered with the same seed per question)."""
        b, a = self.first.probe_per_prompt, self.last.probe_per_prompt
        if not b or len(a) != len(b):
            return None
        _, lo, hi = paired_interval(b, a)
        return lo, hi

    @property
    def twin_probe(self) -> float | None:
        """The prompted twin's general-probe rate: what the last version is held to (goal: within
        5 points of it)."""
        return None if self.price is None else self.price.probe_asked

    @property
    def price_interval(self) -> tuple[float, float] | None:
        """95 % interval of the price (plain − asked), paired per probe question."""
        if self.price is None or len(self.price.plain) < 2:
            return None
        _, lo, hi = paired_interval(self.price.asked, self.price.plain)
        return lo, hi

    @property
    def conversations_to_80(self) -> int | None:
        """Training conversations until a served version was truly satisfying on >= 80 % of the
        held-out prompts (None: never within the run)."""
        return next((v.conversations for v in self.versions if v.truly >= 0.8), None)

    def summary(self) -> dict[str, Any]:
        """The `--json` document."""
        b, a = self.first, self.last
        measures = {
            "before": r4(self.before), "after": r4(self.after), "delta": r4(self.delta),
            "interval": [r4(self.interval[0]), r4(self.interval[1])],
            "truly_before": r4(b.truly), "truly_after": r4(a.truly), "truly_delta": r4(a.truly - b.truly),
            "truly_interval": [r4(self.truly_interval[0]), r4(self.truly_interval[1])],
            # as served, by conversations: what the user got, the instruction included
            "served_curve": [[v.conversations, r4(v.served)] for v in self.versions],
            "weights_curve": [[v.conversations, r4(v.truly)] for v in self.versions],
            "on_topic_before": r4(b.on_topic), "on_topic_after": r4(a.on_topic),
            "probe_before": r4(b.probe), "probe_after": r4(a.probe),
            "probe_interval": None if self.probe_interval is None else [r4(x) for x in self.probe_interval],
            "conversations_to_80": self.conversations_to_80,
            "train_conversations": self.train_conversations, "train_satisfied": self.train_satisfied,
            "heldout_prompts": self.heldout_prompts,
            "teachability": None if self.teachability is None else self.teachability.record(),
            "price": None if self.price is None else self.price.record(self.price_interval),
            "twin_probe": r4(self.twin_probe),
            "probe_vs_twin": None if a.probe is None or self.twin_probe is None else r4(a.probe - self.twin_probe),
            "seconds_by_part": {k: round(v, 1) for k, v in self.parts.items()},
            "dtype": self.dtype,
        }
        versions = [
            {"version": v.version, "rate": r4(v.rate), "on_topic": r4(v.on_topic), "truly": r4(v.truly),
             "probe": r4(v.probe), "samples": v.samples, "conversations": v.conversations,
             "served_truly": r4(v.served), "instruction": v.instruction, "seconds": round(v.seconds, 1)}
            for v in self.versions
        ]
        return report.summary(self, measures, versions)
