"""`clawbridge doctor` checks extras and credentials offline, and never calls a platform."""

from __future__ import annotations

from pathlib import Path

from clawbridge.backends import doctor
from clawbridge.cli.main import app
from typer.testing import CliRunner


def test_missing_credentials_are_reported_with_the_fix(tmp_path: Path) -> None:
    checks = doctor.run_checks({}, tmp_path)
    by_name = {c.name: c for c in checks}
    assert not by_name["tinker credentials"].ok and "TINKER_API_KEY" in by_name["tinker credentials"].detail
    assert "modal token new" in by_name["modal credentials"].detail
    assert all(by_name[f"{b} SDK"].ok for b in ("tinker", "fireworks", "modal"))  # the dev extra installs them


def test_well_formed_keys_pass_and_malformed_ones_say_why(tmp_path: Path) -> None:
    env = {"TINKER_API_KEY": "tml-" + "a" * 30, "MODAL_TOKEN_ID": "ak-123", "MODAL_TOKEN_SECRET": "as-456"}
    assert doctor.ready(doctor.run_checks(env, tmp_path, "tinker"), "tinker")
    assert doctor.ready(doctor.run_checks(env, tmp_path, "modal"), "modal")
    bad = doctor.run_checks({"TINKER_API_KEY": "sk-not-tinker-key-1234567890"}, tmp_path, "tinker")
    assert not doctor.ready(bad, "tinker") and "tml-" in doctor.report(bad)
    half = doctor.run_checks({"MODAL_TOKEN_ID": "ak-123"}, tmp_path, "modal")
    assert not doctor.ready(half, "modal")


def test_a_modal_token_file_counts_as_credentials(tmp_path: Path) -> None:
    (tmp_path / ".modal.toml").write_text('[default]\ntoken_id = "ak-1"\ntoken_secret = "as-2"\n')
    assert doctor.ready(doctor.run_checks({}, tmp_path, "modal"), "modal")


def test_cli_exits_nonzero_when_the_chosen_backend_is_not_ready(monkeypatch) -> None:
    monkeypatch.delenv("FIREWORKS_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["doctor", "--backend", "fireworks"])
    assert result.exit_code == 1 and "FIREWORKS_API_KEY is not set" in result.output
    monkeypatch.setenv("FIREWORKS_API_KEY", "fw_" + "k" * 30)
    result = CliRunner().invoke(app, ["doctor", "--backend", "fireworks"])
    assert result.exit_code == 0, result.output


def test_modal_deploy_without_a_token_stops_before_contacting_modal(monkeypatch, tmp_path) -> None:
    for var in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "none.toml"))
    result = CliRunner().invoke(app, ["modal", "deploy", "--gpu", "H100"])
    assert result.exit_code == 1 and "modal token new" in result.output
