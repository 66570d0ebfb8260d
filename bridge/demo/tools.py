"""`clawbridge demo --scenario tools`: an agent learns to use a tool from its own episodes.

The task: "What is Maya's secret code?". Nobody can guess a code; the agent must call the
`lookup` tool with the person's name (OpenAI tool calling), read the result and answer with the
code. The system message says so and the conversation opens with one worked example (a call for
Zoe, its result, the answer), which is what makes the embedded 135 M model try at all.

    start the stack (local backend, store, proxy, learner) on a free loopback port
    evaluate policy@v0 on held-out tasks (names never trained on; sessions with X-Train: false)
    repeat `rounds` times:
        open `groups` groups with the SDK (`cb.async_group(n, task)`), one per training task; each
        of the n episodes is an OpenAI tool-calling loop (request, run the calls, send the results
        back, until the model answers in text); the outcome checker scores it and `ep.outcome(x)`
        reports it; leaving the block closes the group
        clawbridge turns each group into GRPO samples (outcomes normalised within the group) and
        trains; a round ends once the trainer has taken every full batch
    evaluate the last served version on the same held-out tasks
    report before/after with a paired 95 % interval over held-out tasks, a PNG, a JSON summary

Nothing here trains directly: the demo is an agent using the public SDK and OpenAI API.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from clawbridge.config import Settings
from clawbridge.demo.runner import DemoResult, Progress, VersionEval, _step_of, _steps, demo_stack
from clawbridge.demo.scenario import paired_interval
from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from clawbridge.learning.learner import Learner
    from clawbridge.sdk.client import Client
    from clawbridge.server import Running
    from openai import AsyncOpenAI

log = logging.getLogger(__name__)

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

_NAMES = [
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


class ToolsRecipe(BaseModel):
    """How the tools demo trains (each maps onto a Settings field or a demo knob)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(8, ge=2, description="Episodes (attempts) per group, i.e. per training task.")
    groups: int = Field(4, ge=1, description="Groups (training tasks) per round.")
    rounds: int = Field(
        2, ge=1, description="Rounds; a round ends once the trainer took every full batch."
    )
    batch_size: int = Field(16, ge=1, description="Samples (assistant turns) per training step.")
    learning_rate: float = Field(2e-3, gt=0)
    lora_rank: int = Field(16, ge=1)
    temperature: float = Field(0.8, gt=0)
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
    kl_anchor: float = Field(0.0, ge=0)
    gate: bool = Field(
        True, description="Gate every candidate (on the general probe set) before it serves."
    )
    gate_probes: int = Field(16, ge=1, le=50)
    gate_probes_max: int | None = Field(
        None,
        ge=1,
        le=50,
        description="General probes the gate asks in all when the first gate_probes leave doubt; "
        "None: gate_probes, never more (asking all 50 cost about 100 s of a 12-minute run).",
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


# --- episodes and the outcome checker -----------------------------------------------------------


@dataclass(frozen=True)
class Task:
    name: str
    question: str
    code: str


@dataclass
class Call:
    name: str
    arguments: str
    result: str
    looked_up: str | None
    valid: bool


@dataclass
class Transcript:
    """What one episode did: its tool calls and its final answer."""

    task: Task
    calls: list[Call] = field(default_factory=list)
    answer: str = ""
    finish: str | None = None  # of the final model call ("tool_calls" when the steps ran out)
    turn_ids: list[str] = field(
        default_factory=list
    )  # each model call's stored turn (choices[0].turn_id)

    def text(self) -> str:
        parts = [
            f"lookup({c.arguments}) -> {c.result}"
            if c.name == "lookup"
            else f"{c.name}({c.arguments}) -> {c.result}"
            for c in self.calls
        ]
        return " | ".join([*parts, f"answer [{self.finish}]: {self.answer!r}"])


@dataclass(frozen=True)
class Grade:
    """The outcome checker's verdict on one episode (deterministic)."""

    success: bool  # the final text answer gives the task's code and no other 4-digit number
    clean: bool  # success, with a finished answer and no failed tool call
    looked_up: bool  # a valid lookup of the task's name
    reward: float  # the outcome the episode reports


def grade(t: Transcript, partial_credit: float) -> Grade:
    looked_up = any(
        c.valid and c.looked_up is not None and c.looked_up.lower() == t.task.name.lower()
        for c in t.calls
    )
    answered = t.finish != "tool_calls"
    success = answered and set(CODE.findall(t.answer)) == {t.task.code}
    clean = success and t.finish == "stop" and all(c.valid for c in t.calls)
    # partial credit only for an episode that answered: a lookup loop that runs out of steps gets 0
    reward = 1.0 if success else partial_credit if looked_up and answered else 0.0
    return Grade(success, clean, looked_up, reward)


async def attempt(client: AsyncOpenAI, model: str, sc: ToolsScenario, task: Task) -> Transcript:
    """One episode: the ordinary OpenAI tool-calling loop any agent runs."""
    r = sc.recipe
    messages = sc.messages(task)
    out = Transcript(task)
    for _ in range(r.max_steps):
        resp = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=[TOOL],  # type: ignore[list-item]
            max_tokens=r.max_tokens,
            temperature=r.temperature,
        )
        choice = resp.choices[0]
        msg = choice.message
        out.finish = choice.finish_reason
        turn_id = (choice.model_extra or {}).get("turn_id")
        if isinstance(turn_id, str):
            out.turn_ids.append(turn_id)
        if not msg.tool_calls:
            out.answer = msg.content or ""
            return out
        # Replay the call exactly, then one result per call: they are the turn's next state.
        messages.append(msg.model_dump(exclude_none=True))
        for c in msg.tool_calls:
            fn = c.function  # type: ignore[union-attr]
            result, who, valid = sc.run_tool(fn.name, fn.arguments)
            out.calls.append(Call(fn.name, fn.arguments, result, who, valid))
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    out.finish = "tool_calls"  # the steps ran out before a text answer
    return out


