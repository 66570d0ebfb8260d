"""`clawbridge demo --scenario tools`: an agent learns to use a tool from its own episodes.

The task (`tools_scenario`): "What is Maya's secret code?". Nobody can guess a code; the agent
must call the `lookup` tool with the person's name (OpenAI tool calling), read the result and
answer with the code. The system message says so and the conversation opens with one worked
example (a call for Zoe, its result, the answer), which is what makes the embedded 135 M model try
at all.

    measure policy@v0 on held-out tasks (names never trained on; sessions with X-Train: false)
    repeat `rounds` times:
        open `groups` groups with the SDK (`cb.group(n, task)` of `clawbridge.AsyncClient`), one
        per training task; each of the n episodes is an OpenAI tool-calling loop (request, run the
        calls, send the results back, until the model answers in text); the outcome checker
        scores it and `ep.outcome(x)` reports it; leaving the block closes the group
        clawbridge turns each group into GRPO samples (outcomes normalised within the group) and
        trains; a round ends once the trainer has taken every full batch
    measure the last served version on the same held-out tasks
    report before/after with a paired 95 % interval over held-out tasks, a PNG, a JSON summary

The rounds are `rounds.play`, shared with the preference demo. Nothing here trains directly: the
demo is an agent using only the public SDK and the OpenAI API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawbridge.config import Settings
from clawbridge.demo import report
from clawbridge.demo.recipe import TOOLS_RECIPE, recipe_settings, tools_following
from clawbridge.demo.report import Series, change, difference, gate_counts, r4
from clawbridge.demo.rounds import Progress, Settle, play
from clawbridge.demo.scenario import paired_interval
from clawbridge.demo.tools_scenario import CODE, NAME, TOOL, Task, ToolsRecipe, ToolsScenario, load

if TYPE_CHECKING:
    from clawbridge.sdk.client import AsyncClient, AsyncEpisode
    from clawbridge.server import Running
    from openai import AsyncOpenAI

log = logging.getLogger(__name__)


# --- episodes and the outcome checker -----------------------------------------------------------


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


# --- what a version is measured by, and the result ---------------------------------------------


@dataclass(frozen=True)
class ToolsEval:
    """One served version on the held-out tasks (per-task rates, each over eval_samples episodes)."""

    version: int
    solved: float  # the code in the final answer
    solved_per_task: tuple[float, ...]
    clean: float  # solved, finished, no failed tool call
    clean_per_task: tuple[float, ...]
    looked_up: float  # a valid lookup of the task's name
    episodes: int  # measured
    seconds: float
    probe: float | None = None  # the general probe set's on-topic rate, asked without tools
    trained_episodes: int = 0  # training episodes before this version served


@dataclass
class ToolsResult:
    scenario: str
    model: str
    versions: list[ToolsEval]
    solved_interval: tuple[float, float]  # 95 % interval of the paired change in solved, v0 to last
    steps: int
    seconds: float
    train_episodes: int
    train_solved: int
    heldout_tasks: int
    eval_samples: int
    gate: list[dict[str, Any]] = field(default_factory=list)
    plot: str | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)
    method: str = "grpo (outcome)"

    @property
    def first(self) -> ToolsEval:
        return self.versions[0]

    @property
    def last(self) -> ToolsEval:
        return self.versions[-1]

    @property
    def improved(self) -> bool:
        return self.solved_interval[0] > 0

    @property
    def episodes_to_80(self) -> int | None:
        """Training episodes until a measured version solved >= 80 % of the held-out tasks
        cleanly (None: never within the run)."""
        return next((v.trained_episodes for v in self.versions if v.clean >= 0.8), None)

    def summary(self) -> dict[str, Any]:
        """The `--json` document."""
        b, a = self.first, self.last
        measures = {
            "solved_before": r4(b.solved), "solved_after": r4(a.solved), "solved_delta": r4(a.solved - b.solved),
            "solved_interval": [r4(x) for x in self.solved_interval],
            "clean_before": r4(b.clean), "clean_after": r4(a.clean),
            "looked_up_before": r4(b.looked_up), "looked_up_after": r4(a.looked_up),
            "probe_before": r4(b.probe), "probe_after": r4(a.probe),
            "episodes_to_80": self.episodes_to_80,
            "train_episodes": self.train_episodes, "train_solved": self.train_solved,
            "heldout_tasks": self.heldout_tasks,
        }
        versions = [
            {"version": v.version, "solved": r4(v.solved), "clean": r4(v.clean), "looked_up": r4(v.looked_up),
             "probe": r4(v.probe), "episodes": v.episodes, "trained_episodes": v.trained_episodes,
             "seconds": round(v.seconds, 1)}
            for v in self.versions
        ]
        return report.summary(self, measures, versions)


# --- the agent: trains through the SDK's groups, is measured in sessions that never train ------


class Agent:
    """The agent (and the tools demo's side of the rounds, `rounds.Player`): a round is `groups`
    groups of `n` episodes; it goes on with one more group while the round gave no full batch."""

    def __init__(self, cb: AsyncClient, model: str, sc: ToolsScenario, batch_size: int) -> None:
        self.cb, self.model, self.sc = cb, model, sc
        self.batch_size = batch_size  # samples the trainer takes a step
        self.sem = asyncio.Semaphore(sc.recipe.concurrency)
        self.episodes = 0
        self.solved = 0
        self.groups: list[str] = []
        self.settled: set[str] = set()  # groups seen trained or dropped, not asked again
        self.asked = 0  # training tasks taken, in order
        self.round = 0
        self.extra = 0  # groups added to this round

    async def _episode(self, ep: AsyncEpisode, task: Task) -> Grade:
        async with self.sem:
            t = await attempt(ep, self.model, self.sc, task)
        g = grade(t, self.sc.recipe.partial_credit)
        hint = self.sc.recipe.hint
        if hint and not g.looked_up and t.turn_ids:
            # what the first step should have done: hint OPD on it (before the outcome settles the group)
            await ep.feedback(hint=hint.replace("{name}", task.name), turn_id=t.turn_ids[0])
        await ep.outcome(g.reward)
        self.episodes += 1
        self.solved += g.success
        return g

    async def group(self, task: Task) -> list[Grade]:
        """n attempts at one training task as a group; leaving the block closes it."""
        body = {"name": task.name, "question": task.question, "code": task.code}
        async with self.cb.group(self.sc.recipe.n, task=body, user="demo-tools") as g:
            grades = await asyncio.gather(*(self._episode(ep, task) for ep in g))
        if g.id is not None:
            self.groups.append(g.id)
        return list(grades)

    def _next_task(self) -> Task:
        order = self.sc.train_tasks
        self.asked += 1
        return order[(self.asked - 1) % len(order)]

    # the rounds
    def round_label(self, rnd: int, rounds: int) -> str:
        return f"round {rnd + 1}/{rounds}: {self.sc.recipe.groups} groups × {self.sc.recipe.n} episodes"

    async def play_round(self, rnd: int) -> None:
        self.round, self.extra = rnd, 0
        batch = [self._next_task() for _ in range(self.sc.recipe.groups)]
        await asyncio.gather(*(self.group(t) for t in batch))

    async def settle(self, *, stepped: bool) -> Settle:
        if not await self._all_settled():
            return "wait"
        if await self._waiting() >= self.batch_size:  # the trainer is about to take a batch
            return "wait"
        if stepped:
            return "done"  # every full batch of this round trained
        if self.extra >= self.sc.recipe.extra_groups:
            log.warning("round %d: no training step after %d more groups", self.round + 1, self.extra)
            return "done"
        return "more"  # groups that all failed (or all succeeded) gave nothing to train

    async def more(self) -> None:
        await self.group(self._next_task())
        self.extra += 1

    async def _all_settled(self) -> bool:
        """Whether the learner settled every group (trained or dropped), asked over the API."""
        for gid in self.groups:
            if gid in self.settled:
                continue
            if (await self.cb.get_group(gid))["state"] not in ("trained", "dropped"):
                return False
            self.settled.add(gid)
        return True

    async def _waiting(self) -> int:
        """Samples judged and waiting for the trainer (the server's status, `samples` counts)."""
        status = await self.cb.status()
        return int(status["store"]["samples"].get("judged", 0))

    def wants_measure(self, served: int, previous: ToolsEval, *, held_back: bool, last: bool) -> bool:
        return last or self.sc.recipe.evaluate_each_round

    def headline(self, ev: ToolsEval) -> str:
        return f"policy@v{ev.version}: held-out success {ev.solved:.0%}"

    async def aclose(self) -> None:
        await self.cb.aclose()

    # measuring a version
    async def evaluate_task(self, task: Task) -> tuple[list[Grade], Transcript]:
        """eval_samples episodes of a held-out task, each in its own session that never trains."""

        async def one() -> tuple[Grade, Transcript]:
            async with self.sem, self.cb.session(user="demo-tools-eval", train=False) as s:
                t = await attempt(s, self.model, self.sc, task)
            return grade(t, self.sc.recipe.partial_credit), t

        rated = await asyncio.gather(*(one() for _ in range(self.sc.recipe.eval_samples)))
        return [g for g, _ in rated], rated[0][1]

    async def measure(self, version: int, previous: ToolsEval | None, *,
                      last: bool) -> tuple[ToolsEval, list[dict[str, Any]]]:
        probe = self.sc.recipe.probe and (previous is None or last)
        t0 = time.monotonic()
        tasks = self.sc.heldout_tasks
        rated = await asyncio.gather(*(self.evaluate_task(t) for t in tasks))
        probe_rate = await self.probe() if probe else None

        def per_task(attr: str) -> tuple[float, ...]:
            return tuple(_mean([float(getattr(g, attr)) for g in gs]) for gs, _ in rated)

        solved, clean, looked = per_task("success"), per_task("clean"), per_task("looked_up")
        ev = ToolsEval(version, _mean(solved), solved, _mean(clean), clean, _mean(looked),
                       len(tasks) * self.sc.recipe.eval_samples, time.monotonic() - t0, probe=probe_rate,
                       trained_episodes=self.episodes)
        shown = [
            {"task": t.question, "code": t.code, "episode": tr.text(), "success": gs[0].success,
             "rate": _mean([float(g.success) for g in gs])}
            for t, (gs, tr) in zip(tasks, rated, strict=True)
        ]
        return ev, shown

    async def probe(self) -> float:
        """The general probe set's on-topic rate, asked without tools (does the model still answer
        everyday questions?), one answer per question."""
        from clawbridge.learning.probes import ORIGINAL, general_probes, rate

        r = self.sc.recipe

        async def one(question: str) -> str:
            async with self.sem, self.cb.session(user="demo-tools-probe", train=False) as s:
                resp = await s.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": question}], max_tokens=48,
                    temperature=r.temperature,
                )
            return resp.choices[0].message.content or ""

        probes = general_probes()[:ORIGINAL]  # as the tools demo was measured (docs/agents.md)
        answers = await asyncio.gather(*(one(p.question) for p in probes))
        return rate([p.key.answered(a) for p, a in zip(probes, answers, strict=True)])


def _mean(xs: list[float] | tuple[float, ...]) -> float:
    return sum(xs) / len(xs)


# --- the run --------------------------------------------------------------------------------------


def tools_settings(sc: ToolsScenario, data_dir: Path, **overrides: Any) -> Settings:
    """The tools demo's settings for a scenario's recipe (`clawbridge.demo.recipe.TOOLS_RECIPE`)."""
    r = sc.recipe
    return recipe_settings(TOOLS_RECIPE, lambda v: tools_following(r.rounds, r.temperature, r.max_tokens, v),
                           r.settings, data_dir, overrides)


async def run_tools_demo(
    sc: ToolsScenario,
    settings: Settings,
    *,
    progress: Progress | None = None,
    plot_path: Path | None = None,
    step_timeout_s: float = 600.0,
) -> ToolsResult:
    from clawbridge.learning.learner import Learner
    from clawbridge.sdk.client import AsyncClient

    t0 = time.monotonic()
    agents: list[Agent] = []  # made once the stack runs (it needs its address); read after

    def agent_for(running: Running) -> Agent:
        agents.append(Agent(AsyncClient(running.base_url, timeout=1800), running.proxy.model_name, sc,
                            settings.training.batch_size))
        return agents[-1]

    played = await play(settings, Learner(settings, poll_s=0.2), agent_for, rounds=sc.recipe.rounds,
                        progress=progress, step_timeout_s=step_timeout_s)
    agent = agents[0]
    before, after = played.first, played.last
    _, lo, hi = paired_interval(before.solved_per_task, after.solved_per_task)
    shown = [
        {"prompt": b["task"], "code": b["code"], "before": b["episode"], "after": a["episode"],
         "before_rate": b["rate"], "after_rate": a["rate"]}
        for b, a in played.example_pairs()
    ]
    result = ToolsResult(
        scenario=sc.name, model=played.model, versions=played.versions, solved_interval=(lo, hi), steps=played.steps,
        seconds=time.monotonic() - t0, train_episodes=agent.episodes, train_solved=agent.solved,
        heldout_tasks=len(sc.heldout_tasks), eval_samples=sc.recipe.eval_samples, gate=played.gate,
        examples=shown,
    )
    if plot_path is not None:
        result.plot = str(save_plot(result, plot_path))
    return result


def save_plot(result: ToolsResult, path: Path) -> Path:
    """Held-out success, clean success and the lookup rate per measured version (PNG)."""
    vs = result.versions
    series = [
        Series("solved (the code in the answer)", [(v.version, v.solved) for v in vs],
               {"marker": "o", "color": "#1f6feb", "lw": 2}),
        Series("solved cleanly (finished, no failed call)", [(v.version, v.clean) for v in vs],
               {"marker": ".", "color": "#8b949e", "ls": "--"}),
        Series("looked up the right name", [(v.version, v.looked_up) for v in vs],
               {"marker": ".", "color": "#2da44e", "ls": ":"}),
    ]
    lo, hi = (100 * x for x in result.solved_interval)
    title = (f"{result.scenario}: solved {100 * result.first.solved:.0f}% → {100 * result.last.solved:.0f}% "
             f"(Δ 95% CI [{lo:+.0f}, {hi:+.0f}] pts)")
    return report.save_plot(path, title, series, result.gate)


def result_table(result: ToolsResult) -> list[tuple[str, str]]:
    b, a = result.first, result.last
    return [
        ("solved (the code in the final answer)", f"{change(b.solved, a.solved)} (policy@v{a.version})"),
        ("difference (95% interval)", difference(b.solved, a.solved, result.solved_interval)),
        ("solved cleanly (finished, no failed call)", change(b.clean, a.clean)),
        ("looked up the right name", change(b.looked_up, a.looked_up)),
        ("general probe: answers the question", change(b.probe, a.probe)),
        ("gate: accepted / held back", gate_counts(result.gate)),
        ("training steps / episodes (solved)", f"{result.steps} / {result.train_episodes} ({result.train_solved})"),
        ("wall time", f"{result.seconds:.0f} s"),
    ]


__all__ = [
    "NAME",
    "TOOL",
    "Agent",
    "Grade",
    "Task",
    "ToolsEval",
    "ToolsRecipe",
    "ToolsResult",
    "ToolsScenario",
    "Transcript",
    "attempt",
    "grade",
    "load",
    "result_table",
    "run_tools_demo",
    "tools_settings",
]
