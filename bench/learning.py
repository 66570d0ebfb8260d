"""Compare the methods on a scenario: the held-out satisfaction rate per training step for
binary, opd and combine, over seeds, each a full `clawbridge demo` run through the HTTP API.

    .venv/bin/python bench/learning.py --scenario concise --seeds 0 1 --methods binary opd combine
    .venv/bin/python bench/learning.py --model tiny-random --scenario FILE --seeds 0   # plumbing

Prints one row per (method, seed) with the curve, and the mean curve per method; `--json FILE`
writes everything. On 2 shared CPU cores one run of `concise` takes minutes: budget accordingly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from clawbridge.demo import scenario as scenarios
from clawbridge.demo.runner import demo_settings, run_demo


async def one(sc: scenarios.Scenario, method: str, seed: int, model: str | None) -> dict[str, Any]:
    recipe = sc.recipe.updated(method=method)
    run = sc.model_copy(update={"recipe": recipe})
    data = Path(tempfile.mkdtemp(prefix=f"cb-bench-{method}-{seed}-"))
    result = await run_demo(run, demo_settings(run, data, model=model, seed=seed))
    return {"method": method, "seed": seed, **result.summary()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=scenarios.DEFAULT_SCENARIO)
    ap.add_argument("--methods", nargs="+", default=["binary", "opd", "combine"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    sc = scenarios.load(args.scenario)
    rows = []
    for method in args.methods:
        for seed in args.seeds:
            row = asyncio.run(one(sc, method, seed, args.model))
            rows.append(row)
            curve = " ".join(f"{v['rate']:.2f}" for v in row["versions"])
            print(f"{method:8s} seed {seed}: {curve}   ({row['seconds']:.0f} s)", flush=True)
    print("\nmean held-out rate per step")
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method]
        steps = min(len(r["versions"]) for r in mine)
        mean = [sum(r["versions"][i]["rate"] for r in mine) / len(mine) for i in range(steps)]
        print(f"{method:8s} " + " ".join(f"{m:.2f}" for m in mean))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
