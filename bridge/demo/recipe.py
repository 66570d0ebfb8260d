"""How a demo trains: the settings it overrides and the demo's own knobs.

A scenario's `recipe:` block is one flat mapping. Its keys that are the demo's own knobs (how many
rounds, how many answers a measurement asks, ...: nothing clawbridge itself reads) fill the
recipe model; every other key overrides a setting by its flat name (docs/configuration.md) and
is validated against `Settings`. A scenario's settings are, lowest first: the demo's recipe
(`DEMO_RECIPE`, `TOOLS_RECIPE`), the settings that follow the recipe's other values, the
scenario's overrides, then the command line's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

from clawbridge.config import FLAT, Settings, nest, problems
from clawbridge.recipes import MEASURED
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The preference demo's settings (`clawbridge demo`): the learning recipe `clawbridge up` gives the
# embedded model (`recipes.MEASURED`, measured on the built-in scenarios), and what the demo's
# stack needs. docs/configuration.md tables where the demo and `clawbridge up` differ.
DEMO_RECIPE: dict[str, Any] = {
    # the demo's stack: a free loopback port, the offline rules judge reading the simulated replies
    "host": "127.0.0.1", "port": 0, "judge": "rules",
    "checkpoint_every": 10_000,  # a demo run is minutes long: a checkpoint would only cost time
    "session_idle_timeout_s": 600.0,  # a conversation is over in seconds; the store stays small
    # answers come in bursts of short prompts (a gate's probe, a measurement): more rows a decode
    # step finish them sooner, where an agent's long prompts would hold too much KV (docs/engine.md)
    "engine_max_batch": 64,
    **MEASURED,  # the learning recipe
    # the demo's conversations are answered by the weights alone, so its table is what training
    # learned: served with the instruction, no candidate of its five rounds serves the preference
    # as well as v0 asked for it, plain or with the instruction on top (docs/measurements.md);
    # `--instant` or a scenario's recipe turns it on, and the demo then measures both curves
    # (docs/learning.md#clawbridge-demo)
    "instant_preferences": False,
}

# The tools demo's settings (`clawbridge demo --scenario tools`, docs/agents.md).
TOOLS_RECIPE: dict[str, Any] = {
    "host": "127.0.0.1", "port": 0, "judge": "rules",
    "checkpoint_every": 10_000,
    "session_idle_timeout_s": 600.0,
    "episode_timeout_s": 900.0,  # an episode is seconds long; a lost one expires within the run
    "method": "combine",
    "batch_size": 16,
    "learning_rate": 2e-3,
    "lora_rank": 16,
    "kl_anchor": 0.0,
    "gate": "on",
    "gate_probes": 16,
    "gate_alpha_base": 0.1,  # as the tools demo was measured (docs/agents.md)
    # under the harm test: 16 single answers cannot show a candidate within 5 points of v0
    "gate_v0_test": "harm", "gate_reference": "v0",
    "gate_samples": 1,
    "gate_max_tokens": 48,
}


def check_overrides(values: Mapping[str, Any], knobs: Mapping[str, Any]) -> dict[str, Any]:
    """`values` if each is a setting with a valid value; else a message naming the key."""
    unknown = sorted(k for k in values if k not in FLAT)
    if unknown:
        raise ValueError(f"recipe key(s) {unknown}: neither a demo knob ({', '.join(knobs)}) nor a setting "
                         "(docs/configuration.md lists the settings by these names)")
    try:
        Settings.model_validate(nest(values))  # without the environment: the recipe alone is checked
    except ValidationError as e:
        raise ValueError(f"recipe: {problems(e)}") from None
    return dict(values)


class RecipeKnobs(BaseModel):
    """The demo's own knobs (fields of a subclass) and `settings`: the scenario's overrides of
    settings by flat name, given in the same flat `recipe:` mapping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    settings: dict[str, Any] = Field(default_factory=dict, description="Overrides of settings by flat name.")

    @model_validator(mode="before")
    @classmethod
    def _settings_beside_knobs(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        knobs = {k: v for k, v in data.items() if k in cls.model_fields and k != "settings"}
        overrides = {k: v for k, v in data.items() if k not in cls.model_fields}
        return {**knobs, "settings": {**dict(data.get("settings") or {}), **overrides}}

    @field_validator("settings")
    @classmethod
    def _are_settings(cls, values: dict[str, Any]) -> dict[str, Any]:
        return check_overrides(values, {k: None for k in cls.model_fields if k != "settings"})

    def updated(self, **values: Any) -> Self:
        """This recipe with some knobs or settings changed (by flat name, validated)."""
        return self.model_validate({**self.model_dump(exclude={"settings"}), **self.settings, **values})


class Recipe(RecipeKnobs):
    """How the preference demo asks and measures; the settings it trains with are `DEMO_RECIPE`
    and the scenario's `settings`."""

    # more rounds are more chances for a trained version to serve, each a step of batch_size
    rounds: int = Field(5, ge=1, description="Training steps: each round is batch_size conversations.")
    temperature: float = Field(0.7, gt=0, description="Temperature of the simulated user's requests and the gate's probes.")
    max_tokens: int = Field(40, ge=1, description="max_tokens of the simulated user's requests and the gate's probes.")
    # two answers a prompt narrow the dice's share of a version's figure at a few seconds a version
    eval_samples: int = Field(2, ge=1, description="Samples per held-out prompt at each version.")
    teach_samples: int = Field(
        2, ge=1, description="Answers per held-out prompt of v0 asked for the preference, before training "
        "(teachability: how often the teacher the hints make meets it).",
    )
    concurrency: int = Field(16, ge=1, description="Simulated conversations at a time.")
    validation_samples: int = Field(
        4, ge=1, description="Answers per validation prompt and version: the gate's check that a candidate keeps "
        "the preference (a handful of prompts: one answer each could not tell 50 % from 10 %).",
    )


def following(recipe: Recipe, values: Mapping[str, Any]) -> dict[str, Any]:
    """The preference demo's settings that follow its other values (unless a scenario sets them)."""
    return {
        "lora_alpha": values["lora_rank"],  # alpha/rank 1 whatever rank a scenario trains
        "max_staleness": max(4, recipe.rounds),  # every round's samples may train, however many rounds
        "default_max_tokens": recipe.max_tokens,  # the agent's requests and the probes answer alike
        "gate_max_tokens": recipe.max_tokens,
        "gate_temperature": recipe.temperature,
    }


def recipe_settings(
    base: Mapping[str, Any], follows: Callable[[Mapping[str, Any]], dict[str, Any]], overrides: Mapping[str, Any],
    data_dir: Path, cli: Mapping[str, Any],
) -> Settings:
    """The demo's settings: `base`, what follows it and `overrides`, the scenario's `overrides`,
    then the command line's (`cli`; None: not given)."""
    values = {**base, **follows({**base, **overrides}), **overrides, "data_dir": data_dir}
    values.update({k: v for k, v in cli.items() if v is not None})
    return Settings(**values)


def demo_settings(recipe: Recipe, data_dir: Path, **cli: Any) -> Settings:
    """The preference demo's settings for a scenario's recipe."""
    return recipe_settings(DEMO_RECIPE, lambda v: following(recipe, v), recipe.settings, data_dir, cli)


def tools_following(rounds: int, temperature: float, max_tokens: int, values: Mapping[str, Any]) -> dict[str, Any]:
    """The tools demo's settings that follow its other values (unless a scenario sets them)."""
    return {
        "lora_alpha": values["lora_rank"],  # alpha/rank 1 whatever rank a scenario trains
        "max_staleness": max(4, rounds),  # every round's samples may train, however many rounds
        "default_max_tokens": max_tokens,
        "gate_temperature": temperature,
        "gate_probes_max": values["gate_probes"],  # the first probes decide both ways: a short gate
    }
