"""Golden traces: what the learner asks of its backend and its gate, recorded exactly, so a change
that must not change behaviour (a refactor) can be proved bit-identical.

    .venv/bin/clawbridge demo --model tiny-random --rounds 3 --data-dir RUN/data      # once: turns to learn from
    HF_HUB_OFFLINE=1 .venv/bin/python bench/golden.py replay RUN/data --model tiny-random --steps 3 --out A.json
    ... change the code ...
    HF_HUB_OFFLINE=1 .venv/bin/python bench/golden.py replay RUN/data --model tiny-random --steps 3 --out B.json
    .venv/bin/python bench/golden.py compare A.json B.json

`--scenario tools` replays a tools demo's run (`clawbridge demo --scenario tools --data-dir RUN/data`):
its episodes' groups are settled again (their outcomes are what the agent reported, kept) and
the steps trained from them.

`replay` copies a run's data directory, forgets everything learned from it (samples, judgments,
steps, versions after v0, the gate's and the trainer's records, adapters) and keeps what was
captured (sessions, turns, next states); then it builds the learner's parts on the local backend
(fp32, the demo's settings for the scenario) and drives them one after another, with no server and
no clock: the collector judges every turn, one at a time, then the trainer takes `steps` steps,
each judged by the gate. The engine decodes one row at a time and keeps no prefix cache (a row's last
bits can depend on the rows batched beside it and on a prefill that reused another prompt's KV,
and which requests meet depends on timing), and sampling a request leaves
unseeded (a rewrite's teacher draws, fresh draws) is seeded from its prompt and how often that
prompt was asked, so concurrency cannot reorder the dice.

Recorded: every `train_step` (its datums: prompt, completion, logprobs, advantages, teacher
prompt; the loss and optimizer specs; the metrics it returned), every publish, blend, rollback,
restore and serve pin, and every gate decision (its record). Floats are written with `repr`, so
equal files mean equal bits. Compare traces made on the same host: the same code on another CPU
may round differently. (`record` runs `clawbridge demo` itself under the same recorders: its
conversations run concurrently, so two runs differ; it is for reading, not comparing.)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

Trace = list[dict[str, Any]]


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


def _record(trace: Trace, cls: type, name: str, summary: Callable[[tuple[Any, ...], Any], dict[str, Any]]) -> None:
    """Wrap `cls.name` (sync or async) so every call appends `summary(args, result)` to `trace`."""
    original = getattr(cls, name)
    if asyncio.iscoroutinefunction(original):
        async def wrapped_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = await original(self, *args, **kwargs)
            trace.append({"call": name, **summary(args + tuple(kwargs.values()), result)})
            return result
        setattr(cls, name, wrapped_async)
    else:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            trace.append({"call": name, **summary(args + tuple(kwargs.values()), result)})
            return result
        setattr(cls, name, wrapped)


def _without_seconds(record: dict[str, Any]) -> dict[str, Any]:
    """A gate record without the wall time it took."""
    figures = {k: v for k, v in record.get("figures", {}).items() if k != "seconds"}
    return {**record, "figures": figures}


def install(trace: Trace) -> None:
    from clawbridge.backends.local import LocalBackend
    from clawbridge.learning.gate import Gate
    from clawbridge.learning.lineages import LineageBackend

    _record(trace, LocalBackend, "train_step", lambda a, r: {
        "datums": _plain(a[0]), "loss": _plain(a[1]), "optim": _plain(a[2]),
        "metrics": {k: v for k, v in _plain(r).items() if k != "seconds"},
    })
    for verb in ("publish", "blend", "rollback"):
        _record(trace, LocalBackend, verb, lambda a, r: {"args": _plain(a), "version": r.version})
    _record(trace, LocalBackend, "restore", lambda a, r: {"args": _plain(a)})
    _record(trace, LocalBackend, "serve", lambda a, r: {"args": _plain(a)})
    _record(trace, LineageBackend, "serve", lambda a, r: {"args": _plain(a)})  # a user's lineage pins its own
    _record(trace, Gate, "evaluate", lambda a, r: {"decision": _without_seconds(_plain(r.record()))})


def seed_unseeded(cls: type) -> None:
    """Give every sampling request without a seed one derived from its prompt and how often that
    prompt was sampled before, so the order concurrent requests reach the engine does not matter."""
    import hashlib

    original = cls.sample
    asked: dict[tuple[int, ...], int] = {}

    async def sample(self: Any, prompt_ids: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if params.seed is None:
            key = tuple(int(t) for t in prompt_ids)
            k = asked[key] = asked.get(key, -1) + 1
            digest = hashlib.sha256(repr((key, k)).encode()).digest()
            params = dataclasses.replace(params, seed=int.from_bytes(digest[:7], "big"))
        return await original(self, prompt_ids, params, *args, **kwargs)

    cls.sample = sample


LEARNED = ("judgments", "samples", "training_steps", "leases")
# what was captured; an episode's outcome is the agent's report (captured), its group's settling learned
CAPTURED = {"sessions", "turns", "next_states", "alembic_version", "meta", "policy_versions", "groups", "episodes"}


def forget_learning(data_dir: Path) -> None:
    """Keep what was captured, forget what was learned: every table but the captured ones is
    emptied (new tables too), versions after v0 and the learner's meta records go, adapters go."""
    import shutil
    import sqlite3

    for child in data_dir.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
    db = sqlite3.connect(data_dir / "clawbridge.db")
    with db:
        tables = [r[0] for r in db.execute("select name from sqlite_master where type = 'table'")]
        for t in tables:
            if t not in CAPTURED and not t.startswith("sqlite_"):
                db.execute(f'delete from "{t}"')
        db.execute("update groups set state = 'closed', reason = null where state in ('trained', 'dropped')")
        db.execute("delete from policy_versions where version > 0")
        db.execute("delete from meta where key not like 'capture.%' and key not like 'store.%'")
    db.close()


