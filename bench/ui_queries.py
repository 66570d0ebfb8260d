"""The page's own queries on a store of 100 000 turns (issue 27): each page the browser asks for,
timed over repeated calls, on SQLite (WAL) as `clawbridge up` keeps it.

    .venv/bin/python bench/ui_queries.py [--turns 100000] [--db PATH] [--repeat 20]

The store is built once (about a minute; kept at --db for reruns): sessions of 10 turns with a
few hundred characters each, 90 % with the user's next message and judged (most trained,
some dropped, a few waiting), 60 published versions with gate decisions. Prints the median and
the 95th percentile of each query in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import sqlalchemy as sa  # noqa: E402
from clawbridge.learning.gate import GATE_KEY  # noqa: E402
from clawbridge.learning.promotion import ROLLBACKS_KEY  # noqa: E402
from clawbridge.store import Store  # noqa: E402
from clawbridge.store import schema as t  # noqa: E402
from clawbridge.store.browse import Browse  # noqa: E402
from ui_helpers import turn  # noqa: E402

VERSIONS = 60
CHUNK = 2_000


def build(store: Store, n: int) -> None:
    start = datetime(2026, 11, 1, tzinfo=UTC)
    per_version = max(1, n // VERSIONS)
    ask = "Could you explain how the retry logic in the uploader decides when to give up? " * 3
    answer = "It retries with exponential backoff and gives up after the fifth attempt. " * 3
    for lo in range(0, n, CHUNK):
        recs = [turn(f"s{i // 10}", f"{i}: {ask}", f"{i}: {answer}", version=min(VERSIONS - 1, i // per_version),
                     at=start + timedelta(seconds=i), history=None) for i in range(lo, min(n, lo + CHUNK))]
        with store._write() as conn:
            ids = store._record_turns(conn, recs)
            now = datetime.now(UTC)
            conn.execute(t.next_states.insert(), [
                {"turn_id": tid, "created_at": now, "messages": [{"role": "user", "content": "thanks, but shorter"}]}
                for k, tid in enumerate(ids) if (lo + k) % 10 != 9])
            judged = [(lo + k, tid) for k, tid in enumerate(ids) if (lo + k) % 10 != 9]  # every next state
            conn.execute(t.judgments.insert(), [
                {"turn_id": tid, "judge": "rules", "kind": "prm", "reward": float(i % 3 - 1), "hint": None,
                 "votes": [{"raw": "\\boxed{1}", "value": 1.0, "error": None}] * 3, "created_at": now}
                for i, tid in judged])
            conn.execute(t.samples.insert(), [
                {"turn_id": tid, "method": "combine", "reward": float(i % 3 - 1),
                 "state": "dropped" if i % 3 == 1 else ("judged" if i > n - 40 else "trained"),
                 "reason": "no signal" if i % 3 == 1 else None, "hint": "answer in one sentence" if i % 3 == 0 else None,
                 "version": min(VERSIONS - 1, i // per_version), "step": i // per_version, "created_at": now,
                 "updated_at": now} for i, tid in judged])
        print(f"\r  {min(n, lo + CHUNK)} turns", end="", flush=True)
    print()
    with store._write() as conn:
        conn.execute(t.policy_versions.insert(), [
            {"version": v, "step": v, "samples": 16, "mean_reward": 0.1, "path": f"/adapters/v{v}",
             "created_at": start + timedelta(hours=v)} for v in range(1, VERSIONS)])
    store.set_meta(GATE_KEY, [{"version": v, "serving": v - 1, "decision": "accepted" if v % 4 else "rejected",
                               "reason": "within the margin", "figures": {"probe_candidate": 0.6, "probe_serving": 0.62}}
                              for v in range(1, VERSIONS)])
    store.set_meta(ROLLBACKS_KEY, {})


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    fn()  # warm the page cache, as a page open for a while has
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.95 * len(times)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=100_000)
    ap.add_argument("--db", type=Path, default=None, help="keep the store here (built when missing)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    path = args.db or Path(tempfile.mkdtemp(prefix="ui-bench-")) / "clawbridge.db"
    fresh = not path.exists()
    store = Store.open(f"sqlite:///{path}")
    if fresh:
        t0 = time.perf_counter()
        build(store, args.turns)
        print(f"built {args.turns} turns in {time.perf_counter() - t0:.0f} s at {path}")
    with store._read() as conn:
        n = conn.execute(sa.select(sa.func.count()).select_from(t.turns)).scalar_one()
    b = Browse(store)
    keys = (GATE_KEY, ROLLBACKS_KEY)
    deep = b.turns(limit=1)
    cursor = None
    for _ in range(5):  # a cursor half-way down: the page after 5 pages of 200
        cursor = b.turns(before=cursor, limit=200)["next"]
    rows: list[tuple[str, Callable[[], Any]]] = [
        ("change token (every poll)", lambda: b.token(keys)),
        ("waiting counts (every poll)", b.waiting),
        ("progress: versions, reactions, gate", lambda: b.progress(*keys)),
        ("turns: newest 30", lambda: b.turns(limit=30)),
        ("turns: 30 after 1 000", lambda: b.turns(before=cursor, limit=30)),
        ("conversation: 50 turns", lambda: b.conversation(deep["turns"][0]["session_id"])),
    ]
    print(f"store: {n} turns, SQLite ({path.stat().st_size / 1e6:.0f} MB); ms over {args.repeat} calls")
    print(f"{'query':40s} {'median':>8s} {'p95':>8s}")
    for name, fn in rows:
        med, p95 = timed(fn, args.repeat)
        print(f"{name:40s} {med:8.2f} {p95:8.2f}")
    with store._read() as conn:  # the plans: every query above walks an index
        for label, sql in [("reactions, past the mark",
                            "SELECT version, count(reward) FROM samples WHERE reward IS NOT NULL AND id > 79000 GROUP BY version"),
                           ("turns page", "SELECT id FROM turns ORDER BY created_at DESC, id DESC LIMIT 31")]:
            plan = " | ".join(r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))
            print(f"plan {label}: {plan}")
    store.close()


if __name__ == "__main__":
    main()
