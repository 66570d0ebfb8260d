"""A user's short request while the learner works on the same engine (docs/engine.md#the-user-first).

Starts the server in process (`serve`, the local backend on the embedded model, learning off) and
asks it, through the real `openai` client, one short chat request at a time (16 tokens, greedy,
a random pause before each), in these conditions:

- idle: nothing else runs;
- sampling: what the gate does, through the backend at background priority: 16 probe questions
  of 48 tokens at once, asked again as soon as they are answered;
- training: `train_step` back to back on a batch like the learner's (8 samples of 120-250
  tokens, packed into rows of 256: one micro-batch a row; the top-20 distillation on), learning
  rate 0.
- busy: the sampling above while two users send 16-token requests, each the next as soon as its
  last ends: modes `on` (the default share) and `on-strict` (share 0). Their requests, of one
  length, end in the same step: background rows step in the round trip before the next ones.
- share: two users whose requests overlap without a pause, of two lengths (answers of 24 and 17
  tokens: they end in different steps, so one is in flight but for a round trip now and then),
  for `--share-seconds`, and the learner's draw (up to 120 tokens, one seed: the same completion
  each time) at background priority, one after another: modes `users` (no learner) and `on` (the
  default share). Prints the learner's draw time beside its time alone on the idle engine, and
  the users' p95 beside theirs without it.

Modes, alternating round by round in the same process so that a busy machine slows all alike:
`off` (the engine's `user_first` off: arrival order, jobs between decode steps), `on`;
`on-nopause` (sampling: a user's request admitted first but never pausing the background rows: it
waits for a free row, then decodes beside them); `split` (training: the split of the two cores instead, measured for the
choice: the server on one torch thread, the steps on the other in a second process).

Prints the p50 and p95 latency and their ratios to the idle server's (same mode), and the
background work done meanwhile; `--json` writes it all.

    .venv/bin/python bench/user_first.py [--requests 12] [--rounds 2] [--timeout 120] [--conditions idle,busy]
        [--json out.json]
    .venv/bin/python bench/user_first.py --conditions share [--share-seconds 60] [--rounds 2]

A request the client gives up on (`--timeout`) counts as the timeout: in arrival order, with steps
back to back, every token of a request waits for a whole step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import openai
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.config import Settings
from clawbridge.local_gpu import models, precision
from clawbridge.local_gpu.engine import Engine
from clawbridge.server import Running, serve
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams

USER_PROMPT = "Explain in a few sentences how a bicycle stays upright."
PROBES = [
    "What is the capital of France?", "How many legs does a spider have?", "What is 12 times 12?",
    "Name a primary colour.", "What gas do plants take in?", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "What is the largest planet?",
    "How many days are in a leap year?", "What is the chemical symbol for gold?",
    "What language is spoken in Brazil?", "What is the square root of 81?",
    "Which ocean is the largest?", "What is the freezing point of water in Fahrenheit?",
    "How many continents are there?", "What do bees make?",
]
SHARE_LENGTHS = (24, 17)  # the share's two users: their requests end in different decode steps
# the learner's draw in `share`: one seed, so that every draw is the same completion (a paused and
# resumed draw is the one drawn uninterrupted), alone as under the users
DRAW_PROMPT = "Write a long story about a lighthouse keeper and a storm."
DRAW = SamplingParams(max_tokens=120, temperature=0.8, seed=11)


def start_server(settings: Settings, backend: LocalBackend) -> tuple[Running, asyncio.AbstractEventLoop]:
    ready = threading.Event()
    box: dict[str, Any] = {}

    def started(r: Running) -> None:
        box["r"], box["loop"] = r, asyncio.get_running_loop()
        ready.set()

    threading.Thread(target=lambda: asyncio.run(serve(settings, backend=backend, quiet=True, started=started)),
                     daemon=True).start()
    if not ready.wait(600):
        raise SystemExit("the server did not start")
    return box["r"], box["loop"]


class Load:
    """Background work on the server's loop until stopped; counts what it got done."""

    def __init__(self, backend: LocalBackend, probes: list[list[int]], batch: list[Datum]) -> None:
        self.backend, self.probes, self.batch = backend, probes, batch
        self.stop = asyncio.Event()
        self.tokens = self.steps = 0
        self.step_seconds: list[float] = []

    async def sampling(self) -> None:
        params = SamplingParams(max_tokens=48, temperature=0.7)
        while not self.stop.is_set():
            outs = await asyncio.gather(*(self.backend.sample(p, params, priority="background") for p in self.probes))
            self.tokens += sum(len(c.tokens) for [c] in outs)

    async def training(self) -> None:
        while not self.stop.is_set():
            m = await self.backend.train_step(self.batch, LossSpec(topk=20), OptimSpec(learning_rate=0.0))
            self.steps += 1
            self.step_seconds.append(m.seconds)


