"""The learning recipe `clawbridge up` gives a model (bridge/recipes.py, docs/configuration.md#learning-recipes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clawbridge.config import Settings
from clawbridge.demo.recipe import DEMO_RECIPE
from clawbridge.recipes import MEASURED, parameters_b, recipe_for
from typer.testing import CliRunner


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in [k for k in os.environ if k.startswith("CLAWBRIDGE_")]:
        monkeypatch.delenv(k)


def test_up_on_the_embedded_model_learns_with_the_recipe_the_demo_measured():
    up = Settings.load().flat()
    assert Settings.load().recipe().measured
    for name, value in MEASURED.items():
        assert up[name] == (list(value) if isinstance(value, tuple) else value), name
    # the demo trains with the same learning recipe: one table, not two
    assert {k: DEMO_RECIPE[k] for k in MEASURED} == MEASURED
    # ... while the bare defaults stay model-blind
    assert Settings().training.learning_rate != MEASURED["learning_rate"]
    # real use on a CPU: the learner's draws stop short of an agent's 512-token default (the demo's stop at 40)
    assert up["redraw_max_tokens"] == 128 and DEMO_RECIPE.get("redraw_max_tokens", 0) == 0


def test_what_the_user_sets_outranks_the_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    config = tmp_path / "settings.yaml"
    config.write_text("batch_size: 4\nrewrites: 0\n")
    monkeypatch.setenv("CLAWBRIDGE_LORA_RANK", "8")
    s = Settings.load(config, learning_rate=3e-4)
    assert (s.training.batch_size, s.learning.rewrites, s.training.lora_rank, s.training.learning_rate) == (4, 0, 8, 3e-4)
    assert s.training.opd_topk == MEASURED["opd_topk"]  # the rest is the recipe's


def test_a_model_of_another_size_gets_the_recipe_sized_and_said_unmeasured():
    assert parameters_b("Qwen/Qwen3-4B-Instruct-2507") == 4.0
    assert parameters_b("HuggingFaceTB/SmolLM2-360M-Instruct") == pytest.approx(0.36)
    assert parameters_b("meta-llama/Llama-3.1-70B") == 70.0
    assert parameters_b("tiny-random") is None and parameters_b("gpt2") is None
    big = recipe_for("local", "Qwen/Qwen3-4B-Instruct-2507")
    assert not big.measured and "4B" in big.name
    assert big.values["learning_rate"] < MEASURED["learning_rate"] and big.values["lora_rank"] == 32
    assert recipe_for("local", "tiny-random").values == {}  # nothing chosen: the defaults, said so
    assert not recipe_for("local", "tiny-random").measured


def test_a_cloud_backend_trains_its_own_base_model_without_top_k_distillation():
    s = Settings.load(backend="tinker")
    assert "4B" in s.recipe().name and not s.recipe().measured
    assert s.training.opd_topk == 0 and s.training.opd_draws == 0  # its loss never sees the teacher's logits
    assert s.learning.rewrites == MEASURED["rewrites"]


def test_up_prints_the_settings_and_the_recipe_beneath_them():
    from clawbridge.cli.main import app

    out = CliRunner().invoke(app, ["up", "--print-settings", "--batch-size", "5"])
    assert out.exit_code == 0, out.output
    printed = json.loads(out.stdout)
    assert printed["batch_size"] == 5 and printed["learning_rate"] == MEASURED["learning_rate"]
    assert "learning recipe: the recipe measured on smollm2-135m-instruct (measured)" in out.stderr
