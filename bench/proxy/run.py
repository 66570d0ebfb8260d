"""The proxy benchmark: the same canned answer served directly, through a minimal aiohttp relay,
through LiteLLM's proxy and through clawbridge (capture on), in one run, at 1/10/100 clients,
streaming and not, short prompts and one OpenClaw-sized conversation growing turn by turn.

    .venv/bin/python bench/proxy/run.py [--quick] [--no-litellm] [--baseline DIR]

Added latency of a path = its percentile minus the direct path's percentile in the same cell.
`--baseline DIR`: a checkout of another commit (`git worktree add /tmp/old REV`) served as the
path `baseline` in the same run, so a change to the proxy is measured against what it replaced.
LiteLLM runs from its own git-ignored venv (bench/proxy/.venv-litellm; see README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
from load import Cell, run_cell, run_conversation

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
LITELLM = HERE / ".venv-litellm" / "bin" / "litellm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            req = urllib.request.Request(url, headers={"Authorization": "Bearer sk-bench"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=HERE, env={**os.environ, **(env or {})},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def link_tree(checkout: Path, into: Path) -> Path:
    """A `clawbridge` package made of a checkout's folders, mapped as pyproject's `package-dir`
    maps them; put first on PYTHONPATH, it shadows the installed one."""
    pkg = into / "clawbridge"
    pkg.mkdir(parents=True)
    for entry in (checkout / "bridge").iterdir():
        (pkg / entry.name).symlink_to(entry.resolve())
    for sub in ("backends", "judges", "local_gpu"):
        (pkg / sub).symlink_to((checkout / sub).resolve())
    return into


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, q)) if xs else float("nan")


def summarise(name: str, cell: Cell, base: Cell) -> dict:
    out = {"path": name, "n": len(cell.latencies), "errors": cell.errors,
           "rps": len(cell.latencies) / cell.wall if cell.wall else 0.0}
    for q in (50, 95, 99):
        out[f"p{q}"] = pct(cell.latencies, q)
        out[f"added_p{q}"] = pct(cell.latencies, q) - pct(base.latencies, q)
    out["ttft_p50"] = pct(cell.ttfts, 50)
    out["added_ttft_p50"] = pct(cell.ttfts, 50) - pct(base.ttfts, 50)
    return out


def median_summary(rounds: list[dict]) -> dict:
    out = dict(rounds[0])
    for k, v in out.items():
        if isinstance(v, float):
            out[k] = float(np.median([r[k] for r in rounds]))
    out["n"] = sum(r["n"] for r in rounds)
    out["errors"] = sum(r["errors"] for r in rounds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests per cell")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per cell; figures are medians over them")
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, served as the path `baseline`")
    a = ap.parse_args()
    scale = 0.25 if a.quick else 1.0
    use_litellm = not a.no_litellm and LITELLM.exists()
    data = Path(tempfile.mkdtemp(prefix="cb-bench-"))
    ports = {k: free_port() for k in ("direct", "relay", "litellm", "baseline", "clawbridge")}
    procs = {"direct": start([PY, "upstream.py", "--port", str(ports["direct"])], data / "direct.log")}
    up = f"http://127.0.0.1:{ports['direct']}"
    procs["relay"] = start([PY, "relay.py", "--port", str(ports["relay"]), "--upstream", up], data / "relay.log")
    procs["clawbridge"] = start([PY, "serve_clawbridge.py", "--port", str(ports["clawbridge"]),
                                 "--data-dir", str(data)], data / "clawbridge.log", env={"PYTHONPATH": str(HERE)})
    if a.baseline is not None:
        tree = link_tree(a.baseline, data / "baseline-package")
        (data / "baseline").mkdir()
        procs["baseline"] = start([PY, "serve_clawbridge.py", "--port", str(ports["baseline"]),
                                   "--data-dir", str(data / "baseline")], data / "baseline.log",
                                  env={"PYTHONPATH": f"{tree}{os.pathsep}{HERE}"})
    if use_litellm:
        cfg = data / "litellm.yaml"
        cfg.write_text(
            "model_list:\n  - model_name: canned\n    litellm_params:\n      model: openai/canned\n"
            f"      api_base: {up}/v1\n      api_key: sk-none\n"
            "general_settings:\n  master_key: sk-bench\n"
        )
        procs["litellm"] = start([str(LITELLM), "--config", str(cfg), "--port", str(ports["litellm"]),
                                  "--num_workers", "1", "--telemetry", "False"], data / "litellm.log",
                                 env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"})
    paths = [p for p in ("direct", "relay", "litellm", "baseline", "clawbridge") if p in procs]
    rows: list[dict] = []
    try:
        for p in paths:
            wait_ready(f"http://127.0.0.1:{ports[p]}/v1/models", procs[p])
            print(f"{p} ready", flush=True)
        url = {p: f"http://127.0.0.1:{ports[p]}/v1/chat/completions" for p in paths}

        def measure(name: str, run: Callable[[str], Awaitable[Cell]]) -> None:
            # The paths take turns within each round, so a change in the machine's load lands on
            # all of them; each figure is the median over the rounds.
            rounds = [{p: asyncio.run(run(url[p])) for p in paths} for _ in range(a.rounds)]
            for p in paths:
                r = median_summary([summarise(p, c[p], c["direct"]) for c in rounds])
                rows.append({"cell": name, **r})
                print(fmt(rows[-1]), flush=True)

        for clients, total in ((1, 200), (10, 500), (100, 1000)):
            for stream in (False, True):
                n = max(clients, int(total * scale))
                measure(f"short c={clients} {'stream' if stream else 'json'}",
                        lambda u, c=clients, n=n, s=stream: run_cell(u, "canned", c, n, s))
        for stream in (False, True):
            measure(f"10K-token session c=1 {'stream' if stream else 'json'}",
                    lambda u, s=stream: run_conversation(u, "canned", a.turns, s))
    finally:
        for p in procs.values():
            stop(p)
        if sys.exc_info()[0] is None:
            shutil.rmtree(data, ignore_errors=True)  # the servers' logs and clawbridge's store
        else:
            print(f"the servers' logs are in {data}", file=sys.stderr)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "proxy.json").write_text(json.dumps(rows, indent=1))
    print("\n" + table(rows))
    print("\n" + goals(rows))
    if a.baseline is not None:
        print("\n" + against_baseline(rows))
    (out / "proxy.md").write_text(table(rows) + "\n")


def fmt(r: dict) -> str:
    return (f"{r['cell']:<28} {r['path']:<11} n={r['n']:<5} err={r['errors']:<3} rps={r['rps']:7.1f} "
            f"p50={r['p50']:7.2f} added p50/p95/p99={r['added_p50']:6.2f}/{r['added_p95']:6.2f}/"
            f"{r['added_p99']:6.2f} ms ttft={r['ttft_p50']:6.2f}")


def table(rows: list[dict]) -> str:
    relay = {r["cell"]: r["added_p50"] for r in rows if r["path"] == "relay"}
    head = ("| cell | path | req/s | p50 ms | added p50 | × relay | added p95 | added p99 | TTFT p50 | added TTFT p50 | errors |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        ttft = "" if np.isnan(r["ttft_p50"]) else f"{r['ttft_p50']:.2f}"
        attft = "" if np.isnan(r["added_ttft_p50"]) else f"{r['added_ttft_p50']:+.2f}"
        base = relay.get(r["cell"])
        ratio = f"{r['added_p50'] / base:.1f}" if base and r["path"] not in ("direct", "relay") else ""
        lines.append(
            f"| {r['cell']} | {r['path']} | {r['rps']:.0f} | {r['p50']:.2f} | {r['added_p50']:+.2f} | {ratio} | "
            f"{r['added_p95']:+.2f} | {r['added_p99']:+.2f} | {ttft} | {attft} | {r['errors']} |"
        )
    return "\n".join(lines)


def goals(rows: list[dict]) -> str:
    """The issue's targets: added p50 within 3x the relay's at 1 and 10 clients; at most 5 ms on
    the 10 K-token conversation."""
    relay = {r["cell"]: r["added_p50"] for r in rows if r["path"] == "relay"}
    out = []
    for r in rows:
        if r["path"] != "clawbridge":
            continue
        if r["cell"].startswith("10K"):
            ok = r["added_p50"] <= 5.0
            out.append(f"{r['cell']}: added p50 {r['added_p50']:+.2f} ms (goal <= 5 ms) {'met' if ok else 'NOT met'}")
        elif "c=100" not in r["cell"] and relay.get(r["cell"], 0) > 0:
            x = r["added_p50"] / relay[r["cell"]]
            out.append(f"{r['cell']}: added p50 {x:.1f}x the relay's (goal <= 3x) {'met' if x <= 3 else 'NOT met'}")
    return "\n".join(out)


def against_baseline(rows: list[dict]) -> str:
    """clawbridge over the baseline commit, cell by cell: added p50 and req/s as ratios (added
    p50 below 1 and req/s above 1: the change is faster)."""
    base = {r["cell"]: r for r in rows if r["path"] == "baseline"}
    lines = ["| cell | added p50 ms (baseline -> now) | added p50 ratio | req/s (baseline -> now) | req/s ratio |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get(r["cell"])
        if r["path"] != "clawbridge" or b is None:
            continue
        lat = r["added_p50"] / b["added_p50"] if b["added_p50"] > 0 else float("nan")
        rps = r["rps"] / b["rps"] if b["rps"] else float("nan")
        lines.append(f"| {r['cell']} | {b['added_p50']:.2f} -> {r['added_p50']:.2f} | {lat:.2f} | "
                     f"{b['rps']:.0f} -> {r['rps']:.0f} | {rps:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
