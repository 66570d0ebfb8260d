"""`clawbridge demo --scenario two_users`: two people with different preferences talk to one
server; each gets their own adapter (docs/learning.md#each-user-their-own-adapter).

    start the stack (local backend, store, proxy, learner) on a free loopback port
    each user's held-out prompts on v0: their own preference, and the other user's
    repeat `rounds` times:
        both users ask B training prompts at once (each with their own X-Session-User) and
        reply to each answer; the learner trains each user's lineage a step, in fair turns
    each user's last version, as that user is served it: their own preference (the gain, with
    a 95 % interval paired by prompt) and the other user's (the crosstalk)
    with --control: each user again alone on a fresh server, to tell what their own training
    does to the other's preference from what the other's presence does (the crosstalk proper)

Alice wants short answers (`concise`), Bob exactly one sentence (`one_sentence`): the two
preferences the embedded model can be taught, and alike (a short answer is often one sentence),
so Bob's own training moves Alice's preference too; the control tells the two apart. Every
measurement is through the public API with `X-Train: false` and `X-Instructions: off` (the
weights alone), as the single-user demo measures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawbridge.config import Settings
from clawbridge.demo import recipe
from clawbridge.demo.report import r4
from clawbridge.demo.rounds import NothingToTrain, Progress, demo_stack
from clawbridge.demo.runner import SimulatedUser
from clawbridge.demo.scenario import Scenario, load, paired_interval

if TYPE_CHECKING:
    from clawbridge.learning.learner import Learner
    from clawbridge.server import Running
    from openai import AsyncOpenAI

NAME = "two_users"
PAIR = (("alice", "concise"), ("bob", "one_sentence"))  # (user, scenario)
MORE = 3  # a user talks at most this many batches more in a round before it says nothing trains


@dataclass(frozen=True)
class Side:
    """One simulated user of a run: their own preference, and the other's (measured on their model)."""

    name: str
    own: Scenario
    other: Scenario


@dataclass(frozen=True)
class Measured:
    """One user's figures in one run: truly satisfied per held-out prompt, before and after."""

    version: int
    before: tuple[float, ...]
    after: tuple[float, ...]
    other_before: tuple[float, ...]  # the other user's preference on v0
    other_after: tuple[float, ...]  # ... on this user's last version
    examples: list[dict[str, str]] = field(default_factory=list)
    conversations: int = 0


@dataclass
class UserResult:
    scenario: str
    version: int
    truly_before: float
    truly_after: float
    truly_interval: tuple[float, float]
    other_scenario: str
    other_before: float  # the other's preference, truly satisfied, on v0
    other_after: float  # ... on this user's last version, with the other user beside them
    other_control: float | None = None  # ... on this user's last version when they were alone (--control)
    crosstalk_interval: tuple[float, float] | None = None  # its 95 % interval, paired by prompt
    truly_control: float | None = None  # this user's own preference when they were alone
    examples: list[dict[str, str]] = field(default_factory=list)

    @property
    def crosstalk(self) -> float | None:
        """How far the other user's presence moved this user's rate of the other's preference:
        beside them, against alone (None without --control)."""
        return None if self.other_control is None else self.other_after - self.other_control

    def as_json(self) -> dict[str, Any]:
        opt = lambda x: None if x is None else r4(x)  # noqa: E731
        return {"scenario": self.scenario, "version": self.version, "truly_before": r4(self.truly_before),
                "truly_after": r4(self.truly_after), "truly_interval": [r4(x) for x in self.truly_interval],
                "other_scenario": self.other_scenario, "other_before": r4(self.other_before),
                "other_after": r4(self.other_after), "other_control": opt(self.other_control),
                "crosstalk": opt(self.crosstalk),
                "crosstalk_interval": None if self.crosstalk_interval is None else [r4(x) for x in self.crosstalk_interval],
                "truly_control": opt(self.truly_control), "examples": self.examples}


@dataclass
class TwoUsersResult:
    model: str
    rounds: int
    users: dict[str, UserResult]
    seconds: float
    plot: str | None = None

    @property
    def improved(self) -> bool:
        """Every user's own gain is above zero with 95 % confidence."""
        return all(u.truly_interval[0] > 0 for u in self.users.values())

    def summary(self) -> dict[str, Any]:
        return {"scenario": NAME, "model": self.model, "rounds": self.rounds, "seconds": round(self.seconds, 1),
                "improved": self.improved, "users": {n: u.as_json() for n, u in self.users.items()}}


