"""Learning measured where users are: `clawbridge up` with its defaults, a simulated user talking to
it through the real `openai` client, no demo code in the server.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/real_use.py --scenario concise --seed 0 \
        --conversations 120 --every 20 --json real_use.json

What it does, in order:

    start `clawbridge up` (its defaults; `--config FILE` adds a settings file) on a free loopback port
    measure the base: held-out prompts plain (v0) and asked for the preference (the twin: the
    scenario's first correction as a system instruction), and a short request's idle latency
    repeat: one conversation (a tagged session: the question, the answer, the user's reply: thanks
    when the answer meets the preference and answers the question, the correction otherwise; the
    session closes; the user takes `--think-s` to read an answer and type each message: 0 is an
    agent that never pauses), then a short request timed while the learner works; every `--every`
    conversations (and after each of `--at`'s) the held-out prompts are asked again, as served and with `X-Instructions: off`
    (the weights alone; a server that does not know the header serves the weights alone anyway)
    stop the server (SIGTERM, by its PID)

The held-out prompts are asked with `X-Train: false` and the same seed for every version (common
random numbers), graded by the scenario's check; they are never trained on. It prints the two
curves by conversations, the conversation at which the preference first shows (the served rate's
paired 95 % interval against v0 above zero) and at which the server reports the preference's
instruction retired, the general probe at v0 and at the last gate decision (the server's
`/metrics`), a short request's latency idle and while the learner works (split by what
`/v1/status` says it does just before and after the request: the gate sampling, a training step,
otherwise), and the wall time.
`--json FILE` writes them: served_curve, weights_curve, twin, v0, first_shown_at, retired_at,
probe_v0, probe_last, price_points, latency, seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from clawbridge.demo.runner import eval_seed
from clawbridge.demo.scenario import Scenario, load, paired_interval
from openai import AsyncOpenAI

SHORT_PROMPT = "Say hello in one word."


@dataclass
class Point:
    """The held-out figures after `conversations` conversations."""

    conversations: int
    truly: float  # mean over prompts of the rate of truly satisfied answers
    per_prompt: list[float]
    served_version: int | None = None
    examples: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Report:
    scenario: str
    seed: int
    think_s: float
    v0: Point
    twin: Point
    served_curve: list[Point] = field(default_factory=list)
    weights_curve: list[Point] = field(default_factory=list)
    first_shown_at: int | None = None
    retired_at: int | None = None
    probe_v0: float | None = None
    probe_last: float | None = None
    price_points: float | None = None  # what the preferences cost v0's general answers when asked for them
    latency: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`clawbridge up` as a child process, ended by its PID."""

    def __init__(self, data_dir: Path, config: Path | None, log: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "clawbridge"
        cmd = [str(exe), "up", "--port", str(self.port), "--data-dir", str(data_dir), *extra]
        if config is not None:
            cmd += ["--config", str(config)]
        self.log = log.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"clawbridge up exited with {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"clawbridge up not ready after {timeout_s:.0f} s: see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class User:
    """The simulated user and the grader, both through the public API."""

    def __init__(self, url: str, scenario: Scenario, max_tokens: int, eval_samples: int, think_s: float = 0.0) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=1800)
        self.client = AsyncOpenAI(base_url=f"{url}/v1", api_key="clawbridge", timeout=1800, max_retries=3)
        self.scenario, self.max_tokens, self.eval_samples = scenario, max_tokens, eval_samples
        self.think_s = think_s  # reading an answer and typing a message
        self.model = ""

    async def start(self) -> None:
        self.model = (await self.client.models.list()).data[0].id

    async def converse(self, prompt: str, i: int, max_tokens: int | None) -> bool:
        sc = self.scenario
        head = {"X-Session-Id": f"user-{uuid.uuid4().hex[:12]}", "X-Turn-Type": "main"}
        await asyncio.sleep(self.think_s)  # typing the question
        first = await self.client.chat.completions.create(
            model=self.model, messages=sc.messages(prompt), extra_headers=head,  # type: ignore[arg-type]
            **({"max_tokens": max_tokens} if max_tokens else {}),
        )
        choice = first.choices[0]
        answer = choice.message.content or ""
        v = sc.rate(prompt, answer, choice.finish_reason)
        history = [*sc.messages(prompt), {"role": "assistant", "content": answer},
                   {"role": "user", "content": sc.reply(v.preferred, i, answered=v.answered, prompt=prompt)}]
        # the reply is the first turn's next state; its own answer is not read, and the session ends
        await asyncio.sleep(self.think_s)  # reading the answer, typing the reply
        await self.client.chat.completions.create(
            model=self.model, messages=history, max_tokens=1,  # type: ignore[arg-type]
            extra_headers={**head, "X-Session-Done": "true"},
        )
        return v.truly

    async def heldout(self, conversations: int, *, system: str | None = None, weights_only: bool = False) -> Point:
        sc = self.scenario
        head = {"X-Train": "false", "X-Session-Done": "true"}
        if weights_only:
            head["X-Instructions"] = "off"

        async def one(prompt: str) -> tuple[float, dict[str, str]]:
            messages = sc.messages(prompt)
            if system is not None:
                messages = [{"role": "system", "content": system}, *[m for m in messages if m["role"] != "system"]]
            resp = await self.client.chat.completions.create(
                model=self.model, messages=messages, n=self.eval_samples,  # type: ignore[arg-type]
                max_tokens=self.max_tokens, seed=eval_seed(prompt),
                extra_headers={**head, "X-Session-Id": f"eval-{uuid.uuid4().hex[:12]}"},
            )
            verdicts = [sc.rate(prompt, c.message.content or "", c.finish_reason) for c in resp.choices]
            return (sum(v.truly for v in verdicts) / len(verdicts),
                    {"prompt": prompt, "answer": resp.choices[0].message.content or ""})

        rated = await asyncio.gather(*(one(p) for p in sc.heldout_prompts))
        per_prompt = [r for r, _ in rated]
        status = await self.status()
        return Point(conversations, sum(per_prompt) / len(per_prompt), per_prompt,
                     _served_version(status), [ex for _, ex in rated])

    async def short_request(self) -> float:
        t0 = time.monotonic()
        await self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": SHORT_PROMPT}], max_tokens=16,
            extra_headers={"X-Train": "false", "X-Session-Done": "true",
                           "X-Session-Id": f"ping-{uuid.uuid4().hex[:12]}"},
        )
        return time.monotonic() - t0

    async def busy(self) -> set[str]:
        """What the learner does on the engine now (`/v1/status`: "training", "judging", "gate
        references", "settling")."""
        r = await self.http.get("/v1/status")
        r.raise_for_status()
        busy = (r.json().get("extra") or {}).get("busy") or ""
        return {b.strip() for b in str(busy).split(",") if b.strip()}

    async def status(self) -> dict[str, Any]:
        """/v1/status, with the preferences' list (`/v1/preferences`: each with its state)."""
        r = await self.http.get("/v1/status")
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        p = await self.http.get("/v1/preferences")
        if p.status_code == 200:  # a server without the route: no preferences to report
            body["preferences"] = p.json().get("data", [])
        return body

    async def metrics(self) -> dict[str, float]:
        r = await self.http.get("/metrics")
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#") and " " in line:
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    async def aclose(self) -> None:
        await self.client.close()
        await self.http.aclose()