class Agent:
    """The agent: trains through groups of the SDK, evaluates in sessions that do not train."""

    def __init__(self, cb: Client, model: str, sc: ToolsScenario) -> None:
        self.cb, self.model, self.sc = cb, model, sc
        self.sem = asyncio.Semaphore(sc.recipe.concurrency)
        self.episodes = 0
        self.solved = 0
        self.groups: list[str] = []

    async def _episode(self, ep: Any, task: Task) -> Grade:
        async with self.sem:
            t = await attempt(ep, self.model, self.sc, task)
        g = grade(t, self.sc.recipe.partial_credit)
        hint = self.sc.recipe.hint
        if hint and not g.looked_up and t.turn_ids:
            # what the first step should have done: hint OPD on it (before the outcome settles the group)
            await self._post(
                "/v1/feedback",
                {
                    "session_id": ep.session_id,
                    "turn_id": t.turn_ids[0],
                    "hint": hint.replace("{name}", task.name),
                },
            )
        await ep.outcome(g.reward)
        self.episodes += 1
        self.solved += g.success
        return g

    async def _post(self, path: str, body: dict[str, Any]) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=self.cb.timeout) as h:
            r = await h.post(self.cb.base_url + path, json=body, headers=self.cb._auth())
            r.raise_for_status()

    async def group(self, task: Task) -> list[Grade]:
        """n attempts at one training task as a group; leaving the block closes it."""
        body = {"name": task.name, "question": task.question, "code": task.code}
        async with self.cb.async_group(self.sc.recipe.n, task=body, user="demo-tools") as g:
            grades = await asyncio.gather(*(self._episode(ep, task) for ep in g))
        assert g.id is not None
        self.groups.append(g.id)
        return list(grades)

    async def evaluate_task(self, task: Task) -> tuple[list[Grade], Transcript]:
        """eval_samples episodes of a held-out task, each in its own session that never trains."""

        async def one() -> tuple[Grade, Transcript]:
            async with self.sem, self.cb.async_session(user="demo-tools-eval", train=False) as s:
                t = await attempt(s, self.model, self.sc, task)
            return grade(t, self.sc.recipe.partial_credit), t

        rated = await asyncio.gather(*(one() for _ in range(self.sc.recipe.eval_samples)))
        return [g for g, _ in rated], rated[0][1]

    async def evaluate(
        self, version: int, *, probe: bool
    ) -> tuple[VersionEval, list[dict[str, Any]]]:
        t0 = time.monotonic()
        tasks = self.sc.heldout_tasks
        rated = await asyncio.gather(*(self.evaluate_task(t) for t in tasks))
        probe_rate = await self.probe() if probe else None
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731

        def per_task(attr: str) -> tuple[float, ...]:
            return tuple(mean([float(getattr(g, attr)) for g in gs]) for gs, _ in rated)

        success, clean, looked = per_task("success"), per_task("clean"), per_task("looked_up")
        ev = VersionEval(
            version,
            mean(success),
            success,
            len(tasks) * self.sc.recipe.eval_samples,
            time.monotonic() - t0,
            on_topic=mean(looked),
            truly=mean(clean),
            truly_per_prompt=clean,
            on_topic_per_prompt=looked,
            probe=probe_rate,
            conversations=self.episodes,
        )
        shown = [
            {
                "task": t.question,
                "code": t.code,
                "episode": tr.text(),
                "success": gs[0].success,
                "rate": mean([float(g.success) for g in gs]),
            }
            for t, (gs, tr) in zip(tasks, rated, strict=True)
        ]
        return ev, shown

    async def probe(self) -> float:
        """The general probe set's on-topic rate, asked without tools (does the model still answer
        everyday questions?), one answer per question."""
        from clawbridge.learning.probes import general_probes, rate

        r = self.sc.recipe

        async def one(question: str) -> str:
            async with self.sem, self.cb.async_session(user="demo-tools-probe", train=False) as s:
                resp = await s.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=48,
                    temperature=r.temperature,
                )
            return resp.choices[0].message.content or ""

        probes = general_probes()
        answers = await asyncio.gather(*(one(p.question) for p in probes))
        return rate([p.check.answered(a) for p, a in zip(probes, answers, strict=True)])