Pair = tuple[tuple[str, Scenario], tuple[str, Scenario]]


def builtin_pair() -> Pair:
    (a, sa), (b, sb) = PAIR
    return (a, load(sa)), (b, load(sb))


def sides(pair: Pair | None = None) -> list[Side]:
    (a, own_a), (b, own_b) = pair or builtin_pair()
    return [Side(a, own_a, own_b), Side(b, own_b, own_a)]


def two_users_settings(data_dir: Path, pair: Pair | None = None, **overrides: Any) -> Settings:
    """The first user's scenario's recipe for both (the built-in pair: the single-user demo's,
    `recipe.DEMO_RECIPE`)."""
    return recipe.demo_settings(sides(pair)[0].own.recipe, data_dir, **overrides)


def _client(base_url: str, user: str) -> AsyncOpenAI:
    """A client that speaks for `user` (`X-Session-User`) on every request."""
    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    http = DefaultAsyncHttpxClient(timeout=1800, limits=httpx2.Limits(keepalive_expiry=2.0))
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="clawbridge", timeout=1800, max_retries=3,
                       http_client=http, default_headers={"X-Session-User": user})


class Run:
    """One server, one or two simulated users: rounds of conversations, each user's lineage
    trained a step per round, each user measured before and after."""

    def __init__(self, running: Running, learner: Learner, played: list[Side], rounds: int,
                 report: Progress, step_timeout_s: float) -> None:
        self.running, self.learner, self.played, self.rounds = running, learner, played, rounds
        self.report, self.step_timeout_s = report, step_timeout_s
        model = running.proxy.model_name
        self.clients = {s.name: _client(running.base_url, s.name) for s in played}
        self.own = {s.name: SimulatedUser(self.clients[s.name], model, s.own) for s in played}
        self.other = {s.name: SimulatedUser(self.clients[s.name], model, s.other) for s in played}
        self.asked = {s.name: 0 for s in played}
        self.batch = running.settings.training.batch_size

    async def play(self) -> dict[str, Measured]:
        total = self.rounds + 2
        self.report("measuring policy@v0 for each user", 0, total)
        before = {s.name: await self._rates(s.name, 0) for s in self.played}
        for rnd in range(self.rounds):
            self.report(f"round {rnd + 1}/{self.rounds}: {' and '.join(self.asked)} talk", rnd + 1, total)
            stepped = {n: await self._steps(n) for n in self.asked}
            await asyncio.gather(*(self._talk(n, self.batch) for n in self.asked))
            self.report(f"round {rnd + 1}/{self.rounds}: judging, training, gate", rnd + 1, total)
            await self._await_steps(stepped)
        self.report("measuring each user's last version", total - 1, total)
        out: dict[str, Measured] = {}
        async with self.learner.lock:  # no step publishes while a version is measured
            for s in self.played:
                version = self.running.proxy.version_for(s.name)
                (own, other, examples), (own0, other0, _) = await self._rates(s.name, version), before[s.name]
                out[s.name] = Measured(version, own0, own, other0, other, examples, self.own[s.name].conversations)
        return out

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.close()

    async def _rates(self, name: str, version: int) -> tuple[tuple[float, ...], tuple[float, ...], list[dict[str, str]]]:
        """`name`'s held-out prompts answered as `name` is served now (the weights alone), rated
        by their own preference and by the other user's."""
        own, examples = await self.own[name].evaluate(version)
        other, _ = await self.other[name].evaluate(version)
        return own.truly_per_prompt, other.truly_per_prompt, [
            {"prompt": ex["prompt"], "answer": ex["answer"]} for ex in examples[:3]]

    async def _talk(self, name: str, n: int) -> None:
        prompts, user = self.own[name].scenario.training_prompts, self.own[name]
        start = self.asked[name]
        await asyncio.gather(*(user.converse(prompts[(start + j) % len(prompts)], start + j) for j in range(n)))
        self.asked[name] += n

    async def _steps(self, name: str) -> int:
        store = self.running.store
        return len(await store.run(store.training_steps, name))

    async def _await_steps(self, before: dict[str, int]) -> None:
        """Until every user's lineage has trained a step since `before`; a user whose
        conversations gave less than a batch talks a little more, not for ever."""
        store, extra = self.running.store, dict.fromkeys(before, 0)
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no training step within {self.step_timeout_s:.0f} s")
            if self.learner.lock.locked():  # a step and its gate under way: slow, not stuck
                deadline = time.monotonic() + self.step_timeout_s
                await asyncio.sleep(0.2)
                continue
            behind = [n for n in before if await self._steps(n) <= before[n]]
            if not behind:
                return
            st = await store.run(store.stats)
            if st.samples.get("pending", 0) == 0:  # everything heard is judged: who lacks a batch talks more
                for name in behind:
                    judged = len(await store.run(store.pending_samples, None, user=name))
                    if judged >= self.batch:
                        continue
                    if extra[name] >= MORE * self.batch:
                        raise NothingToTrain(f"{name}'s conversations this round gave {judged} trainable samples of "
                                             f"the {self.batch} a step needs")
                    await self._talk(name, self.batch - judged)
                    extra[name] += self.batch - judged
            await asyncio.sleep(0.5)