def _served_version(status: dict[str, Any]) -> int | None:
    for key in ("version", "policy_version", "serving"):
        value = status.get(key)
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.lstrip("v").isdigit():
            return int(value.lstrip("v"))
    return None


def _retired(status: dict[str, Any]) -> bool:
    """The server reports a preference whose instruction the weights now carry."""
    prefs = status.get("preferences")
    return isinstance(prefs, list) and any(isinstance(p, dict) and p.get("state") == "learned" for p in prefs)


def _metric(metrics: dict[str, float], suffix: str) -> float | None:
    hits = [v for k, v in metrics.items() if k.split("{")[0].endswith(suffix)]
    return hits[-1] if hits else None


def percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * (len(ys) - 1))))]


def phase(seen: set[str]) -> str:
    """Which of the learner's works a timed request ran beside (what `/v1/status` said just before
    and just after it): "gate" (judging a candidate, or asking v0 and the twin), "step" (a
    training step), "other" (settling the collector's samples, or nothing)."""
    if seen & {"judging", "gate references"}:
        return "gate"
    return "step" if "training" in seen else "other"


def latency_figures(idle: list[float], timed: list[tuple[float, str]]) -> dict[str, float]:
    """p50 and p95 idle, while learning (every timed request after the first conversation) and
    by the learner's work (`phase`), with how many requests each has."""
    out = {"idle_p50": statistics.median(idle), "idle_p95": percentile(idle, 0.95)}
    groups = {"working": [t for t, _ in timed], **{ph: [t for t, p in timed if p == ph] for ph in ("gate", "step", "other")}}
    for name, xs in groups.items():
        if xs:
            out.update({f"{name}_p50": statistics.median(xs), f"{name}_p95": percentile(xs, 0.95),
                        f"{name}_n": float(len(xs))})
    out["working_max"] = max(t for t, _ in timed)
    return out


async def run(args: argparse.Namespace) -> Report:
    scenario = load(args.scenario)
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="real-use-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "server.log"
    extra = ["--model", args.model] if args.model else []
    t0 = time.monotonic()
    server = Server(data_dir, Path(args.config) if args.config else None, log, extra)
    try:
        await asyncio.to_thread(server.wait_ready)
        user = User(server.url, scenario, args.max_tokens, args.eval_samples, args.think_s)
        await user.start()
        try:
            return await _day(user, scenario, args, t0)
        finally:
            await user.aclose()
    finally:
        server.stop()
        print(f"server log: {log}", file=sys.stderr)


