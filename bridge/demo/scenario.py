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
from typing import Any

from clawbridge.demo.recipe import Recipe
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
