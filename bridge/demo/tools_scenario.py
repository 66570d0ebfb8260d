"""The tools demo's scenario as data: the task ("What is Maya's secret code?"), the lookup tool
that answers it, the names trained on and held out, and the recipe (`clawbridge demo --scenario
tools`, or a YAML/JSON file with `kind: tools`)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from clawbridge.demo.recipe import RecipeKnobs
from pydantic import BaseModel, ConfigDict, Field, field_validator

NAME = "tools"
CODE = re.compile(r"(?<!\d)\d{4}(?!\d)")

TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the secret code of a person by name.",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string", "description": "the person's name"}},
            "required": ["name"],
        },
    },
}

_NAMES = [  # one per line: the diff of a changed name stays readable
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Frank",
    "Grace",
    "Henry",
    "Irene",
    "Jack",
    "Karen",
    "Liam",
    "Mia",
    "Noah",
    "Olivia",
    "Peter",
    "Quinn",
    "Rachel",
    "Sam",
    "Tina",
    "Umar",
    "Vera",
    "Walter",
    "Xena",
    "Yusuf",
    "Amber",
    "Bruno",
    "Chloe",
    "Dylan",
    "Elena",
    "Felix",
    "Gina",
    "Hugo",
    "Ivy",
    "James",
    "Kate",
    "Leo",
    "Nora",
    "Oscar",
    "Paula",
    "Ruth",
    "Simon",
    "Tom",
    "Ursula",
    "Victor",
    "Wendy",
    "Zack",
    "Anna",
    "Ben",
    "Clara",
    "Daniel",
    "Eva",
    "Fiona",
    "George",
    "Hannah",
    "Isaac",
    "Julia",
    "Kevin",
    "Laura",
    "Martin",
    "Nina",
    "Owen",
    "Rosa",
    "Steve",
]


class Example(BaseModel):
    """The worked example every conversation opens with (a call, its result, the answer)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "Zoe"
    code: str = "4821"


class ToolsRecipe(RecipeKnobs):
    """How the tools demo asks and measures; the settings it trains with are `TOOLS_RECIPE`
    (`clawbridge.demo.recipe`) and the scenario's `settings`."""

    n: int = Field(8, ge=2, description="Episodes (attempts) per group, i.e. per training task.")
    groups: int = Field(4, ge=1, description="Groups (training tasks) per round.")
    rounds: int = Field(
        2, ge=1, description="Rounds; a round ends once the trainer took every full batch."
    )
    temperature: float = Field(0.8, gt=0, description="Temperature of each model call and the gate's probes.")
    max_tokens: int = Field(40, ge=1, description="max_tokens of each model call.")
    max_steps: int = Field(
        2,
        ge=1,
        description="Model calls per episode at most: a lookup and the answer (a second lookup "
        "runs out of steps and earns nothing).",
    )
    partial_credit: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="Outcome of an episode that looked up the right name and then answered, "
        "but not with the code (1.0 for a solved task, else 0: an episode whose steps ran out "
        "earns nothing, so repeating the lookup is never paid).",
    )
    hint: str | None = Field(
        None,
        description="A hint the agent gives on the first step of an episode that did not look up the "
        "right name ({name}: the person); with it, that step trains with hint OPD on top of its group "
        "advantage (docs/agents.md#hints-opd). None: outcomes alone.",
    )
    eval_samples: int = Field(
        3, ge=1, description="Episodes per held-out task at each evaluated version."
    )
    evaluate_each_round: bool = Field(
        False, description="Also evaluate the versions between the first and last."
    )
    concurrency: int = Field(16, ge=1, description="Episodes at a time.")
    extra_groups: int = Field(
        8, ge=0, description="More groups a round may run when its groups gave no full batch."
    )
    probe: bool = Field(
        True, description="Ask the general probe set of v0 and of the last version."
    )


