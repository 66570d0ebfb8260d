"""The learning recipe a model gets when the user sets none (docs/configuration.md#learning-recipes).

`Settings`' own defaults are conservative and model-blind. What a user's `clawbridge up` learns
with is chosen here, by the model it trains and the platform it trains on, and applied by
`Settings.load` beneath everything the user says (config file, environment, flags):

    defaults  <  the model's recipe  <  config file  <  environment  <  flags

- **The embedded model on the local backend: measured.** The recipe `make demo` measured on the
  embedded model (docs/measurements.md), adapted to real use: the demo's 40-token answers and its
  64-row decode batch are the demo's, not a user's.
- **Another model whose size its name gives** ("Qwen3-4B", "Llama-3.2-1B"): the same recipe with the
  learning rate and the LoRA rank chosen for its size. Not measured: said so at start.
- **Anything else**: the settings' defaults, said so at start.

Top-k distillation (`opd_topk`, `opd_draws`) needs a backend whose loss sees the teacher's
logits (the local ones); on the others those two stay off.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EMBEDDED = "smollm2-135m-instruct"
EMBEDDED_NAMES = frozenset({EMBEDDED, "smollm2-135m-instruct-32k", "smollm2-135m-instruct-8k"})
TOPK_BACKENDS = frozenset({"local"})  # whose loss sees the teacher's top-k logits

# The learning recipe measured on the embedded model (docs/measurements.md), one line each.
MEASURED: dict[str, Any] = {
    "method": "combine",
    "batch_size": 8,  # a step every eight corrected conversations
    "learning_rate": 1e-3,  # a higher rate cost candidates the general probe; a lower one moved nothing
    "warmup_steps": 0,
    "lora_rank": 16,
    "lora_alpha": 16,  # alpha/rank 1
    "kl_anchor": 0.0,
    "teacher": "base",
    "rewrites": 4,  # the teacher's answers to the hint, one trained as a demonstration per hinted turn
    "w_rewrite": 2.0,  # a rewrite's tokens pushed up twice as hard as an approved answer's
    "w_negative": 0.0,  # pushing corrected answers down drifted the model into non-answers
    "opd_topk": 20,  # each hinted sample learns the teacher's whole top-20 distribution
    "opd_draws": 1,  # ... on one fresh answer of the trained policy
    "opd_draw_max_lift": 0.0,  # only draws the hint is against distil (docs/methods.md)
    "opd_topk_rewrite": True,
    "max_staleness": 5,
    "gate": "on",
    "gate_probes": 16,  # 16 general questions for every candidate ...
    "gate_probes_max": 100,  # ... 100 in all unless those hold it back
    "gate_samples": 1,
    "gate_patience": 3,  # training goes on from up to three held-back candidates while v0 serves
    "gate_blend": (0.75, 0.5),  # a held-back lineage's last candidate, blended toward the base, may serve
}

# what real use adds to the measured recipe on the embedded model on a CPU (the demo's answers stop
# at 40 tokens, a user's at 512)
REAL_USE: dict[str, Any] = {
    "redraw_max_tokens": 128,
    # the demo's sampling temperature: at OpenAI's default 1.0 the embedded model's answers are
    # often not sentences, and the learner trained on them (and on rewrites drawn at it) learned
    # noise rather than the preference (docs/measurements.md)
    "default_temperature": 0.7,
    # the user's corrections come faster than the learner's steps on a CPU: a candidate with a
    # full batch behind it is trained on unjudged, at most two in a row
    "gate_every": 3,
}

# by parameter count (billions, up to): (learning rate, LoRA rank) for a model not measured here;
# LoRA's best rate falls as the model grows (roughly with the square root of its width)
BY_SIZE: tuple[tuple[float, float, int], ...] = (
    (1.0, 5e-4, 16),
    (4.5, 2e-4, 32),
    (15.0, 1e-4, 32),
    (float("inf"), 5e-5, 32),
)

_SIZE = re.compile(r"(?<![0-9.])(\d+(?:\.\d+)?)\s*([bm])(?![a-z])", re.IGNORECASE)


@dataclass(frozen=True)
class LearningRecipe:
    """A model's learning recipe: the settings it sets (flat names) and what backs them."""

    name: str  # what `clawbridge up` says it learns with
    measured: bool
    values: Mapping[str, Any]

    def describe(self) -> str:
        return f"{self.name} ({'measured' if self.measured else 'not measured'})"


def parameters_b(model: str) -> float | None:
    """The model's parameter count in billions, as its name gives it ("Qwen3-4B" -> 4, "SmolLM2-360M"
    -> 0.36); None when the name does not say."""
    sizes = [float(n) * (1.0 if unit.lower() == "b" else 1e-3) for n, unit in _SIZE.findall(model.rsplit("/", 1)[-1])]
    return max(sizes) if sizes else None


def trained_model(backend: str, model: str, cloud: Mapping[str, Any]) -> str:
    """The model the backend trains: the platform's base model on a cloud backend."""
    return {"tinker": cloud.get("tinker_base_model"), "fireworks": cloud.get("fireworks_base_model")}.get(backend) or model


def recipe_for(backend: str, model: str) -> LearningRecipe:
    """The learning recipe of `model` trained on `backend` (pure)."""
    topk = backend in TOPK_BACKENDS
    base = {k: v for k, v in MEASURED.items() if topk or k not in ("opd_topk", "opd_draws", "opd_draw_max_lift", "opd_topk_rewrite")}
    if model in EMBEDDED_NAMES and backend == "local":
        # a user's agent asks for 512 tokens (or sets none): the learner's own draws stop at 128,
        # room for four 20-word answers, where a 512-token draw takes a CPU engine most of a minute
        return LearningRecipe(f"the recipe measured on {EMBEDDED}", True, {**base, **REAL_USE})
    size = parameters_b(model)
    if size is None:
        return LearningRecipe("the settings' defaults (no recipe for this model)", False, {})
    lr, rank = next((lr, rank) for upto, lr, rank in BY_SIZE if size <= upto)
    return LearningRecipe(f"the embedded model's recipe sized for a {size:g}B model", False,
                  {**base, "learning_rate": lr, "lora_rank": rank, "lora_alpha": rank})


__all__ = ["MEASURED", "LearningRecipe", "parameters_b", "recipe_for", "trained_model"]