async def _run(settings: Settings, played: list[Side], rounds: int, report: Progress,
               step_timeout_s: float) -> tuple[str, dict[str, Measured]]:
    from clawbridge.learning.learner import Learner

    learner = Learner(settings, poll_s=0.2)
    async with demo_stack(settings, learner) as running:
        run = Run(running, learner, played, rounds, report, step_timeout_s)
        try:
            return running.proxy.model_name, await run.play()
        finally:
            await run.aclose()


async def run_two_users(settings: Settings, *, pair: Pair | None = None, rounds: int | None = None,
                        control: bool = False, progress: Progress | None = None,
                        note: Callable[[str], None] | None = None, step_timeout_s: float = 1800.0) -> TwoUsersResult:
    """Both users (`pair`: the built-in alice and bob) on one server; with `control`, each again
    alone on a fresh one (under the data dir's `alone-NAME`)."""
    report = progress or (lambda phase, done, total: None)
    say = note or (lambda line: None)
    t0, both = time.monotonic(), sides(pair)
    n = rounds or both[0].own.recipe.rounds
    model, measured = await _run(settings, both, n, report, step_timeout_s)
    alone: dict[str, Measured] = {}
    if control:
        for side in both:
            say(f"the control: {side.name} alone on a fresh server")
            solo = settings.model_copy(update={"data_dir": Path(settings.data_dir) / f"alone-{side.name}"})
            alone.update((await _run(solo, [side], n, report, step_timeout_s))[1])
    users: dict[str, UserResult] = {}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for side in both:
        m, alone_m = measured[side.name], alone.get(side.name)
        _, lo, hi = paired_interval(m.before, m.after)
        users[side.name] = UserResult(
            side.own.name, m.version, mean(m.before), mean(m.after), (lo, hi), side.other.name,
            mean(m.other_before), mean(m.other_after), examples=m.examples)
        if alone_m is not None:  # the same prompts and seeds: the difference pairs by prompt
            users[side.name].other_control = mean(alone_m.other_after)
            users[side.name].crosstalk_interval = paired_interval(alone_m.other_after, m.other_after)[1:]
            users[side.name].truly_control = mean(alone_m.after)
    return TwoUsersResult(model, n, users, time.monotonic() - t0)


def result_table(result: TwoUsersResult) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for name, u in result.users.items():
        lo, hi = u.truly_interval
        rows.append((f"{name} ({u.scenario}): truly satisfied, their own v{u.version}",
                     f"{u.truly_before:.0%} → {u.truly_after:.0%} (Δ {100 * (u.truly_after - u.truly_before):+.0f} "
                     f"[{100 * lo:+.0f}, {100 * hi:+.0f}])"))
        control = ""
        if u.other_control is not None and u.crosstalk_interval is not None and u.truly_control is not None:
            clo, chi = u.crosstalk_interval
            control = (f"; alone {u.other_control:.0%}: crosstalk {100 * (u.crosstalk or 0.0):+.0f} "
                       f"[{100 * clo:+.0f}, {100 * chi:+.0f}] points (their own, alone: {u.truly_control:.0%})")
        rows.append((f"{name}'s model on the other's preference ({u.other_scenario})",
                     f"v0 {u.other_before:.0%} → {u.other_after:.0%}{control}"))
    rows.append(("wall time", f"{result.seconds / 60:.1f} min"))
    return rows