class ToolsScenario(BaseModel):
    """An agentic scenario: tasks solved with a lookup tool, scored by a deterministic checker."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["tools"] = "tools"
    name: str = NAME
    description: str = (
        "look up a person's secret code with a tool, then answer with it "
        "(GRPO on outcomes, groups through the SDK)"
    )
    system: str = (
        "You answer questions about people's secret codes. Call the lookup tool to find "
        "the code, then answer with the code."
    )
    templates: list[str] = Field(
        default_factory=lambda: [
            "What is {name}'s secret code?",
            "I need the secret code of {name}.",
            "Tell me {name}'s secret code, please.",
            "Which secret code does {name} have?",
        ],
        min_length=1,
        description="Questions; {name} is the person.",
    )
    example: Example = Field(default_factory=Example)
    salt: str = Field(
        default="clawbridge-tools-1", description="Codes are a hash of salt and name (4 digits)."
    )
    train_names: list[str] = Field(default_factory=lambda: _NAMES[:-16], min_length=1)
    heldout_names: list[str] = Field(default_factory=lambda: _NAMES[-16:], min_length=2)
    recipe: ToolsRecipe = Field(default_factory=lambda: ToolsRecipe.model_validate({}))

    @field_validator("heldout_names")
    @classmethod
    def _disjoint(cls, held: list[str], info: object) -> list[str]:
        data = getattr(info, "data", {}) or {}
        overlap = {h.lower() for h in held} & {t.lower() for t in data.get("train_names") or []}
        if overlap:
            raise ValueError(f"held-out names must not be training names: {sorted(overlap)[:3]}")
        return held

    def code(self, name: str) -> str:
        if name.lower() == self.example.name.lower():
            return self.example.code
        digest = hashlib.sha256(f"{self.salt}:{name.lower()}".encode()).digest()
        return str(1000 + int.from_bytes(digest[:4], "big") % 9000)

    def directory(self) -> dict[str, str]:
        """What the lookup tool knows: every name of the scenario."""
        names = [self.example.name, *self.train_names, *self.heldout_names]
        return {n.lower(): n for n in names}

    def task(self, name: str, i: int) -> Task:
        return Task(
            name, self.templates[i % len(self.templates)].format(name=name), self.code(name)
        )

    @property
    def train_tasks(self) -> list[Task]:
        return [self.task(n, i) for i, n in enumerate(self.train_names)]

    @property
    def heldout_tasks(self) -> list[Task]:
        return [self.task(n, i) for i, n in enumerate(self.heldout_names)]

    def messages(self, task: Task) -> list[dict[str, Any]]:
        """System, the worked example, the question."""
        ex = self.example
        call = {
            "id": "call_example",
            "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"name": ex.name})},
        }
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.templates[0].format(name=ex.name)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_example", "content": self.lookup(ex.name)},
            {"role": "assistant", "content": f"{ex.name}'s secret code is {ex.code}."},
            {"role": "user", "content": task.question},
        ]

    def lookup(self, name: str) -> str:
        known = self.directory().get(name.strip().lower())
        if known is None:
            return f"error: no person named {name!r}"
        return f"{known}'s secret code is {self.code(known)}."

    def run_tool(self, name: str, arguments: str) -> tuple[str, str | None, bool]:
        """(result text, the name looked up, whether the call was valid) of one tool call."""
        if name != "lookup":
            return f"error: unknown tool {name!r}; the only tool is lookup", None, False
        try:
            args = json.loads(arguments or "{}")
        except ValueError as e:
            return f"error: arguments are not JSON ({e})", None, False
        who = args.get("name") if isinstance(args, dict) else None
        if not isinstance(who, str) or not who.strip():
            return 'error: lookup needs {"name": "<person>"}', None, False
        result = self.lookup(who)
        return result, who.strip(), not result.startswith("error")


def load(name_or_path: str | Path) -> ToolsScenario | None:
    """The built-in tools scenario by name, or a YAML/JSON file with `kind: tools`; None for
    anything else (then it is a preference scenario of `clawbridge.demo.scenario`)."""
    if str(name_or_path) == NAME:
        return ToolsScenario()
    path = Path(name_or_path)
    if path.suffix not in {".yaml", ".yml", ".json"} or not path.is_file():
        return None
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict) or data.get("kind") != "tools":
        return None
    return ToolsScenario.model_validate(data)


@dataclass(frozen=True)
class Task:
    name: str
    question: str
    code: str