async def _replay(data_dir: Path, model: str, scenario_name: str, steps: int, seed: int,
                  overrides: dict[str, Any]) -> None:
    """The run's captured turns learned again: every sample settled one at a time (the collector,
    or for the tools demo the episodes' groups: their outcomes are what the agent reported, kept),
    then `steps` steps, each judged by the gate."""
    from clawbridge.demo import scenario as scenarios
    from clawbridge.demo.runner import demo_settings, gate_probes
    from clawbridge.demo.tools import tools_settings
    from clawbridge.demo.tools_scenario import load as load_tools
    from clawbridge.learning.learner import Learner

    # one row at a time: a row's arithmetic can depend on the rows batched beside it (the last
    # bits of fp32 matrix products), and which requests meet in a batch depends on timing
    # and no prefix cache: whether a prompt's prefill reuses another's KV depends on what ran before
    exact = dict(model=model, seed=seed, engine_max_batch=1, prefix_cache_mb=0, **overrides)
    if scenario_name == "tools":
        tools = load_tools("tools")
        assert tools is not None
        settings = tools_settings(tools, data_dir, **exact)
        learner = Learner(settings)
    else:
        sc = scenarios.load(scenario_name)
        settings = demo_settings(sc, data_dir, **exact)
        learner = Learner(settings, probes=gate_probes(sc))
    await _learn(settings, learner, steps, episodes=scenario_name == "tools")


