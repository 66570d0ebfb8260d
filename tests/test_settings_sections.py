"""One settings object with nested sections: every setting declared once, reached by its flat
name from flags, the `CLAWBRIDGE_*` environment and a config file, with flags > environment >
file > defaults; the demos' recipes are validated overrides of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from clawbridge.config import FLAT, SECTIONS, Settings, environment_values, nest
from pydantic import ValidationError
from typer.testing import CliRunner

GOLDEN = Path(__file__).parent / "data" / "demo_settings.json"


def value(s: Settings, name: str) -> Any:
    sec = FLAT[name]
    return getattr(getattr(s, sec), name) if sec else getattr(s, name)


def test_every_setting_is_declared_once_and_has_one_flat_name():
    declared = [n for n in Settings.model_fields if n not in SECTIONS]
    for model in SECTIONS.values():
        declared += list(model.model_fields)
    assert len(declared) == len(set(declared)) == len(FLAT)
    assert not set(FLAT) & set(SECTIONS)


def test_a_flat_name_reaches_its_section():
    s = Settings(batch_size=3, prm_votes=5, gate_margin=0.2, w_opd=0.5, engine_max_batch=7, num_gpus=2,
                 judge_url="http://127.0.0.1:9/v1", port=8080, modal_gpu="A100")
    assert (s.training.batch_size, s.judging.prm_votes, s.gating.gate_margin, s.learning.w_opd) == (3, 5, 0.2, 0.5)
    assert (s.engine.engine_max_batch, s.gpus.num_gpus, s.serving.port, s.cloud.modal_gpu) == (7, 2, 8080, "A100")
    assert s.judging.kind == "http" and Settings().judging.kind == "rules"
    assert s.loss == s.training.loss and s.optim.learning_rate == s.training.learning_rate
    assert Settings(training={"batch_size": 4}).training.batch_size == 4  # a section's nested keys


def test_every_flat_name_is_read_from_its_environment_variable(monkeypatch: pytest.MonkeyPatch):
    for name in FLAT:
        default = value(Settings(), name)
        if isinstance(default, bool) and name != "train":
            monkeypatch.setenv(f"CLAWBRIDGE_{name.upper()}", "false" if default else "true")
            assert value(Settings(), name) is (not default), name
            monkeypatch.delenv(f"CLAWBRIDGE_{name.upper()}")
    monkeypatch.setenv("CLAWBRIDGE_GATE_BLEND", "[0.75, 0.5]")
    monkeypatch.setenv("PORT", "8123")
    monkeypatch.setenv("CLAWBRIDGE_ENGINE_DTYPE", "fp32")
    s = Settings.load()
    assert s.training.gate_blend == (0.75, 0.5) and s.serving.port == 8123 and s.engine.engine_dtype == "fp32"
    assert environment_values({"CLAWBRIDGE_LORA_RANK": "8"}) == {"training": {"lora_rank": "8"}}


def test_flags_outrank_the_environment_which_outranks_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
):
    config = tmp_path / "settings.yaml"
    config.write_text("batch_size: 4\nprm_votes: 5\ngate_margin: 0.2\nlearning:\n  w_opd: 0.5\n")
    monkeypatch.setenv("CLAWBRIDGE_BATCH_SIZE", "8")
    monkeypatch.setenv("CLAWBRIDGE_PRM_VOTES", "7")
    s = Settings.load(config, batch_size=2, gate_margin=None)
    assert s.training.batch_size == 2  # the flag
    assert s.judging.prm_votes == 7  # the environment over the file
    assert s.gating.gate_margin == 0.2 and s.learning.w_opd == 0.5  # the file (flat and nested)
    assert s.training.max_staleness == 5  # the embedded model's learning recipe (bridge/recipes.py)
    assert s.training.checkpoint_every == 10  # the default
    as_json = tmp_path / "settings.json"
    as_json.write_text(json.dumps({"gate_probes": 9}))
    assert Settings.load(as_json).gating.gate_probes == 9


def test_an_unknown_or_doubled_key_fails_and_says_which(tmp_path: Path):
    from clawbridge.config import problems

    config = tmp_path / "settings.yaml"
    config.write_text("batch_sise: 4\n")
    with pytest.raises(ValidationError) as e:
        Settings.load(config)
    assert "unknown setting 'batch_sise'" in problems(e.value)
    with pytest.raises(ValidationError) as e:
        Settings(training={"gate_probes": 3})  # a setting in a section it is not in
    assert "unknown setting 'gate_probes'" in problems(e.value)
    with pytest.raises(ValueError, match="given twice"):
        nest({"batch_size": 2, "training": {"batch_size": 3}})
    with pytest.raises(ValidationError) as e:
        Settings(gate_probes=500)
    assert problems(e.value).startswith("gate_probes: ")


def test_the_flags_of_clawbridge_up_reach_the_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from clawbridge import server
    from clawbridge.cli.main import app

    seen: list[Settings] = []

    def run(settings: Settings, **_: Any) -> None:  # stands in for uvicorn: the flags are under test
        seen.append(settings)

    monkeypatch.setattr(server, "run", run)
    monkeypatch.setenv("CLAWBRIDGE_GATE_PROBES", "7")
    monkeypatch.setenv("CLAWBRIDGE_BATCH_SIZE", "9")
    r = CliRunner().invoke(app, ["up", "--no-train", "--data-dir", str(tmp_path), "--batch-size", "6",
                                 "--method", "opd", "--judge", "rules", "--lr", "0.001", "--port", "8011"])
    assert r.exit_code == 0, r.output
    [s] = seen
    assert s.training.batch_size == 6 and s.training.method == "opd" and s.serving.port == 8011
    assert s.training.optim.learning_rate == 0.001 and s.judging.kind == "rules"
    assert s.gating.gate_probes == 7 and s.train is False and s.data_dir == tmp_path
    bad = tmp_path / "bad.yaml"
    bad.write_text("gate_probe: 3\n")
    r = CliRunner().invoke(app, ["up", "--config", str(bad)])
    assert r.exit_code == 2 and "unknown setting 'gate_probe'" in r.output


def test_the_engine_settings_reach_the_local_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from clawbridge.backends.local import LocalBackend

    monkeypatch.setenv("CLAWBRIDGE_ENGINE_MAX_BATCH", "3")
    backend = LocalBackend.from_settings(Settings(data_dir=tmp_path, engine_dtype="fp32"))
    assert backend.engine.max_batch == 3


def _flat(s: Settings) -> dict[str, Any]:
    d = s.flat()
    d.pop("cache_dir")  # the user's cache: not the recipe's
    return d


def test_the_built_in_scenarios_train_with_the_settings_they_always_had():
    """A dump (field by field) of the settings the built-in scenarios trained with before their
    recipes became overrides of the settings: the same values, every one."""
    from clawbridge.demo import scenario, tools
    from clawbridge.demo.runner import demo_settings

    golden = json.loads(GOLDEN.read_text())
    built = {name: _flat(demo_settings(scenario.load(name), Path("demo-data"), model=None, seed=0))
             for name in ("concise", "one_sentence")}
    agentic = tools.load("tools")
    assert agentic is not None
    built["tools"] = _flat(tools.tools_settings(agentic, Path("demo-data"), model=None, seed=0))
    sc = scenario.load("concise")  # `clawbridge demo --method opd --rounds 7 --model tiny-random --seed 3`
    sc = sc.model_copy(update={"recipe": sc.recipe.model_copy(update={"rounds": 7})})
    built["concise_opd_rounds7_seed3"] = _flat(demo_settings(sc, Path("demo-data"), model="tiny-random", seed=3,
                                                             method="opd"))
    added = {k: _flat(Settings())[k] for k in set(_flat(Settings())) - set(golden["concise"])}
    assert set(added) == {"spool_dir", "spool_max_mb", "spool_full", "store_write_timeout_s",
                          "instant_preferences", "retire_share", "restore_share", "retire_samples",
                          "adapter_memory_mb", "engine_user_first", "engine_background_share", "redraw_max_tokens",
                          "api_keys_file", "trust_body_user", "gate_every", "default_temperature"}  # settings added since
    # the preference demos answer with the weights alone, as they always did: no instruction served
    as_before = {"instant_preferences": False}
    for name, want in golden.items():
        got = built[name]
        assert {k: got.get(k) for k in want} == want, name
        assert set(got) == set(want) | set(added), name
        kept = {**added, **(as_before if name != "tools" else {})}
        assert {k: got[k] for k in added} == kept, name  # a new setting at its default, or as the demo ran


def test_a_recipe_is_demo_knobs_and_validated_setting_overrides():
    from clawbridge.demo.recipe import DEMO_RECIPE, Recipe, demo_settings
    from clawbridge.demo.tools_scenario import ToolsRecipe

    r = Recipe.model_validate({"rounds": 3, "opd_draws": 4, "lora_rank": 8})
    assert r.rounds == 3 and r.settings == {"opd_draws": 4, "lora_rank": 8}
    s = demo_settings(r, Path("d"))
    assert s.training.opd_draws == 4 and s.training.lora_rank == s.training.lora_alpha == 8
    assert s.training.max_staleness == 4 and s.gating.gate_max_tokens == r.max_tokens
    assert s.training.learning_rate == DEMO_RECIPE["learning_rate"] != Settings().training.learning_rate
    assert demo_settings(r.updated(lora_alpha=32), Path("d")).training.lora_alpha == 32  # visible, overridable
    for bad, says in (({"batch_sise": 3}, "neither a demo knob"), ({"gate_probes": 500}, "gate_probes"),
                      ({"gate": True}, "gate"), ({"gate_blend": [1.5]}, "gate_blend")):
        with pytest.raises(ValueError, match=says):
            Recipe.model_validate(bad)
    with pytest.raises(ValueError, match="neither a demo knob"):
        ToolsRecipe.model_validate({"eval_sample": 3})
    for key in DEMO_RECIPE:
        assert key in FLAT, key
    for knob in (*Recipe.model_fields, *ToolsRecipe.model_fields):
        assert knob not in FLAT, f"the recipe's {knob} shadows a setting"


def test_the_demo_prints_the_settings_its_recipe_makes():
    from clawbridge.cli.main import app

    r = CliRunner().invoke(app, ["demo", "--scenario", "one_sentence", "--print-settings", "--method", "opd"])
    assert r.exit_code == 0, r.output
    printed = json.loads(r.output)
    assert printed["opd_draws"] == 4 and printed["method"] == "opd" and printed["engine_max_batch"] == 64
    assert set(printed) == set(FLAT)


def test_the_demo_serves_the_weights_alone_unless_asked_to_serve_as_clawbridge_up_does():
    """The demo's recipe turns instant preferences off (docs/learning.md#clawbridge-demo);
    `--instant` turns them on as `clawbridge up` has them, and the tools scenario refuses it."""
    from clawbridge.cli.main import app

    plain = CliRunner().invoke(app, ["demo", "--print-settings"])
    instant = CliRunner().invoke(app, ["demo", "--print-settings", "--instant"])
    assert plain.exit_code == 0 and instant.exit_code == 0, (plain.output, instant.output)
    assert json.loads(plain.output)["instant_preferences"] is False
    assert json.loads(instant.output)["instant_preferences"] is True
    refused = CliRunner().invoke(app, ["demo", "--scenario", "tools", "--instant"])
    assert refused.exit_code == 2 and "--instant does not apply" in refused.output
