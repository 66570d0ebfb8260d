"""The settings sections each part of the learner takes: built from the one loaded settings
object, so the flags, the `CLAWBRIDGE_*` environment and the config file reach them by the flat
names docs/configuration.md lists."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from clawbridge.config import (
    GateSettings,
    JudgeSettings,
    LearningSettings,
    Settings,
    TrainingSettings,
)
from typer.testing import CliRunner

SECTIONS = {"learning": LearningSettings, "training": TrainingSettings, "judging": JudgeSettings,
            "gating": GateSettings}


def test_every_field_of_a_section_is_a_setting_of_the_same_value():
    s = Settings(batch_size=3, prm_votes=5, gate_margin=0.2, w_opd=0.5, judge_url="http://127.0.0.1:9/v1")
    for name, cls in SECTIONS.items():
        sec = getattr(s, name)
        assert isinstance(sec, cls)
        for f in fields(cls):
            assert f.name in Settings.model_fields, f"{cls.__name__}.{f.name} is no setting"
            assert getattr(sec, f.name) == getattr(s, f.name)
    assert s.training.loss == s.loss and s.training.optim == s.optim
    assert s.judging.kind == "http" and Settings().judging.kind == "rules"


def test_flags_outrank_the_environment_which_outranks_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
):
    config = tmp_path / "settings.yaml"
    config.write_text("batch_size: 4\nprm_votes: 5\ngate_margin: 0.2\nw_opd: 0.5\n")
    monkeypatch.setenv("CLAWBRIDGE_BATCH_SIZE", "8")
    monkeypatch.setenv("CLAWBRIDGE_PRM_VOTES", "7")
    s = Settings.load(config, batch_size=2)
    assert s.training.batch_size == 2  # the flag
    assert s.judging.prm_votes == 7  # the environment over the file
    assert s.gating.gate_margin == 0.2 and s.learning.w_opd == 0.5  # the file


def test_the_flags_of_clawbridge_up_reach_the_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from clawbridge import server
    from clawbridge.cli.main import app

    seen: list[Settings] = []

    def run(settings: Settings, **_: Any) -> None:  # stands in for uvicorn: the flags are under test
        seen.append(settings)

    monkeypatch.setattr(server, "run", run)
    monkeypatch.setenv("CLAWBRIDGE_GATE_PROBES", "7")
    r = CliRunner().invoke(app, ["up", "--no-train", "--data-dir", str(tmp_path), "--batch-size", "6",
                                 "--method", "opd", "--judge", "rules", "--lr", "0.001"])
    assert r.exit_code == 0, r.output
    [s] = seen
    assert s.training.batch_size == 6 and s.training.method == "opd" and s.learning.method == "opd"
    assert s.training.optim.learning_rate == 0.001 and s.judging.kind == "rules"
    assert s.gating.gate_probes == 7


def test_the_engine_settings_reach_the_local_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from clawbridge.backends.local import LocalBackend

    monkeypatch.setenv("CLAWBRIDGE_ENGINE_MAX_BATCH", "3")
    backend = LocalBackend.from_settings(Settings(data_dir=tmp_path, engine_dtype="fp32"))
    assert backend.engine.max_batch == 3
