"""Golden traces: what a seeded demo run asks of its backend and its gate, recorded exactly, so a
change that must not change behaviour (a refactor) can be proved bit-identical.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/golden.py record --model tiny-random --rounds 3 --out A.json
    ... change the code ...
    HF_HUB_OFFLINE=1 .venv/bin/python bench/golden.py record --model tiny-random --rounds 3 --out B.json
    .venv/bin/python bench/golden.py compare A.json B.json

The run is `clawbridge demo` itself (in-process, fp32 engine, seeded), with recorders on the local
backend's verbs and on the gate's decisions: every `train_step` (its datums: prompt, completion,
logprobs, advantages, teacher prompt; the loss and optimizer specs; the metrics it returned),
every publish, blend, rollback, restore and serve pin, and every gate decision (its record). Floats
are written with `repr`, so equal files mean equal bits. Compare traces made on the same host: the
same code on another CPU may round differently.
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


def install(trace: Trace) -> None:
    from clawbridge.backends.local import LocalBackend
    from clawbridge.learning.gate import Gate

    _record(trace, LocalBackend, "train_step", lambda a, r: {
        "datums": _plain(a[0]), "loss": _plain(a[1]), "optim": _plain(a[2]),
        "metrics": {k: v for k, v in _plain(r).items() if k != "seconds"},
    })
    for verb in ("publish", "blend", "rollback"):
        _record(trace, LocalBackend, verb, lambda a, r: {"args": _plain(a), "version": r.version})
    _record(trace, LocalBackend, "restore", lambda a, r: {"args": _plain(a)})
    _record(trace, LocalBackend, "serve", lambda a, r: {"args": _plain(a)})
    _record(trace, Gate, "evaluate", lambda a, r: {"decision": _plain(r.record())})


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--model", default="tiny-random")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--scenario", default="concise")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.model, args.rounds, args.seed, args.scenario, args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    raise SystemExit(main())
