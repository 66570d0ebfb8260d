"""Cost metering in each platform's price units, and the `--budget-usd` stop.

Cloud backends report usage after every remote call: tokens prefilled, tokens sampled, tokens
trained (Tinker, Fireworks serverless) or GPU seconds (Modal, Fireworks dedicated). The meter turns
usage into dollars with a price table and keeps the running total. When a budget is set and the
spend reaches it, *training* stops (`check_training` raises `BudgetExceeded`); serving never
consults the budget, so the agent keeps its answers.

Prices differ per model and change over time: the defaults are list-price estimates for small
models, shown in `docs/backends.md`; code that builds a backend itself can pass its own `Prices`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from clawbridge.protocol import BackendError

Activity = Literal["serve", "judge", "score", "train"]


class BudgetExceeded(BackendError):
    """Training stopped: the spend reached `--budget-usd`. Serving goes on."""

    def __init__(self, spent_usd: float, budget_usd: float) -> None:
        self.spent_usd = spent_usd
        self.budget_usd = budget_usd
        super().__init__(
            f"training stopped: spend ${spent_usd:.4f} reached the budget ${budget_usd:.4f} "
            "(serving continues; raise --budget-usd to train further)"
        )


@dataclass(frozen=True)
class Prices:
    """USD per million tokens for each kind of work, and USD per GPU-hour."""

    prefill_per_mtok: float = 0.0
    sample_per_mtok: float = 0.0
    train_per_mtok: float = 0.0
    gpu_per_hour: float = 0.0


# Estimates for ~4-8B models; the platforms price per model (see docs/backends.md).
DEFAULT_PRICES: dict[str, Prices] = {
    "tinker": Prices(prefill_per_mtok=0.07, sample_per_mtok=0.22, train_per_mtok=0.22),
    "fireworks": Prices(prefill_per_mtok=0.20, sample_per_mtok=0.20, train_per_mtok=0.50),
    "fireworks-dedicated": Prices(gpu_per_hour=7.0),
    "modal": Prices(gpu_per_hour=3.95),  # H100 on Modal, per second billing
    "local": Prices(),
}


@dataclass(frozen=True)
class Usage:
    """What one remote call consumed."""

    prefill_tokens: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    gpu_seconds: float = 0.0


def cost_usd(usage: Usage, prices: Prices) -> float:
    """Dollars for one usage record (pure)."""
    return (
        usage.prefill_tokens * prices.prefill_per_mtok
        + usage.sampled_tokens * prices.sample_per_mtok
        + usage.trained_tokens * prices.train_per_mtok
    ) / 1e6 + usage.gpu_seconds * prices.gpu_per_hour / 3600.0


@dataclass
class _Totals:
    prefill_tokens: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    gpu_seconds: float = 0.0
    usd: float = 0.0


@dataclass
class CostMeter:
    """Running spend of one backend. Thread-safe: SDK callbacks may run on other threads."""

    platform: str
    prices: Prices
    budget_usd: float | None = None
    path: Path | None = None  # where `clawbridge status` reads the spend (JSON)
    _by_activity: dict[str, _Totals] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def for_platform(
        cls, platform: str, budget_usd: float | None = None, path: Path | None = None,
        prices: Prices | None = None,
    ) -> CostMeter:
        meter = cls(platform, prices or DEFAULT_PRICES.get(platform, Prices()), budget_usd, path)
        if path is not None and path.exists():
            meter._restore(json.loads(path.read_text()))
        return meter

    def record(self, activity: Activity, usage: Usage) -> float:
        """Add one call's usage; returns its cost in USD."""
        usd = cost_usd(usage, self.prices)
        with self._lock:
            t = self._by_activity.setdefault(activity, _Totals())
            t.prefill_tokens += usage.prefill_tokens
            t.sampled_tokens += usage.sampled_tokens
            t.trained_tokens += usage.trained_tokens
            t.gpu_seconds += usage.gpu_seconds
            t.usd += usd
        self._persist()
        return usd

    @property
    def spent_usd(self) -> float:
        with self._lock:
            return sum(t.usd for t in self._by_activity.values())

    @property
    def training_allowed(self) -> bool:
        return self.budget_usd is None or self.spent_usd < self.budget_usd

    def check_training(self) -> None:
        """Called before every training step; serving never calls it."""
        if not self.training_allowed:
            assert self.budget_usd is not None
            raise BudgetExceeded(self.spent_usd, self.budget_usd)

    def snapshot(self) -> dict[str, object]:
        """What `clawbridge status` shows."""
        with self._lock:
            by = {k: asdict(v) for k, v in self._by_activity.items()}
        spent = sum(float(v["usd"]) for v in by.values())
        return {
            "platform": self.platform,
            "spent_usd": round(spent, 6),
            "budget_usd": self.budget_usd,
            "training_allowed": self.budget_usd is None or spent < self.budget_usd,
            "by_activity": by,
            "prices": asdict(self.prices),
        }

    def _persist(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot(), indent=1))
        tmp.replace(self.path)

    def _restore(self, data: dict[str, object]) -> None:
        by = data.get("by_activity")
        if isinstance(by, dict):
            for k, v in by.items():
                self._by_activity[k] = _Totals(**v)


def read_spend(path: Path) -> dict[str, object] | None:
    """The last persisted snapshot (for `clawbridge status`), or None when nothing was spent."""
    return json.loads(path.read_text()) if path.exists() else None