# --- the run ------------------------------------------------------------------------------------


def tools_settings(sc: ToolsScenario, data_dir: Path, **overrides: Any) -> Settings:
    r = sc.recipe
    values: dict[str, Any] = dict(
        host="127.0.0.1",
        port=0,
        data_dir=data_dir,
        judge="rules",
        method="combine",
        batch_size=r.batch_size,
        learning_rate=r.learning_rate,
        lora_rank=r.lora_rank,
        lora_alpha=r.lora_rank,
        max_staleness=max(4, r.rounds),
        checkpoint_every=10_000,
        default_max_tokens=r.max_tokens,
        session_idle_timeout_s=600.0,
        episode_timeout_s=900.0,
        kl_anchor=r.kl_anchor,
        gate="on" if r.gate else "off",
        gate_probes=r.gate_probes,
        gate_probes_max=r.gate_probes if r.gate_probes_max is None else r.gate_probes_max,
        gate_alpha_base=0.1,  # as the three seeds were measured (docs/agents.md); the default is 0.2
        # ... under the harm test: 16 single answers cannot show a candidate within 5 points of v0
        gate_v0_test="harm",
        gate_samples=1,
        gate_max_tokens=48,
        gate_temperature=r.temperature,
    )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**values)


async def _waiting(running: Running) -> int:
    st = await running.store.run(running.store.stats)
    return int(st.samples.get("judged", 0))


