"""What both demos report the same way: rates per version as a PNG, table cells, gate counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class Series:
    """One line of the plot: (version, rate in [0, 1]) points and how they are drawn."""

    label: str
    points: Sequence[tuple[int, float]]
    style: dict[str, Any] = field(default_factory=dict)


def save_plot(path: Path, title: str, series: Sequence[Series], gate: Sequence[dict[str, Any]]) -> Path:
    """Rates per policy version, in percent; the versions the gate held back as red lines (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for s in series:
        if s.points:
            ax.plot([x for x, _ in s.points], [100 * y for _, y in s.points], label=s.label, **s.style)
    rejected = [g["version"] for g in gate if g["decision"] == "rejected"]
    for x in rejected:
        ax.axvline(x, color="#cf222e", alpha=0.3, lw=1)
    if rejected:
        ax.plot([], [], color="#cf222e", alpha=0.3, label="held back by the gate")
    ax.set_xlabel("policy version")
    ax.set_ylabel("held-out rate (%)")
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def change(before: float | None, after: float | None, interval: tuple[float, float] | None = None) -> str:
    """`5% → 60%`, with the 95 % interval of the difference in points when given."""
    text = f"{pct(before)} → {pct(after)}"
    return text if interval is None else f"{text} [{100 * interval[0]:+.0f}, {100 * interval[1]:+.0f}]"


def difference(before: float, after: float, interval: tuple[float, float]) -> str:
    lo, hi = interval
    return f"{100 * (after - before):+.0f} pts [{100 * lo:+.0f}, {100 * hi:+.0f}]"


def gate_counts(gate: Sequence[dict[str, Any]]) -> str:
    rejected = sum(g["decision"] == "rejected" for g in gate)
    return f"{len(gate) - rejected} / {rejected}"


def r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


class Run(Protocol):
    """What every demo's result holds besides its own measures."""

    scenario: str
    model: str
    method: str
    steps: int
    seconds: float
    eval_samples: int
    gate: list[dict[str, Any]]
    plot: str | None
    examples: list[dict[str, Any]]

    @property
    def improved(self) -> bool: ...


def summary(run: Run, measures: dict[str, Any], versions: list[dict[str, Any]]) -> dict[str, Any]:
    """The `--json` document: what every demo reports, around the demo's own measures and
    per-version figures."""
    return {
        "scenario": run.scenario, "model": run.model, "method": run.method, **measures,
        "improved": run.improved, "steps": run.steps, "versions": versions, "gate": run.gate,
        "seconds": round(run.seconds, 1), "eval_samples": run.eval_samples, "plot": run.plot,
        "examples": run.examples,
    }