async def _day(user: User, scenario: Scenario, args: argparse.Namespace, t0: float) -> Report:
    say = lambda msg: print(f"[{time.monotonic() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    idle = [await user.short_request() for _ in range(args.idle_pings)]
    v0 = await user.heldout(0)
    twin = await user.heldout(0, system=scenario.replies.unsatisfied[0])
    say(f"v0 truly satisfied {v0.truly:.0%}; asked for it (the twin) {twin.truly:.0%}")
    metrics0 = await user.metrics()
    report = Report(scenario.name, args.seed, args.think_s, v0, twin)
    prompts = list(scenario.training_prompts)
    rng = random.Random(args.seed)
    timed: list[tuple[float, str]] = []  # a short request's latency, and what the learner did meanwhile
    at = {int(x) for x in args.at.split(",") if x.strip()}
    for i in range(1, args.conversations + 1):
        if (i - 1) % len(prompts) == 0:
            rng.shuffle(prompts)
        await user.converse(prompts[(i - 1) % len(prompts)], i, args.user_max_tokens)
        before = await user.busy()
        latency = await user.short_request()
        timed.append((latency, phase(before | await user.busy())))
        if i % args.every == 0 or i in at or i == args.conversations:
            served = await user.heldout(i)
            weights = await user.heldout(i, weights_only=True)
            report.served_curve.append(served)
            report.weights_curve.append(weights)
            status = await user.status()
            report.status = status
            learner = status.get("extra") or {}  # the learner's fields on /v1/status
            if report.first_shown_at is None and paired_interval(v0.per_prompt, served.per_prompt)[1] > 0:
                report.first_shown_at = i
            if report.retired_at is None and _retired(status):
                report.retired_at = i
            say(f"{i} conversations: served {served.truly:.0%}, weights alone {weights.truly:.0%} "
                f"(v{served.served_version}); learner {json.dumps({k: learner.get(k) for k in ('step', 'gate', 'samples')})}")
    metrics = await user.metrics()
    report.probe_v0 = _metric(metrics, "preferences_probe_plain") or _metric(metrics0, "preferences_probe_plain")
    report.probe_last = _metric(metrics, "gate_probe_candidate")
    report.price_points = _metric(metrics, "preferences_price_points")
    report.latency = latency_figures(idle, timed)
    report.seconds = time.monotonic() - t0
    return report


def print_report(r: Report) -> None:
    print(f"scenario {r.scenario}, seed {r.seed}, the user thinking {r.think_s:g} s a message: v0 {r.v0.truly:.0%}, the twin {r.twin.truly:.0%} (truly satisfied, held-out)")
    print(f"{'conversations':>13}  {'served':>7}  {'weights':>7}  {'Δ weights vs v0 [95 %]':>24}")
    for s, w in zip(r.served_curve, r.weights_curve, strict=True):
        mean, lo, hi = paired_interval(r.v0.per_prompt, w.per_prompt)
        print(f"{s.conversations:>13}  {s.truly:>7.0%}  {w.truly:>7.0%}  {mean * 100:>+8.1f} [{lo * 100:+.0f}, {hi * 100:+.0f}]")
    print(f"first shown at {r.first_shown_at} conversations; instruction retired at {r.retired_at}")
    print(f"general probe: v0 {r.probe_v0}, last {r.probe_last}; the preferences' price {r.price_points} points")
    lat = r.latency
    print(f"a short request: idle p50 {lat['idle_p50']:.2f} s p95 {lat['idle_p95']:.2f} s; while learning "
          f"p50 {lat['working_p50']:.2f} s p95 {lat['working_p95']:.2f} s max {lat['working_max']:.2f} s "
          f"(p95 ratio {lat['working_p95'] / lat['idle_p95']:.1f}x)")
    for ph, what in (("gate", "while the gate samples"), ("step", "while a step trains"), ("other", "otherwise")):
        if f"{ph}_n" in lat:
            print(f"  {what}: {lat[f'{ph}_n']:.0f} requests, p50 {lat[f'{ph}_p50']:.2f} s p95 {lat[f'{ph}_p95']:.2f} s "
                  f"(p95 ratio {lat[f'{ph}_p95'] / lat['idle_p95']:.1f}x)")
    print(f"wall {r.seconds:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="concise", help="A built-in scenario or a YAML/JSON file (the demo's format).")
    p.add_argument("--seed", type=int, default=0, help="Order of the training prompts.")
    p.add_argument("--conversations", type=int, default=120)
    p.add_argument("--every", type=int, default=20, help="Measure the held-out prompts every N conversations.")
    p.add_argument("--at", default="10", help="Also measure after these conversations (comma-separated).")
    p.add_argument("--eval-samples", type=int, default=2, help="Answers per held-out prompt and measurement.")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of a held-out answer.")
    p.add_argument("--user-max-tokens", type=int, default=0, help="max_tokens the user's agent sends (0: none, the server's default).")
    p.add_argument("--think-s", type=float, default=3.0,
                   help="Seconds the user takes to read an answer and type each message (0: an agent that never pauses).")
    p.add_argument("--idle-pings", type=int, default=10, help="Short requests timed before any conversation.")
    p.add_argument("--model", default=None, help="Passed to clawbridge up (default: its own).")
    p.add_argument("--config", default=None, help="A settings file passed to clawbridge up.")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None, help="Write the figures to this file.")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = asyncio.run(run(args))
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
