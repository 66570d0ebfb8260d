"""The agentic demo (`clawbridge demo --scenario tools`) over seeds: held-out success before and
after, the paired 95 % interval, the wall time, and a few held-out episodes before/after to read.

    .venv/bin/python bench/tools_demo.py --seeds 0 1 2 --json tools-seeds.json
    .venv/bin/python bench/tools_demo.py --seeds 0 --set rounds=2 --set n=6     # a recipe change
    .venv/bin/python bench/tools_demo.py --base-rate --set eval_samples=8       # v0 only, no training

`--base-rate` evaluates policy@v0 alone (what the untrained model does on the held-out tasks:
success, clean success, right lookups) and prints every episode's transcript. Each phase goes to
stderr with the seconds since the start and the load average (where the wall time goes). Run it
under `nice` with `OMP_NUM_THREADS=1` on a shared machine: one seed of the default recipe takes
8-10 minutes on 2 busy cores, and two torch threads there stalled a run for minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clawbridge.demo import tools
from clawbridge.demo.rounds import Progress


def _recipe(sc: tools.ToolsScenario, sets: list[str]) -> tools.ToolsScenario:
    update: dict[str, Any] = {}
    for kv in sets:
        k, _, v = kv.partition("=")
        update[k] = json.loads(v) if v not in ("",) else v
    recipe = sc.recipe.updated(**update)
    return sc.model_copy(update={"recipe": recipe})


async def base_rate(sc: tools.ToolsScenario, model: str | None, seed: int) -> dict[str, Any]:
    """policy@v0 on the held-out tasks through the same stack (no training)."""
    from clawbridge.backends.local import LocalBackend
    from clawbridge.demo.rounds import threads
    from clawbridge.sdk.client import AsyncClient
    from clawbridge.server import serve

    data = Path(tempfile.mkdtemp(prefix="cb-tools-base-"))
    settings = tools.tools_settings(sc, data, model=model, seed=seed, gate="off")
    backend = LocalBackend.from_settings(settings, threads=threads())
    ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        serve(settings, backend=backend, quiet=True, started=ready.set_result)
    )
    running = await ready
    t0 = time.monotonic()
    try:
        agent = tools.Agent(AsyncClient(running.base_url, timeout=1800), running.proxy.model_name, sc,
                            settings.training.batch_size)
        rated = await asyncio.gather(*(_all(agent, t) for t in sc.heldout_tasks))
    finally:
        running.server.should_exit = True
        await asyncio.wait_for(server, 120)
    grades = [g for gs, _ in rated for g in gs]
    n = len(grades)
    for gs, trs in rated:
        for g, tr in zip(gs, trs, strict=True):
            print(
                f"{'OK ' if g.success else '-- '}{tr.task.question} ({tr.task.code}): {tr.text()}"
            )
    return {
        "episodes": n,
        "success": sum(g.success for g in grades) / n,
        "clean": sum(g.clean for g in grades) / n,
        "looked_up": sum(g.looked_up for g in grades) / n,
        "seconds": round(time.monotonic() - t0, 1),
    }


async def _all(
    agent: tools.Agent, task: tools.Task
) -> tuple[list[tools.Grade], list[tools.Transcript]]:
    async def one() -> tuple[tools.Grade, tools.Transcript]:
        async with agent.sem, agent.cb.session(user="bench", train=False) as s:
            t = await tools.attempt(s, agent.model, agent.sc, task)
        return tools.grade(t, agent.sc.recipe.partial_credit), t

    rated = await asyncio.gather(*(one() for _ in range(agent.sc.recipe.eval_samples)))
    return [g for g, _ in rated], [t for _, t in rated]


def _progress(seed: int) -> Progress:
    """Each phase with the seconds since the start and the load average, on stderr: where the
    wall time goes (the evaluations, each round's episodes, its training steps and gate)."""
    t0 = time.monotonic()

    def report(phase: str, done: int, total: int) -> None:
        load = os.getloadavg()[0]
        print(
            f"  seed {seed} [{time.monotonic() - t0:6.0f} s, load {load:.1f}] {phase}",
            file=sys.stderr,
            flush=True,
        )

    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--set", action="append", default=[], help="A recipe field, e.g. rounds=3 (JSON value)."
    )
    ap.add_argument("--base-rate", action="store_true", help="Evaluate policy@v0 only.")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    sc = _recipe(tools.ToolsScenario(), args.set)
    rows = []
    for seed in args.seeds:
        if args.base_rate:
            row = {"seed": seed, **asyncio.run(base_rate(sc, args.model, seed))}
            print(json.dumps(row), flush=True)
        else:
            data = Path(tempfile.mkdtemp(prefix=f"cb-tools-{seed}-"))
            result = asyncio.run(
                tools.run_tools_demo(
                    sc,
                    tools.tools_settings(sc, data, model=args.model, seed=seed),
                    progress=_progress(seed),
                )
            )
            row = {"seed": seed, **result.summary()}
            lo, hi = row["solved_interval"]
            print(
                f"seed {seed}: solved {row['solved_before']:.2f} -> {row['solved_after']:.2f}  "
                f"[{100 * lo:+.0f}, {100 * hi:+.0f}] pts  clean {row['clean_before']:.2f} -> "
                f"{row['clean_after']:.2f}  lookup {row['looked_up_before']:.2f} -> {row['looked_up_after']:.2f}  "
                f"probe {row['probe_before']} -> {row['probe_after']}  steps {row['steps']}  "
                f"{row['seconds']:.0f} s",
                flush=True,
            )
            for ex in row["examples"][:4]:
                print(
                    f"  {ex['prompt']} ({ex['code']})\n    before: {ex['before']}\n    after:  {ex['after']}"
                )
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
