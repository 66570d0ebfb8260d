"""Cost metering in platform units and the training budget (serving never stops)."""

from __future__ import annotations

from pathlib import Path

import pytest
from clawbridge.backends.costs import BudgetExceeded, CostMeter, Prices, Usage, cost_usd, read_spend


def test_cost_adds_each_kind_of_work_at_its_price() -> None:
    prices = Prices(prefill_per_mtok=1.0, sample_per_mtok=2.0, train_per_mtok=3.0, gpu_per_hour=3600.0)
    usage = Usage(prefill_tokens=1_000_000, sampled_tokens=500_000, trained_tokens=100_000, gpu_seconds=2.0)
    assert cost_usd(usage, prices) == pytest.approx(1.0 + 1.0 + 0.3 + 2.0)


def test_meter_accumulates_by_activity() -> None:
    meter = CostMeter.for_platform("tinker", prices=Prices(sample_per_mtok=1.0, train_per_mtok=2.0))
    meter.record("serve", Usage(sampled_tokens=1_000_000))
    meter.record("train", Usage(trained_tokens=500_000))
    snap = meter.snapshot()
    assert snap["spent_usd"] == pytest.approx(2.0)
    assert snap["by_activity"]["serve"]["sampled_tokens"] == 1_000_000  # type: ignore[index]


def test_budget_stops_training_once_reached_but_not_before() -> None:
    meter = CostMeter.for_platform("tinker", budget_usd=1.0, prices=Prices(train_per_mtok=1.0))
    meter.record("train", Usage(trained_tokens=999_999))
    meter.check_training()  # just under: still allowed
    meter.record("serve", Usage(trained_tokens=1))  # serving spend counts toward the budget
    assert not meter.training_allowed
    with pytest.raises(BudgetExceeded, match="serving continues"):
        meter.check_training()


def test_no_budget_never_stops_training() -> None:
    meter = CostMeter.for_platform("modal")
    meter.record("train", Usage(gpu_seconds=1e6))
    meter.check_training()


def test_spend_is_persisted_for_status_and_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    meter = CostMeter.for_platform("modal", budget_usd=10.0, path=path)
    meter.record("train", Usage(gpu_seconds=3600.0))
    shown = read_spend(path)
    assert shown is not None and shown["spent_usd"] == pytest.approx(3.95)
    again = CostMeter.for_platform("modal", budget_usd=10.0, path=path)
    assert again.spent_usd == pytest.approx(3.95)
