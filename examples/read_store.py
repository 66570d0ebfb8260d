"""Read the store for analysis: every captured turn with its exact token ids, logprobs, next state,
judgments and samples, as `clawbridge export` writes them (JSON lines), summarised per session.

    clawbridge export -o turns.jsonl            # or read the live store directly, as below
    python examples/read_store.py [--data-dir .clawbridge | --db URL | --jsonl turns.jsonl]

Reading while `clawbridge up` runs is safe: SQLite is in WAL mode and the export pages through
turns in (created_at, id) order.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def turns_from_store(db_url: str) -> Iterator[dict[str, Any]]:
    from clawbridge.store import Store
    from clawbridge.store.export import iter_export

    with Store.open(db_url) as store:
        yield from iter_export(store)


def turns_from_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def summarise(turns: Iterable[dict[str, Any]]) -> dict[str, Any]:
    sessions: dict[str, dict[str, Any]] = defaultdict(lambda: {"turns": 0, "main": 0, "with_next_state": 0,
                                                              "rewards": [], "tokens": 0})
    total = {"turns": 0, "main": 0, "side": 0, "with_next_state": 0, "judged": 0, "completion_tokens": 0,
             "mean_logprob": 0.0}
    lp_sum, lp_n = 0.0, 0
    for t in turns:
        s = sessions[t["session_id"]]
        s["turns"] += 1
        s["main"] += t["turn_type"] == "main"
        s["tokens"] += len(t["completion_ids"])
        total["turns"] += 1
        total[t["turn_type"]] += 1
        total["completion_tokens"] += len(t["completion_ids"])
        if t["next_state"] is not None:
            s["with_next_state"] += 1
            total["with_next_state"] += 1
        rewards = [j["reward"] for j in t["judgments"] if j["reward"] is not None]
        if rewards:
            total["judged"] += 1
            s["rewards"].append(rewards[-1])
        lp_sum += sum(t["logprobs"])
        lp_n += len(t["logprobs"])
    total["mean_logprob"] = lp_sum / lp_n if lp_n else math.nan
    return {"total": total, "sessions": dict(sessions)}


def main() -> None:
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--data-dir", default=".clawbridge", help="clawbridge's data directory (SQLite store).")
    src.add_argument("--db", help="SQLAlchemy URL of the store (e.g. postgresql+psycopg://...).")
    src.add_argument("--jsonl", type=Path, help="A file written by `clawbridge export`.")
    ap.add_argument("--json", action="store_true", help="Print the summary as JSON.")
    a = ap.parse_args()

    if a.jsonl:
        turns = turns_from_jsonl(a.jsonl)
    else:
        db = a.db or f"sqlite:///{(Path(a.data_dir) / 'clawbridge.db').resolve()}"
        if not a.db and not (Path(a.data_dir) / "clawbridge.db").exists():
            sys.exit(f"no store at {a.data_dir}/clawbridge.db (pass --data-dir or --db)")
        turns = turns_from_store(db)
    summary = summarise(turns)
    if a.json:
        print(json.dumps(summary))
        return
    t = summary["total"]
    print(f"{t['turns']} turns ({t['main']} main, {t['side']} side), {t['with_next_state']} with a next state, "
          f"{t['judged']} judged, {t['completion_tokens']} completion tokens, mean logprob {t['mean_logprob']:.3f}")
    for sid, s in summary["sessions"].items():
        mean_r = f"{sum(s['rewards']) / len(s['rewards']):+.2f}" if s["rewards"] else "-"
        print(f"  {sid}: {s['turns']} turns, {s['main']} main, {s['with_next_state']} with next state, "
              f"mean reward {mean_r}")


if __name__ == "__main__":
    main()
