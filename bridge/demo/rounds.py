"""The skeleton both demos share: the stack, the rounds, the versions measured between them.

    start the stack (local backend, store, proxy, the learner's loops) on a free loopback port
    measure policy@v0
    repeat `rounds` times:
        the player plays a round (conversations, or groups of episodes) through the HTTP API
        wait until the learner trained on it (the player may add a conversation while it waits)
        measure the version now served, when the player wants it measured
    hand back every measured version, its examples, the steps and the gate's decisions

What a round is, what a measurement holds and what counts as "settled" is the player's; each
demo turns the `Played` record into its own result type (`results.DemoResult`, `tools.ToolsResult`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from clawbridge.config import Settings

if TYPE_CHECKING:
    from clawbridge.learning.learner import Learner
    from clawbridge.server import Running

Progress = Callable[[str, int, int], None]  # (phase, done, total)
Settle = Literal["wait", "more", "done"]  # what a player says while the learner works on a round


class Measured(Protocol):
    @property
    def version(self) -> int: ...


E = TypeVar("E", bound=Measured)


class Player(Protocol[E]):
    """One demo's side of the rounds: how it plays and measures (through the public API)."""

    def round_label(self, rnd: int, rounds: int) -> str: ...

    async def play_round(self, rnd: int) -> None:
        """The round's conversations or groups, all finished on return."""

    async def settle(self, *, stepped: bool) -> Settle:
        """While the learner works: `wait`, `more` (play one more conversation: what the round
        gave makes no full batch) or `done`; `stepped`: a training step ended since the round
        began."""

    async def more(self) -> None: ...

    def wants_measure(self, served: int, previous: E, *, held_back: bool, last: bool) -> bool: ...

    async def measure(self, version: int, previous: E | None, *, last: bool) -> tuple[E, list[dict[str, Any]]]:
        """The version's figures and the examples shown for it; `previous` is None for v0."""

    def headline(self, ev: E) -> str: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Played(Generic[E]):
    """What the rounds left: every measured version (v0 first), their examples, the training
    steps taken, the gate's decisions, the served model's name, and the wall seconds of each
    part (`Clock`)."""

    versions: list[E]
    examples: dict[int, list[dict[str, Any]]]
    steps: int
    gate: list[dict[str, Any]]
    model: str
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def first(self) -> E:
        return self.versions[0]

    @property
    def last(self) -> E:
        return self.versions[-1]

    def example_pairs(self, limit: int | None = None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """The examples of v0 and of the last version, paired by prompt."""
        b, a = self.examples[self.first.version], self.examples[self.last.version]
        return list(zip(b[:limit], a[:limit], strict=True))


async def play(
    settings: Settings,
    learner: Learner,
    player_for: Callable[[Running], Player[E]],
    *,
    rounds: int,
    progress: Progress | None,
    step_timeout_s: float,
) -> Played[E]:
    """Run the stack, play `rounds` rounds with the player made for it, measure."""
    report = progress or (lambda phase, done, total: None)
    clock, t0 = Clock(), time.monotonic()
    async with demo_stack(settings, learner) as running:
        clock.seconds["start"] = time.monotonic() - t0
        player = player_for(running)
        try:
            versions, examples = await _rounds(player, learner, running, rounds, report, step_timeout_s, clock)
        finally:
            await player.aclose()
        steps = len(await asyncio.to_thread(_steps, settings))
        gate = [d.record() for d in (learner.trainer.promotion.decisions if learner.trainer else [])]
        clock.seconds["gate"] = sum(float(g["figures"].get("seconds", 0.0)) for g in gate)
        return Played(versions, examples, steps, gate, running.proxy.model_name, clock.seconds)


class Clock:
    """Wall seconds per part of a demo, summed over its occurrences: where the ten minutes go."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.asynccontextmanager
    async def part(self, name: str) -> AsyncIterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0


async def _rounds(player: Player[E], learner: Learner, running: Running, rounds: int, report: Progress,
                  step_timeout_s: float, clock: Clock) -> tuple[list[E], dict[int, list[dict[str, Any]]]]:
    served = running.backend  # what the proxy serves (the gate may hold a newer candidate back)
    total = 2 * rounds + 1
    report("measuring policy@v0", 0, total)
    async with clock.part("measure"):
        ev, ex = await player.measure(served.version, None, last=False)
    versions, examples = [ev], {ev.version: ex}
    for rnd in range(rounds):
        report(player.round_label(rnd, rounds), 2 * rnd + 1, total)
        before = step_of(learner)
        async with clock.part("conversations"):
            await player.play_round(rnd)
        report(f"round {rnd + 1}/{rounds}: judging, training, gate", 2 * rnd + 2, total)
        async with clock.part("learning"):  # judging, training and the gate (and any extra conversation)
            await _await_step(player, learner, before, step_timeout_s)
        last = rnd == rounds - 1
        decisions = learner.trainer.promotion.decisions if learner.trainer is not None else []
        held_back = bool(decisions) and decisions[-1].decision == "rejected"  # still the same weights
        if not held_back and decisions and (blend := await _blend_of(running, served.version)) is not None:
            from clawbridge.learning.promotion import blend_name

            report(f"the gate held v{blend[0]}'s lineage back; {blend_name(*blend)} passed and "
                   f"serves as policy@v{served.version}", 2 * rnd + 2, total)
        if player.wants_measure(served.version, versions[-1], held_back=held_back, last=last):
            report(f"measuring policy@v{served.version}", 2 * rnd + 2, total)
            async with clock.part("measure"), learner.lock:  # no step may publish while a version is measured
                ev, ex = await player.measure(served.version, versions[-1], last=last)
            versions.append(ev)
            examples[ev.version] = ex
            report(player.headline(ev), 2 * rnd + 3, total)
        elif held_back:
            report(f"held back by the gate: still policy@v{served.version}", 2 * rnd + 3, total)
        else:
            report(f"round {rnd + 1}/{rounds}: policy@v{served.version} serving", 2 * rnd + 3, total)
    return versions, examples


async def _blend_of(running: Running, version: int) -> tuple[int, float] | None:
    """(the candidate, alpha) when `version` is a blend the gate accepted (`gate_blend`)."""
    store = running.store
    return (await store.run(store.history)).blends.get(version)


async def _await_step(player: Player[Any], learner: Learner, before: int, step_timeout_s: float) -> None:
    """Until the player says the round is done; a step (and its gate) under way is slow, not stuck."""
    deadline = time.monotonic() + step_timeout_s
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no training step within {step_timeout_s:.0f} s")
        if learner.lock.locked():
            deadline = time.monotonic() + step_timeout_s
            await asyncio.sleep(0.2)
            continue
        state = await player.settle(stepped=step_of(learner) > before)
        if state == "done":
            return
        if state == "more":
            await player.more()
        else:
            await asyncio.sleep(0.2)


# --- the stack ------------------------------------------------------------------------------------
def engine_dtype(settings: Settings) -> str:
    """The arithmetic the demo's engine will run in (its `LocalBackend.from_settings` on the CPU
    resolves the setting the same way), for the header printed before the stack starts."""
    from clawbridge.local_gpu import precision

    return precision.name(precision.resolve(settings.engine.engine_dtype, "cpu"))


@contextlib.asynccontextmanager
async def demo_stack(settings: Settings, learner: Learner) -> AsyncIterator[Running]:
    """The whole stack in-process on a free loopback port (local backend, store, proxy, the
    learner's loops), stopped on the way out; raises why it could not start."""
    from clawbridge.backends.local import LocalBackend
    from clawbridge.server import learner_hooks, learner_task, serve

    backend = LocalBackend.from_settings(settings, threads=threads())
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
    body = asyncio.current_task()
    stopped = asyncio.Event()

    async def watch() -> None:  # a signal (Ctrl-C, SIGTERM) told the server to exit: stop playing
        while not running.server.should_exit:
            await asyncio.sleep(0.2)
        stopped.set()
        if body is not None:
            body.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield running
    except BaseException:  # the cancel, or what a client (or the gate, on the engine) saw while the server went away
        if stopped.is_set() or running.server.should_exit:  # before the watcher's next look, too
            raise DemoStopped(f"stopped by a signal; what was captured and trained is in {settings.data_dir}") from None
        raise
    finally:
        watcher.cancel()
        running.server.should_exit = True
        await asyncio.wait_for(server, 120)


class DemoStopped(Exception):
    """The demo was stopped from outside (a signal) before it finished."""


class NothingToTrain(Exception):
    """A round's conversations, and many more, gave no full training batch: the scenario's
    feedback gives the recipe nothing to learn from (the message says why and what to change)."""


def threads() -> int | None:
    """One torch thread when the machine is busier than it has cores. Two intra-op threads wait
    on each other at every barrier, and when other processes hold the cores each wait is a lost
    time slice (docs/measurements.md)."""
    cores = os.cpu_count() or 1
    return 1 if os.getloadavg()[0] >= cores else None


def step_of(learner: Learner) -> int:
    last = learner.last_step
    return last.step if last is not None else 0


def _steps(settings: Settings) -> list[Any]:
    from clawbridge.store import Store

    with Store.open(settings.db_url) as store:
        return store.training_steps()


def default_data_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="clawbridge-demo-"))
