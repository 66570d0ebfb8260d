"""Demo scenarios as data: a simulated user with a hidden preference (docs/learning.md).

A scenario file (YAML or JSON) holds training prompts, held-out prompts the training never sees,
the preference check (regexes that must / must not match, word limits, a finished answer) and the
user's replies when satisfied and when not. The replies are what the offline rules judge reads:
thanks are +1, a correction is -1 and becomes the hint. Built-in scenarios live in
`clawbridge/demo/scenarios/*.yaml`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from clawbridge.learning.probes import DEFAULT_MIN_WORDS, AnswerKey
from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_SCENARIO = "concise"


class HiddenPreference(BaseModel):
    """The hidden preference. Every given condition must hold."""

    model_config = ConfigDict(extra="forbid")

    max_words: int | None = Field(None, ge=1)
    min_words: int | None = Field(None, ge=0)
    must_finish: bool = Field(True, description="The answer ended by itself (not cut at max_tokens).")
    must_match: list[str] = Field(default_factory=list, description="Regexes (Python, searched).")
    must_not_match: list[str] = Field(default_factory=list)

    @field_validator("must_match", "must_not_match")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            re.compile(p)
        return patterns

    def satisfied(self, text: str, finish_reason: str | None) -> bool:
        words = len(text.split())
        if self.must_finish and finish_reason != "stop":
            return False
        if self.max_words is not None and words > self.max_words:
            return False
        if self.min_words is not None and words < self.min_words:
            return False
        if any(not re.search(p, text, re.MULTILINE) for p in self.must_match):
            return False
        return not any(re.search(p, text, re.MULTILINE) for p in self.must_not_match)


DEFAULT_OFF_TOPIC = (
    "That doesn't answer my question. Please answer what I asked: {prompt}",
    "That's not an answer to my question. I asked: {prompt}",
)


class Replies(BaseModel):
    model_config = ConfigDict(extra="forbid")

    satisfied: list[str] = Field(min_length=1)
    unsatisfied: list[str] = Field(min_length=1)
    off_topic: list[str] = Field(
        default_factory=lambda: list(DEFAULT_OFF_TOPIC), min_length=1,
        description="The objection when the answer does not answer the question ({prompt} is the question).",
    )


class Answers(BaseModel):
    """Whether an answer answers the question: reference keywords per prompt (never the
    question's own words) and a minimum length. Prompts without keywords here fall back to the
    built-in answer key (`clawbridge/demo/answer_key.yaml`), then to length and not-an-echo."""

    model_config = ConfigDict(extra="forbid")

    min_words: int = Field(DEFAULT_MIN_WORDS, ge=1)
    keywords: dict[str, list[str]] = Field(default_factory=dict)
    object: bool = Field(
        True, description="The user objects to an answer that does not answer the question. False "
        "makes a careless user who thanks whatever meets the preference (echoes and dodges too): a "
        "harmful run the gate must catch. Truly satisfied is measured either way.",
    )

    @field_validator("keywords", mode="before")
    @classmethod
    def _numbers_are_words(cls, keywords: Any) -> Any:  # (`object` is a field's name here)
        """YAML reads an unquoted `100` or `3.14` as a number, and `true` as a boolean; as a
        keyword each means its text (`load` keeps `yes` and `no` words: YAML 1.2's booleans)."""
        if not isinstance(keywords, dict):
            return keywords
        return {k: [_text(w) for w in ws] if isinstance(ws, list) else ws for k, ws in keywords.items()}


def _text(word: Any) -> Any:
    if isinstance(word, bool):
        return "true" if word else "false"
    return str(word) if isinstance(word, int | float) else word


class Recipe(BaseModel):
    """How the demo trains for this scenario (each maps onto a Settings field or a demo knob).

    The defaults are the recipe measured best on the built-in scenarios (docs/learning.md): a
    scenario with no `recipe` block, or one that sets a few fields, trains as `make demo` does.
    Why each value: the comments here and docs/learning.md#the-recipe-search-what-was-tried."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["binary", "opd", "combine"] = "combine"
    batch_size: int = Field(8, ge=1)
    # four rounds (tried 2026-11-26, session 16) ended lower: a candidate pays a few probe points
    # beyond the price, so the gate holds about every third back, and a fifth round is one more
    # chance for a trained version to serve (docs/learning.md)
    rounds: int = Field(5, ge=1, description="Training steps: each round is batch_size conversations.")
    # lr 2e-3 cost every candidate a third or more of the general probe; below 5e-4 a step does nothing
    learning_rate: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0, description="The rate ramps up over this many steps after every fresh optimizer "
                              "(Settings.warmup_steps).")
    lora_rank: int = Field(16, ge=1)
    temperature: float = Field(0.7, gt=0)
    max_tokens: int = Field(40, ge=1)
    # one answer a prompt read seed 8's v3 at 65 % and its v5 at 30 % (session 17); eight a prompt
    # read both at 35-42 %: two narrow the dice's share of a version's figure for about 8 s more a
    # version (84 s against 44 s of held-out measurement in a run, session 18)
    eval_samples: int = Field(2, ge=1, description="Samples per held-out prompt at each version.")
    teach_samples: int = Field(
        2, ge=1, description="Answers per held-out prompt of v0 asked for the preference, before training "
        "(teachability: how often the teacher the hints make meets it).",
    )
    concurrency: int = Field(16, ge=1, description="Simulated conversations at a time.")
    kl_anchor: float = Field(0.0, ge=0, description="Anchor to the base model (Settings.kl_anchor).")
    # the way to the preference passes through worse candidates: each step's hinted samples learn
    # the teacher's whole top-20 distribution on the trained policy's own fresh answers (on-policy
    # whatever serves); one fresh answer learned as much as four for half the training tokens
    opd_topk: int = Field(20, ge=0, description="Top-k distillation of the teacher (Settings.opd_topk; 0: off).")
    opd_draws: int = Field(1, ge=0, description="Fresh answers per hinted sample distilled on-policy (Settings.opd_draws).")
    # a fresh draw the hint already favours is not distilled: the teacher's distribution along it
    # pulled the student back to the teacher's own rate of the preference once it had passed it
    opd_draw_max_lift: float | None = Field(0.0, description="Only fresh draws the hint is against distil "
                                            "(Settings.opd_draw_max_lift; None: all).")
    opd_topk_rewrite: bool = Field(True, description="The rewrite also learns the teacher's top-k distribution "
                                   "(Settings.opd_topk_rewrite).")
    teacher: Literal["base", "policy"] = Field("base", description="The model the hint is given to: the frozen base "
                                               "or the policy being trained (Settings.teacher).")
    rewrites: int = Field(4, ge=0, le=16, description="Hint-guided rewrites per hinted turn (Settings.rewrites).")
    # a rewrite's tokens pushed up twice as hard: the eight runs of ten that gave no lineage up
    # gained +37.5 to +50 points truly satisfied (fifteen runs at 1: +20 to +45, median +35); it
    # holds the first candidate back on the probe more often, and the two runs that gave their
    # lineage up (before gate_blend) ended at +13 and +8, which the blend answers (docs/learning.md)
    w_rewrite: float = Field(2.0, ge=0, description="Advantage of a rewrite's tokens (Settings.w_rewrite).")
    # pushing the corrected answers down drifted the model into non-answers (docs/methods.md)
    w_negative: float = Field(0.0, ge=0, description="Scale of negative advantages (Settings.w_negative).")
    gate: bool = Field(True, description="Gate every candidate before it serves.")
    # the general probe within the demo's minutes (about 40 s per 100 answers on 2 idle cores): 16
    # questions for every candidate, 100 in all unless those hold it back (both error rates about
    # 10 %, bench/gate_power.py; 200 would give 4 % for twice the gate's time)
    gate_probes: int = Field(16, ge=0, le=200, description="General probe questions the gate asks every candidate.")
    gate_probes_max: int | None = Field(
        100, ge=0, description="General probe questions the gate asks in all: the rest is asked unless the "
        "first gate_probes hold the candidate back beyond doubt (None: the setting's default).",
    )
    gate_samples: int = Field(1, ge=1, description="Answers per gate probe and version.")
    validation_samples: int = Field(
        4, ge=1, description="Answers per validation prompt and version: the gate's check that a candidate keeps "
        "the preference (a handful of prompts: one answer each could not tell 50 % from 10 %).",
    )
    # training goes on from up to three held-back candidates in a row while v0 serves
    gate_patience: int = Field(3, ge=0, description="Held-back candidates in a row training goes on from "
                               "(Settings.gate_patience).")
    # a lineage held back to the end kept its preference in its last candidate, a few probe points
    # too far below the twin: that candidate's delta x 0.75 stood at the twin and kept most of it
    # (bench/blend.py on two given-up runs: truly satisfied 38 and 32 % against the 15 and 10 % the
    # restart from v0 ended at); each alpha tried costs one more judgement of the gate
    gate_blend: list[float] = Field(
        default_factory=lambda: [0.75, 0.5], description="Before a held-back lineage is given up, its last candidate's delta scaled "
        "by each of these (0 < alpha < 1) is judged by the gate; the first accepted serves (Settings.gate_blend).",
    )


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    system: str | None = Field(None, description="An optional system message for every conversation.")
    train_prompts: list[str] = Field(min_length=1)
    heldout_prompts: list[str] = Field(min_length=2)
    check: HiddenPreference
    replies: Replies
    answers: Answers = Field(default_factory=lambda: Answers.model_validate({}))
    validation_prompts: list[str] = Field(
        default_factory=list,
        description="The gate's prompts (never trained on, not held out); default: the last fifth of train_prompts.",
    )
    recipe: Recipe = Field(default_factory=lambda: Recipe.model_validate({}))

    @field_validator("heldout_prompts")
    @classmethod
    def _disjoint(cls, held: list[str], info: object) -> list[str]:
        data = getattr(info, "data", {}) or {}
        overlap = set(held) & set(data.get("train_prompts") or [])
        if overlap:
            raise ValueError(f"held-out prompts must not be training prompts: {sorted(overlap)[:3]}")
        return held

    def messages(self, prompt: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": prompt}]

    def reply(self, preferred: bool, i: int, *, answered: bool = True, prompt: str = "") -> str:
        """The user's next message: thanks only when the preference is met AND the question is
        answered; otherwise the preference's correction, the objection, or both."""
        r = self.replies
        if not self.answers.object:
            answered = True  # the careless user never looks
        if preferred and answered:
            return r.satisfied[i % len(r.satisfied)]
        objection = r.off_topic[i % len(r.off_topic)].replace("{prompt}", prompt)
        if preferred:
            return objection
        correction = r.unsatisfied[i % len(r.unsatisfied)]
        return correction if answered else f"{correction} {objection}"

    def answer_key(self, prompt: str) -> AnswerKey:
        keywords = self.answers.keywords.get(prompt) or answer_key().get(prompt) or []
        return AnswerKey(prompt, tuple(str(k) for k in keywords), self.answers.min_words)

    def rate(self, prompt: str, text: str, finish_reason: str | None) -> Verdict:
        return Verdict(self.check.satisfied(text, finish_reason), self.answer_key(prompt).answered(text))

    @property
    def training_prompts(self) -> list[str]:
        """The prompts the simulated user asks in training (the validation split taken out)."""
        held = set(self.gate_prompts)
        return [p for p in self.train_prompts if p not in held] or list(self.train_prompts)

    @property
    def gate_prompts(self) -> list[str]:
        """The validation split the gate uses: never trained on, and not the held-out set."""
        if self.validation_prompts:
            return list(self.validation_prompts)
        n = len(self.train_prompts) // 5
        return list(self.train_prompts[-n:]) if n >= 2 else []


@dataclass(frozen=True)
class Verdict:
    """The simulated user's view of one answer."""

    preferred: bool  # the hidden preference is met
    answered: bool  # the answer answers the question

    @property
    def truly(self) -> bool:
        return self.preferred and self.answered


@functools.cache
def answer_key() -> dict[str, list[str]]:
    """The built-in reference keywords of the built-in scenarios' prompts."""
    import yaml

    text = resources.files("clawbridge.demo").joinpath("answer_key.yaml").read_text()
    return {str(k): [str(x) for x in v] for k, v in (yaml.safe_load(text) or {}).items()}


def builtin_names() -> list[str]:
    root = resources.files("clawbridge.demo.scenarios")
    return sorted(p.name.rsplit(".", 1)[0] for p in root.iterdir() if p.name.endswith((".yaml", ".json")))


def load(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name, or a YAML/JSON file."""
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml", ".json"} and path.exists():
        text, suffix = path.read_text(), path.suffix
    else:
        root = resources.files("clawbridge.demo.scenarios")
        found = [root / f"{name_or_path}{ext}" for ext in (".yaml", ".json")]
        hit = next((f for f in found if f.is_file()), None)
        if hit is None:
            raise FileNotFoundError(
                f"no scenario {str(name_or_path)!r}: give a .yaml/.json file or one of {builtin_names()}"
            )
        text, suffix = hit.read_text(), ".yaml" if hit.name.endswith(".yaml") else ".json"
    data = json.loads(text) if suffix == ".json" else read_yaml(text)
    return Scenario.model_validate(data)


def read_yaml(text: str) -> Any:
    """YAML with YAML 1.2's booleans: only true and false. PyYAML follows YAML 1.1, where an
    unquoted yes, no, on or off is a boolean too, so a keyword list `[yes, seed]` for "Is a
    tomato a fruit?" would lose its first word."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return yaml.load(text, Loader=Loader)  # a SafeLoader: no arbitrary objects


# --- statistics (pure) -------------------------------------------------------------------------

_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t (two-sided 95 %)."""
    if df < 1:
        return math.inf
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df  # within 0.002 beyond 30


def paired_interval(before: Sequence[float], after: Sequence[float]) -> tuple[float, float, float]:
    """Mean of after − before over held-out prompts (each a per-prompt satisfaction rate) and its
    95 % t-interval. Pairing by prompt removes the prompt-to-prompt spread from the comparison."""
    if len(before) != len(after) or len(before) < 2:
        raise ValueError("need the same held-out prompts before and after, at least two")
    d = [a - b for a, b in zip(after, before, strict=True)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    # rates live in [0, 1], so their difference in [-1, 1]: the interval never claims more
    return mean, max(-1.0, mean - half), min(1.0, mean + half)