class Learner:
    """The learner's draws (`DRAW`) at background priority, one after another until stopped: the
    seconds of each that ended before, and how long the one left had run."""

    def __init__(self, backend: LocalBackend, prompt: list[int]) -> None:
        self.backend, self.prompt = backend, prompt
        self.stop = asyncio.Event()
        self.draws: list[float] = []
        self.started = 0.0

    async def run(self) -> None:
        while not self.stop.is_set():
            self.started = time.perf_counter()
            await self.backend.sample(self.prompt, DRAW, priority="background")
            if not self.stop.is_set():
                self.draws.append(time.perf_counter() - self.started)


def training_batch(samples: int = 8) -> list[Datum]:
    """Samples like the learner's (120-250 tokens, half of them completion), each distilled from
    a teacher prompt as long as its prompt: random ids (speed does not depend on them)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(samples):
        tokens = 120 + (130 * i) // (samples - 1)
        ids = torch.randint(100, 40000, (tokens,), generator=g).tolist()
        half = tokens // 2
        out.append(Datum(tuple(ids[:half]), tuple(ids[half:]), (-2.0,) * (tokens - half), (0.5,) * (tokens - half),
                         teacher_prompt_ids=tuple(ids[:half])))
    return out


def train_alone() -> None:
    """The split's trainer: the same steps on its own engine and one torch thread, a line per step."""
    engine = Engine(models.resolve(models.EMBEDDED), data_dir=Path(tempfile.mkdtemp(prefix="user-first-trainer-")),
                    dtype=precision.resolve("auto", "cpu"), threads=1)
    engine.start()
    batch = training_batch()
    print("ready", flush=True)
    while True:
        m = asyncio.run(engine.train_step(batch, LossSpec(topk=20), OptimSpec(learning_rate=0.0)))
        print(f"step {m.seconds:.3f}", flush=True)


class Trainer:
    """`train_alone` in a second process, while the server computes on one thread."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--trainer"], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the trainer process did not start")

    def stop(self) -> tuple[int, list[float]]:
        """(steps done, their seconds)."""
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=60)
        seconds = [float(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
        return len(seconds), seconds


def engine_threads(engine: Engine, loop: asyncio.AbstractEventLoop, n: int) -> None:
    """torch's intra-op threads of the engine's own thread (set per thread once it computes)."""
    asyncio.run_coroutine_threadsafe(engine._call(torch.set_num_threads, n), loop).result(600)


def ask(client: openai.OpenAI, model: str, max_tokens: int = 16) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": USER_PROMPT}],
                                       max_tokens=max_tokens, temperature=0,
                                       extra_headers={"X-Train": "false", "X-Session-Done": "true"})
    return time.perf_counter() - t0, r.usage.completion_tokens if r.usage else 0


def measure(client: openai.OpenAI, model: str, n: int, rng: random.Random) -> list[float]:
    """`n` requests' seconds; one the client gave up on counts as its timeout (a lower bound)."""
    out = []
    for _ in range(n):
        time.sleep(rng.uniform(0.2, 1.0))  # arrive at any point of the background's cycle
        try:
            seconds, tokens = ask(client, model)
        except openai.APITimeoutError:
            seconds, tokens = client.timeout, 16  # type: ignore[assignment]
            print(f"  (given up after {seconds:.0f} s)")
        if tokens != 16:
            print(f"  (an answer of {tokens} tokens)")
        out.append(seconds)
    return out