async def _learn(settings: Any, learner: Any, steps: int, *, episodes: bool) -> None:
    from clawbridge.backends.local import LocalBackend
    from clawbridge.demo.rounds import threads
    from clawbridge.learning.lineages import UserLineages
    from clawbridge.server import bind_learner
    from clawbridge.store import Store

    backend = LocalBackend.from_settings(settings, threads=threads())
    await backend.start()
    store = Store.open(settings.db_url)
    try:
        lineages = UserLineages(backend, store)  # as the server binds the learner: the user's own lineage
        await lineages.load()
        bind_learner(learner, backend, store, lineages=lineages)
        assert learner.parts is not None
        settle = learner.parts.episodes.run_once if episodes else learner.parts.collector.run_once
        settled = 0
        while (n := await settle(limit=1)) > 0:
            settled += n
        print(f"{'episodes' if episodes else 'collector'}: {settled} settled", file=sys.stderr)
        for k in range(steps):
            result = await learner.parts.trainer.step_once()
            print(f"step {k + 1}: {result}", file=sys.stderr)
            if result is None:
                break
    finally:
        store.close()
        await backend.close()


def replay(run_dir: Path, model: str, scenario: str, steps: int, seed: int, out: Path,
           overrides: dict[str, Any]) -> None:
    import shutil

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["CLAWBRIDGE_ENGINE_DTYPE"] = "fp32"
    trace: Trace = []
    install(trace)
    from clawbridge.backends.local import LocalBackend

    seed_unseeded(LocalBackend)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        shutil.copytree(run_dir, data)
        forget_learning(data)
        asyncio.run(_replay(data, model, scenario, steps, seed, overrides))
    out.write_text(json.dumps(trace, indent=1) + "\n")
    n = sum(1 for t in trace if t["call"] == "train_step")
    decisions = [t["decision"]["decision"] for t in trace if t["call"] == "evaluate"]
    print(f"{out}: {len(trace)} calls, {n} train steps, gate {decisions}", file=sys.stderr)


def record(model: str, rounds: int, seed: int, scenario: str, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["CLAWBRIDGE_ENGINE_DTYPE"] = "fp32"  # exact arithmetic on every host
    trace: Trace = []
    install(trace)
    from clawbridge.cli.main import app

    with tempfile.TemporaryDirectory() as tmp:
        args = ["demo", "--scenario", scenario, "--model", model, "--rounds", str(rounds), "--seed", str(seed),
                "--data-dir", str(Path(tmp) / "data"), "--out", str(Path(tmp) / "out"), "--json"]
        try:
            app(args, standalone_mode=False)
        except SystemExit as e:  # the demo exits non-zero when nothing improved: still a trace
            if e.code not in (0, 1, None):
                raise
    out.write_text(json.dumps(trace, indent=1) + "\n")
    steps = sum(1 for t in trace if t["call"] == "train_step")
    decisions = [t["decision"]["decision"] for t in trace if t["call"] == "evaluate"]
    print(f"{out}: {len(trace)} calls, {steps} train steps, gate {decisions}", file=sys.stderr)


def compare(a: Path, b: Path) -> int:
    ta, tb = json.loads(a.read_text()), json.loads(b.read_text())
    for i, (x, y) in enumerate(zip(ta, tb, strict=False)):
        if x != y:
            keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            print(f"differ at call {i} ({x.get('call')} vs {y.get('call')}): fields {keys}")
            return 1
    if len(ta) != len(tb):
        print(f"same first {min(len(ta), len(tb))} calls, then {len(ta)} vs {len(tb)} calls")
        return 1
    print(f"identical: {len(ta)} calls")
    return 0


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--model", default="tiny-random")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--scenario", default="concise")
    r.add_argument("--out", type=Path, required=True)
    rp = sub.add_parser("replay")
    rp.add_argument("run_dir", type=Path, help="A demo run's data directory (--data-dir).")
    rp.add_argument("--model", default="tiny-random")
    rp.add_argument("--steps", type=int, default=3)
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--scenario", default="concise")
    rp.add_argument("--out", type=Path, required=True)
    rp.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Settings over the demo's (flat names; values read as JSON, else text).")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.model, args.rounds, args.seed, args.scenario, args.out)
        return 0
    if args.cmd == "replay":
        replay(args.run_dir, args.model, args.scenario, args.steps, args.seed, args.out, _overrides(args.set))
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    raise SystemExit(main())
