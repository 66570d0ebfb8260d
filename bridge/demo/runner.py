"""`clawbridge demo`: watch the served model learn a user's hidden preference.

    start the stack (local backend, store, proxy, learner) on a free loopback port
    evaluate policy@v0 on held-out prompts                     (through the HTTP API, X-Train: false)
    repeat `rounds` times:
        the simulated user asks B training prompts (openai client, one session each) and replies
        to each answer — thanks when it meets the preference, a correction when not
        clawbridge judges the replies, builds samples, trains one step and publishes v+1
        evaluate the new version on the held-out prompts
    report before/after with a 95 % interval of the paired difference, a PNG, a JSON summary

Nothing here trains directly: the demo is a user of the public API, like any agent.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawbridge.config import Settings
from clawbridge.demo.scenario import Scenario, paired_interval
from clawbridge.learning.collector import judge_kinds

if TYPE_CHECKING:
    from clawbridge.server import Running
    from openai import AsyncOpenAI

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class VersionEval:
    version: int
    rate: float
    per_prompt: tuple[float, ...]
    samples: int
    seconds: float


@dataclass
class DemoResult:
    scenario: str
    model: str
    method: str
    before: float
    after: float
    delta: float
    interval: tuple[float, float]
    steps: int
    versions: list[VersionEval]
    seconds: float
    train_conversations: int
    train_satisfied: int
    heldout_prompts: int
    eval_samples: int
    plot: str | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def improved(self) -> bool:
        return self.interval[0] > 0

    def summary(self) -> dict[str, Any]:
        """The `--json` document."""
        return {
            "scenario": self.scenario,
            "model": self.model,
            "method": self.method,
            "before": round(self.before, 4),
            "after": round(self.after, 4),
            "delta": round(self.delta, 4),
            "interval": [round(self.interval[0], 4), round(self.interval[1], 4)],
            "improved": self.improved,
            "steps": self.steps,
            "versions": [
                {"version": v.version, "rate": round(v.rate, 4), "samples": v.samples,
                 "seconds": round(v.seconds, 1)}
                for v in self.versions
            ],
            "seconds": round(self.seconds, 1),
            "train_conversations": self.train_conversations,
            "train_satisfied": self.train_satisfied,
            "heldout_prompts": self.heldout_prompts,
            "eval_samples": self.eval_samples,
            "plot": self.plot,
            "examples": self.examples,
        }


def demo_settings(scenario: Scenario, data_dir: Path, **overrides: Any) -> Settings:
    r = scenario.recipe
    values: dict[str, Any] = dict(
        host="127.0.0.1", port=0, data_dir=data_dir, judge="rules", method=r.method,
        batch_size=r.batch_size, learning_rate=r.learning_rate, lora_rank=r.lora_rank,
        lora_alpha=r.lora_rank, max_staleness=max(4, r.rounds), checkpoint_every=10_000,
        default_max_tokens=r.max_tokens, session_idle_timeout_s=600.0,
    )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**values)


class SimulatedUser:
    """Talks to clawbridge through the OpenAI API and reacts to each answer by the scenario's
    hidden preference."""

    def __init__(self, client: AsyncOpenAI, model: str, scenario: Scenario) -> None:
        self.client, self.model, self.scenario = client, model, scenario
        self.sem = asyncio.Semaphore(scenario.recipe.concurrency)
        self.conversations = 0
        self.satisfied = 0

    async def converse(self, prompt: str, i: int) -> bool:
        """One conversation: the question, the answer, the user's reply (which is the turn's
        next state, so the judge can read it), and the session closes."""
        r, sc = self.scenario.recipe, self.scenario
        sid = f"demo-{uuid.uuid4().hex[:12]}"
        head = {"X-Session-Id": sid, "X-Turn-Type": "main"}
        async with self.sem:
            first = await self.client.chat.completions.create(
                model=self.model, messages=sc.messages(prompt),  # type: ignore[arg-type]
                max_tokens=r.max_tokens, temperature=r.temperature, extra_headers=head,
            )
            choice = first.choices[0]
            answer = choice.message.content or ""
            ok = sc.check.satisfied(answer, choice.finish_reason)
            history = [*sc.messages(prompt), {"role": "assistant", "content": answer},
                       {"role": "user", "content": sc.reply(ok, i)}]
            # The reply is the next state of the first turn. Its own answer is not needed: one
            # token, and the session is closed so that turn waits for nothing.
            await self.client.chat.completions.create(
                model=self.model, messages=history,  # type: ignore[arg-type]
                max_tokens=1, temperature=r.temperature,
                extra_headers={**head, "X-Session-Done": "true"},
            )
        self.conversations += 1
        self.satisfied += ok
        return ok

    async def evaluate(self, version: int) -> tuple[VersionEval, list[dict[str, Any]]]:
        """Held-out satisfaction: `eval_samples` answers per prompt, never trained on."""
        r, sc = self.scenario.recipe, self.scenario
        t0 = time.monotonic()

        async def one(prompt: str) -> tuple[float, dict[str, Any]]:
            async with self.sem:
                resp = await self.client.chat.completions.create(
                    model=self.model, messages=sc.messages(prompt),  # type: ignore[arg-type]
                    max_tokens=r.max_tokens, temperature=r.temperature, n=r.eval_samples,
                    extra_headers={"X-Session-Id": f"eval-{uuid.uuid4().hex[:12]}",
                                   "X-Train": "false", "X-Session-Done": "true"},
                )
            oks = [sc.check.satisfied(c.message.content or "", c.finish_reason) for c in resp.choices]
            first = resp.choices[0]
            return sum(oks) / len(oks), {"prompt": prompt, "answer": first.message.content,
                                          "satisfied": oks[0]}

        rated = await asyncio.gather(*(one(p) for p in sc.heldout_prompts))
        per_prompt = tuple(x for x, _ in rated)
        ev = VersionEval(version, sum(per_prompt) / len(per_prompt), per_prompt,
                         len(per_prompt) * r.eval_samples, time.monotonic() - t0)
        return ev, [ex for _, ex in rated]


async def _settled(running: Running) -> tuple[int, int]:
    """(judged samples waiting for the trainer, turns still on their way to a sample)."""
    st = await running.store.run(running.store.stats)
    waiting = st.samples.get("judged", 0)
    unsettled = st.samples.get("pending", 0)
    kinds = judge_kinds(running.settings.method)
    awaiting = len(await running.store.run(running.store.turns_awaiting_judgment, kinds, 1000))
    return waiting, unsettled + awaiting


async def run_demo(
    scenario: Scenario,
    settings: Settings,
    *,
    progress: Progress | None = None,
    plot_path: Path | None = None,
    step_timeout_s: float = 300.0,
) -> DemoResult:
    from clawbridge.backends.local import LocalBackend
    from clawbridge.learning.learner import Learner
    from clawbridge.server import learner_hooks, learner_task, serve
    from openai import AsyncOpenAI

    t0 = time.monotonic()
    report = progress or (lambda phase, done, total: None)
    r = scenario.recipe
    backend = LocalBackend.from_settings(settings)
    learner = Learner(settings, poll_s=0.2)
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        serve(settings, backend=backend, hooks=learner_hooks(learner), background=[learner_task(learner)],
              quiet=True, started=ready.set_result)
    )
    racing: set[asyncio.Future[Any]] = {server, ready}
    done_first, _ = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    if server in done_first:
        await server  # raises why it could not start
    running = ready.result()
    client = AsyncOpenAI(base_url=f"{running.base_url}/v1", api_key="clawbridge", timeout=1800, max_retries=0)
    model = running.proxy.model_name
    user = SimulatedUser(client, model, scenario)
    total = r.rounds * 2 + 1
    versions: list[VersionEval] = []
    examples: dict[int, list[dict[str, Any]]] = {}
    try:
        report("evaluating policy@v0", 0, total)
        ev, ex = await user.evaluate(backend.version)
        versions.append(ev)
        examples[ev.version] = ex
        order = list(scenario.train_prompts)
        asked = 0
        for rnd in range(r.rounds):
            report(f"round {rnd + 1}/{r.rounds}: conversations", 2 * rnd + 1, total)
            target = backend.version + 1
            batch = [order[(asked + j) % len(order)] for j in range(r.batch_size)]
            await asyncio.gather(*(user.converse(p, asked + j) for j, p in enumerate(batch)))
            asked += len(batch)
            report(f"round {rnd + 1}/{r.rounds}: judging and training", 2 * rnd + 2, total)
            deadline = time.monotonic() + step_timeout_s
            while backend.version < target:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no new policy version within {step_timeout_s:.0f} s")
                waiting, unsettled = await _settled(running)
                if unsettled == 0 and waiting < r.batch_size:
                    # a reply the judge found neutral gave no sample: the user talks a bit more
                    p = order[asked % len(order)]
                    await user.converse(p, asked)
                    asked += 1
                    continue
                await asyncio.sleep(0.2)
            ev, ex = await user.evaluate(backend.version)
            versions.append(ev)
            examples[ev.version] = ex
            report(f"policy@v{ev.version}: held-out {ev.rate:.0%}", 2 * rnd + 3, total)
    finally:
        await client.close()
        running.server.should_exit = True
        await asyncio.wait_for(server, 120)
    before, after = versions[0], versions[-1]
    delta, lo, hi = paired_interval(before.per_prompt, after.per_prompt)
    steps = len(await asyncio.to_thread(_steps, settings))
    shown = [
        {"prompt": b["prompt"], "before": b["answer"], "after": a["answer"]}
        for b, a in zip(examples[before.version][:3], examples[after.version][:3], strict=True)
    ]
    result = DemoResult(
        scenario=scenario.name, model=model, method=settings.method, before=before.rate,
        after=after.rate, delta=delta, interval=(lo, hi), steps=steps, versions=versions,
        seconds=time.monotonic() - t0, train_conversations=user.conversations,
        train_satisfied=user.satisfied, heldout_prompts=len(scenario.heldout_prompts),
        eval_samples=r.eval_samples, examples=shown,
    )
    if plot_path is not None:
        result.plot = str(save_plot(result, plot_path))
    return result


def _steps(settings: Settings) -> list[Any]:
    from clawbridge.store import Store

    with Store.open(settings.db_url) as store:
        return store.training_steps()


def save_plot(result: DemoResult, path: Path) -> Path:
    """The held-out satisfaction rate per policy version (PNG, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [v.version for v in result.versions]
    ys = [100 * v.rate for v in result.versions]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot(xs, ys, marker="o", color="#1f6feb")
    ax.set_xlabel("policy version (one training step each)")
    ax.set_ylabel("held-out satisfaction (%)")
    ax.set_ylim(-5, 105)
    ax.set_xticks(xs)
    ax.grid(alpha=0.3)
    lo, hi = (100 * x for x in result.interval)
    ax.set_title(
        f"{result.scenario}: {100 * result.before:.0f}% → {100 * result.after:.0f}% "
        f"(Δ 95% CI [{lo:+.0f}, {hi:+.0f}] pts)", fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def default_data_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="clawbridge-demo-"))


def result_table(result: DemoResult) -> list[tuple[str, str]]:
    lo, hi = result.interval
    return [
        ("held-out satisfaction, before (policy@v0)", f"{result.before:.0%}"),
        (f"held-out satisfaction, after (policy@v{result.versions[-1].version})", f"{result.after:.0%}"),
        ("difference (95% interval)", f"{100 * result.delta:+.0f} pts [{100 * lo:+.0f}, {100 * hi:+.0f}]"),
        ("training steps / conversations", f"{result.steps} / {result.train_conversations}"),
        ("wall time", f"{result.seconds:.0f} s"),
    ]


__all__ = ["DemoResult", "SimulatedUser", "VersionEval", "demo_settings", "run_demo", "save_plot"]