def measure_busy(client: openai.OpenAI, model: str, n: int) -> list[float]:
    """`n` requests' seconds from two users who never pause (each sends the next as soon as its
    previous one ends), so a user's request is always in flight."""
    out: list[float] = []

    def user() -> None:
        for _ in range(n // 2):
            out.append(ask(client, model)[0])

    users = [threading.Thread(target=user) for _ in range(2)]
    for t in users:
        t.start()
    for t in users:
        t.join()
    return out


def measure_share(client: openai.OpenAI, model: str, seconds: float) -> list[float]:
    """The seconds of the requests of two users who never pause, one per length of
    `SHARE_LENGTHS`, for `seconds`."""
    out: list[float] = []
    end = time.perf_counter() + seconds

    def user(length: int) -> None:
        while time.perf_counter() < end:
            took, tokens = ask(client, model, length)
            if tokens != length:
                print(f"  (an answer of {tokens} tokens, not {length})")
            out.append(took)

    users = [threading.Thread(target=user, args=(n,)) for n in SHARE_LENGTHS]
    for t in users:
        t.start()
        time.sleep(0.05)
    for t in users:
        t.join()
    return out


def run_share(client: openai.OpenAI, model: str, backend: LocalBackend, loop: asyncio.AbstractEventLoop,
              prompt: list[int], rounds: int, seconds: float) -> dict[str, Any]:
    """The `share` condition: per round the learner's draws alone (three), then the two users
    for `seconds` without the learner and with it (the order alternating by round)."""
    engine = backend.engine
    engine.user_first = True
    alone: list[float] = []
    lat: dict[str, list[float]] = {"users": [], "on": []}
    draws: list[float] = []
    left: list[float] = []
    tokens = 0
    for rnd in range(rounds):
        for _ in range(3):
            t0 = time.perf_counter()
            [c] = asyncio.run_coroutine_threadsafe(backend.sample(prompt, DRAW, priority="background"), loop).result(600)
            alone.append(time.perf_counter() - t0)
            tokens = len(c.tokens)
        print(f"round {rnd} share/draw alone ({tokens} tokens): " + " ".join(f"{x:.2f}" for x in alone[-3:]),
              flush=True)
        for mode in ("users", "on") if rnd % 2 == 0 else ("on", "users"):
            learner = Learner(backend, prompt)
            task = asyncio.run_coroutine_threadsafe(learner.run(), loop) if mode == "on" else None
            time.sleep(0.5 if task else 0)
            lat[mode].extend(measure_share(client, model, seconds))
            if task is not None:
                stopped = time.perf_counter()
                loop.call_soon_threadsafe(learner.stop.set)
                task.result(600)
                draws.extend(learner.draws)
                left.append(stopped - learner.started)
                done = " ".join(f"{x:.2f} s" for x in learner.draws) or "none"
                print(f"round {rnd} share/on: learner's draws {done}, one left after {left[-1]:.1f} s", flush=True)
            print(f"round {rnd} share/{mode}: {len(lat[mode])} requests so far, p95 {p95(lat[mode]):.2f} s", flush=True)
    return {"draw_tokens": tokens, "draw_alone_s": alone, "draws_s": draws, "draw_left_s": left,
            "users": {k: {"p50": statistics.median(v), "p95": p95(v), "n": len(v)} for k, v in lat.items()}}


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12, help="user requests per condition, mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120, help="seconds a request is waited for (counted as that)")
    ap.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)  # the split's training process
    ap.add_argument("--conditions", default="idle,sampling,training,busy",
                    help="which to run (idle always runs: the ratios' reference)")
    ap.add_argument("--share-seconds", type=float, default=60, help="seconds of the two users per mode of `share`")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.trainer:
        return train_alone()
    settings = Settings(model=models.EMBEDDED, data_dir=Path(tempfile.mkdtemp(prefix="user-first-")), port=0,
                        train=False)
    backend = LocalBackend.from_settings(settings)
    running, loop = start_server(settings, backend)
    renderer = Renderer(backend.tokenizer())
    probes = [renderer.render([{"role": "user", "content": q}]) for q in PROBES]
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", timeout=args.timeout, max_retries=0)
    model, rng, engine = backend.model_name, random.Random(0), backend.engine
    for _ in range(3):
        ask(client, model)  # warm up
    load_before = os.getloadavg()[0]
    # condition -> its modes: (name, user_first, pausing background rows, split training off to a process)
    plan = {"idle": [("off", False, True, False), ("on", True, True, False)],
            "sampling": [("off", False, True, False), ("on", True, True, False), ("on-nopause", True, False, False)],
            "training": [("off", False, True, False), ("on", True, True, False), ("split", True, True, True)],
            "busy": [("on", True, True, False), ("on-strict", True, True, False)]}
    wanted = {"idle", *args.conditions.split(",")}
    plan = {k: v for k, v in plan.items() if k in wanted}
    pause, threads, share = engine._pause, torch.get_num_threads(), engine.background_share
    lat: dict[str, list[float]] = {}
    work: dict[str, dict[str, float]] = {}
    for rnd in range(args.rounds):
        for condition, modes in plan.items():
            for name, user_first, pausing, split in (modes if rnd % 2 == 0 else modes[::-1]):
                engine.user_first = user_first
                engine.background_share = 0.0 if name == "on-strict" else share
                engine._pause = pause if pausing else (lambda: None)  # type: ignore[method-assign]
                load = Load(backend, probes, training_batch())
                trainer = Trainer() if split else None
                task = None if condition == "idle" or split else asyncio.run_coroutine_threadsafe(
                    getattr(load, "sampling" if condition == "busy" else condition)(), loop)
                if split:
                    engine_threads(engine, loop, 1)
                time.sleep(0.5 if task else 0)
                key = f"{condition}/{name}"
                t0 = time.perf_counter()
                lat.setdefault(key, []).extend(measure_busy(client, model, args.requests) if condition == "busy"
                                               else measure(client, model, args.requests, rng))
                seconds = time.perf_counter() - t0
                if task is not None:
                    loop.call_soon_threadsafe(load.stop.set)
                    task.result(600)
                if trainer is not None:
                    load.steps, load.step_seconds = trainer.stop()
                    engine_threads(engine, loop, threads)
                w = work.setdefault(key, {"seconds": 0.0, "background_tokens": 0, "steps": 0, "step_s": 0.0})
                w["seconds"] += seconds
                w["background_tokens"] += load.tokens
                w["steps"] += load.steps
                w["step_s"] = statistics.median(load.step_seconds) if load.step_seconds else w["step_s"]
                print(f"round {rnd} {key}: " + " ".join(f"{x:.2f}" for x in lat[key][-args.requests:]), flush=True)
    engine.background_share, engine._pause = share, pause  # type: ignore[method-assign]
    draw_prompt = renderer.render([{"role": "user", "content": DRAW_PROMPT}])
    shared = run_share(client, model, backend, loop, draw_prompt, args.rounds, args.share_seconds) \
        if "share" in wanted else None
    running.server.should_exit = True
    loads = (load_before, os.getloadavg()[0])
    print(f"\n{backend.dtype}, {threads} threads; load average {loads[0]:.1f} before, {loads[1]:.1f} after "
          f"(this run's own work included)")
    rows = {}
    print(f"{'condition/mode':24s} {'p50 s':>7s} {'p95 s':>7s} {'p50/idle':>9s} {'p95/idle':>9s}  background")
    for key, xs in lat.items():
        idle = lat["idle/off" if key.endswith("/off") else "idle/on"]  # busy: against one user's idle request
        w = work[key]
        rows[key] = {"p50": statistics.median(xs), "p95": p95(xs), "n": len(xs), "p50_ratio": statistics.median(xs) / statistics.median(idle),
                     "p95_ratio": p95(xs) / p95(idle), "background_tokens_per_s": w["background_tokens"] / w["seconds"],
                     "steps_per_min": 60 * w["steps"] / w["seconds"], "step_seconds": w["step_s"]}
        r = rows[key]
        extra = (f"{r['background_tokens_per_s']:.0f} tok/s" if key.startswith(("sampling", "busy")) else
                 f"{r['steps_per_min']:.1f} steps/min, a step {r['step_seconds']:.1f} s" if key.startswith("training") else "")
        print(f"{key:24s} {r['p50']:7.2f} {r['p95']:7.2f} {r['p50_ratio']:9.2f} {r['p95_ratio']:9.2f}  {extra}")
    if shared is not None:
        alone, draws, users = statistics.median(shared["draw_alone_s"]), shared["draws_s"], shared["users"]
        print(f"\nshare ({share:g}; users of {' and '.join(map(str, SHARE_LENGTHS))} tokens, "
              f"{args.share_seconds:g} s a mode): the learner's draw of {shared['draw_tokens']} tokens alone "
              f"{alone:.2f} s (median)")
        if draws:
            print(f"  under the users: {len(draws)} draws, median {statistics.median(draws):.2f} s "
                  f"({statistics.median(draws) / alone:.1f}x alone), first {draws[0]:.2f} s")
        else:
            print("  under the users: no draw finished (left after " +
                  ", ".join(f"{x:.1f}" for x in shared["draw_left_s"]) + " s)")
        print(f"  users' p50 / p95: {users['users']['p50']:.2f} / {users['users']['p95']:.2f} s without the learner, "
              f"{users['on']['p50']:.2f} / {users['on']['p95']:.2f} s with it "
              f"(p95 {users['on']['p95'] / users['users']['p95']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"dtype": backend.dtype, "threads": threads, "load": loads,
                                         "requests": args.requests, "rounds": args.rounds, "results": rows,
                                         "share": shared}, indent=2))


if __name__ == "__main__":
    main()