async def _settled(cb: Client, group_ids: Sequence[str], known: set[str]) -> bool:
    """Whether the learner settled every group (trained or dropped), asked over HTTP; `known`
    holds the groups already seen settled, which are not asked again."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as h:
        for gid in group_ids:
            if gid in known:
                continue
            r = await h.get(f"{cb.base_url}/v1/groups/{gid}", headers=cb._auth())
            r.raise_for_status()
            if r.json()["state"] not in ("trained", "dropped"):
                return False
            known.add(gid)
    return True


async def run_tools_demo(
    sc: ToolsScenario,
    settings: Settings,
    *,
    progress: Progress | None = None,
    plot_path: Path | None = None,
    step_timeout_s: float = 600.0,
) -> DemoResult:
    from clawbridge.learning.learner import Learner

    t0 = time.monotonic()
    report = progress or (lambda phase, done, total: None)
    learner = Learner(settings, poll_s=0.2)
    async with demo_stack(settings, learner) as running:
        return await _play(sc, settings, learner, running, report, plot_path, step_timeout_s, t0)


async def _play(
    sc: ToolsScenario, settings: Settings, learner: Learner, running: Running, report: Progress,
    plot_path: Path | None, step_timeout_s: float, t0: float,
) -> DemoResult:
    from clawbridge.sdk.client import Client

    r = sc.recipe
    served = running.backend
    cb = Client(running.base_url, timeout=1800)
    agent = Agent(cb, running.proxy.model_name, sc)
    total = r.rounds * 2 + 1
    versions: list[VersionEval] = []
    examples: dict[int, list[dict[str, Any]]] = {}
    settled: set[str] = set()
    report("evaluating policy@v0", 0, total)
    ev, ex = await agent.evaluate(served.version, probe=r.probe)
    versions.append(ev)
    examples[ev.version] = ex
    order = sc.train_tasks
    asked = 0
    for rnd in range(r.rounds):
        report(
            f"round {rnd + 1}/{r.rounds}: {r.groups} groups × {r.n} episodes",
            2 * rnd + 1,
            total,
        )
        steps_before = _step_of(learner)
        batch = [order[(asked + j) % len(order)] for j in range(r.groups)]
        asked += len(batch)
        await asyncio.gather(*(agent.group(t) for t in batch))
        report(f"round {rnd + 1}/{r.rounds}: settling, training, gate", 2 * rnd + 2, total)
        deadline = time.monotonic() + step_timeout_s
        extra = 0
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no training step within {step_timeout_s:.0f} s")
            if learner.lock.locked():  # a step (and its gate) is under way: slow, not stuck
                deadline = time.monotonic() + step_timeout_s
                await asyncio.sleep(0.2)
                continue
            if not await _settled(cb, agent.groups, settled):
                await asyncio.sleep(0.2)
                continue
            waiting = await _waiting(running)
            if waiting >= r.batch_size:  # the trainer is about to take a batch
                await asyncio.sleep(0.2)
                continue
            if _step_of(learner) > steps_before:
                break  # every full batch of this round trained
            if extra >= r.extra_groups:
                log.warning("round %d: no training step after %d more groups", rnd + 1, extra)
                break
            # groups that all failed (or all succeeded) gave nothing to train: one more task
            await agent.group(order[asked % len(order)])
            asked += 1
            extra += 1
        last = rnd == r.rounds - 1
        if last or r.evaluate_each_round:
            report(f"evaluating policy@v{served.version}", 2 * rnd + 2, total)
            async with learner.lock:  # no step publishes while a version is measured
                ev, ex = await agent.evaluate(served.version, probe=last and r.probe)
            versions.append(ev)
            examples[ev.version] = ex
            report(f"policy@v{ev.version}: held-out success {ev.rate:.0%}", 2 * rnd + 3, total)
        else:
            report(
                f"round {rnd + 1}/{r.rounds}: policy@v{served.version} serving",
                2 * rnd + 3,
                total,
            )
    before, after = versions[0], versions[-1]
    delta, lo, hi = paired_interval(before.per_prompt, after.per_prompt)
    _, tlo, thi = paired_interval(before.truly_per_prompt, after.truly_per_prompt)
    steps = len(await asyncio.to_thread(_steps, settings))
    gate_records = [d.record() for d in (learner.trainer.decisions if learner.trainer else [])]
    shown = [
        {
            "prompt": b["task"],
            "code": b["code"],
            "before": b["episode"],
            "after": a["episode"],
            "before_rate": b["rate"],
            "after_rate": a["rate"],
        }
        for b, a in zip(examples[before.version], examples[after.version], strict=True)
    ]
    result = DemoResult(
        scenario=sc.name,
        model=agent.model,
        method="grpo (outcome)",
        before=before.rate,
        after=after.rate,
        delta=delta,
        interval=(lo, hi),
        steps=steps,
        versions=versions,
        seconds=time.monotonic() - t0,
        train_conversations=agent.episodes,
        train_satisfied=agent.solved,
        heldout_prompts=len(sc.heldout_tasks),
        eval_samples=r.eval_samples,
        truly_interval=(tlo, thi),
        gate=gate_records,
        examples=shown,
    )
    if plot_path is not None:
        result.plot = str(save_plot(result, plot_path))
    return result


def save_plot(result: DemoResult, path: Path) -> Path:
    """Held-out success, clean success and the lookup rate per evaluated version (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [v.version for v in result.versions]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(
        xs,
        [100 * v.rate for v in result.versions],
        marker="o",
        color="#1f6feb",
        lw=2,
        label="solved (the code in the answer)",
    )
    ax.plot(
        xs,
        [100 * v.truly for v in result.versions],
        marker=".",
        color="#8b949e",
        ls="--",
        label="solved cleanly (finished, no failed call)",
    )
    ax.plot(
        xs,
        [100 * v.on_topic for v in result.versions],
        marker=".",
        color="#2da44e",
        ls=":",
        label="looked up the right name",
    )
    for g in result.gate:
        if g["decision"] == "rejected":
            ax.axvline(g["version"], color="#cf222e", alpha=0.3, lw=1)
    ax.set_xlabel("policy version")
    ax.set_ylabel("held-out rate (%)")
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    lo, hi = (100 * x for x in result.interval)
    ax.set_title(
        f"{result.scenario}: solved {100 * result.before:.0f}% → {100 * result.after:.0f}% "
        f"(Δ 95% CI [{lo:+.0f}, {hi:+.0f}] pts)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def result_table(result: DemoResult) -> list[tuple[str, str]]:
    b, a = result.first, result.last
    pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
    lo, hi = result.interval
    rejected = sum(g["decision"] == "rejected" for g in result.gate)
    return [
        (
            "solved (the code in the final answer)",
            f"{pct(b.rate)} → {pct(a.rate)} (policy@v{a.version})",
        ),
        (
            "difference (95% interval)",
            f"{100 * (a.rate - b.rate):+.0f} pts [{100 * lo:+.0f}, {100 * hi:+.0f}]",
        ),
        ("solved cleanly (finished, no failed call)", f"{pct(b.truly)} → {pct(a.truly)}"),
        ("looked up the right name", f"{pct(b.on_topic)} → {pct(a.on_topic)}"),
        ("general probe: answers the question", f"{pct(b.probe)} → {pct(a.probe)}"),
        ("gate: accepted / held back", f"{len(result.gate) - rejected} / {rejected}"),
        (
            "training steps / episodes (solved)",
            f"{result.steps} / {result.train_conversations} ({result.train_satisfied})",
        ),
        ("wall time", f"{result.seconds:.0f} s"),
    ]


__all__ = [
    "TOOL",
    "Agent",
    "Grade",
    "Task",
    "ToolsRecipe",
    "ToolsScenario",
    "Transcript",
    "attempt",
    "grade",
    "load",
    "result_table",
    "run_tools_demo",
    "tools_settings",
]
