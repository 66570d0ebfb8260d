"""Store write throughput with OpenClaw-sized growing sessions: S sessions at once, each turn a
36 K-character system prompt, 12 tools, the history so far, a rebuilt internal-context message,
~9 K prompt ids and a 17-token completion, written through the group-commit writer as the proxy
does (`record_turn_async`, each caller waiting for its commit).

    .venv/bin/python bench/store.py [--sessions 16] [--turns 30] [--db sqlite|postgresql|both]

`whole` stores each turn's whole message list (as before migration 0002; emulated with a message
chain length of 0), `delta` only the messages a turn adds. Prints turns/s, the p50 wait for the
commit and bytes per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "proxy"))
sys.path.insert(0, str(HERE.parent / "tests"))

from clawbridge.store import Store, TurnRecord, core  # noqa: E402
from load import big_system, tools  # noqa: E402

ANSWER = "Sure! Here is a short, canned answer of about sixteen tokens for you."


def session_turns(s: int, turns: int) -> list[TurnRecord]:
    system = {"role": "system", "content": big_system()}
    history: list[dict] = [system]
    out = []
    for t in range(turns):
        history.append({"role": "user", "content": f"[Sun 2026-11-22 08:{t:02d} UTC] session {s} step {t}"})
        internal = {"role": "user", "content": [{"type": "text", "text": f"<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> {t}"}]}
        out.append(TurnRecord(
            session_id=f"bench-{s}", messages=[*history, internal], tools=tools(),
            prompt_ids=tuple(range(8700 + 40 * t)), completion_ids=tuple(range(17)),
            logprobs=(-0.5,) * 17, version=0, finish_reason="stop",
            response={"role": "assistant", "content": ANSWER},
        ))
        history.append({"role": "assistant", "content": ANSWER})
    return out


async def drive(store: Store, sessions: list[list[TurnRecord]]) -> tuple[float, list[float]]:
    waits: list[float] = []

    async def one_session(recs: list[TurnRecord]) -> None:
        for rec in recs:  # a session's turns come one after another, as an agent's do
            t0 = time.perf_counter()
            await store.record_turn_async(rec)
            waits.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one_session(r) for r in sessions))
    return time.perf_counter() - t0, waits


def run(url: str, mode: str, n_sessions: int, turns: int) -> dict:
    core.MAX_MESSAGE_CHAIN = 0 if mode == "whole" else 32
    store = Store.open(url)
    sessions = [session_turns(s, turns) for s in range(n_sessions)]
    wall, waits = asyncio.run(drive(store, sessions))
    with store.engine.connect() as conn:
        size = conn.exec_driver_sql(
            "SELECT sum(length(messages)) FROM turns" if store.dialect == "sqlite"
            else "SELECT sum(octet_length(messages::text)) FROM turns"
        ).scalar()
    n = n_sessions * turns
    batches = store.writer.batches
    store.close()
    return {"mode": mode, "turns_per_s": n / wall, "p50_wait_ms": 1e3 * statistics.median(waits),
            "messages_bytes_per_turn": int(size) / n, "turns_per_commit": n / max(1, batches)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--db", choices=["sqlite", "postgresql", "both"], default="both")
    a = ap.parse_args()
    dbs = ["sqlite", "postgresql"] if a.db == "both" else [a.db]
    cluster = None
    dirs: list[str] = []  # the SQLite runs' stores (tens of MB each), removed at the end
    try:
        for db in dbs:
            for mode in ("whole", "delta"):
                if db == "sqlite":
                    tmp = tempfile.mkdtemp(prefix="cb-store-bench-")
                    dirs.append(tmp)
                    url = f"sqlite:///{tmp}/clawbridge.db"
                else:
                    from pg import PgCluster, find_pg_bin

                    if cluster is None:
                        bin_dir = find_pg_bin()
                        if bin_dir is None:
                            print("postgresql: no binaries, skipped")
                            break
                        cluster = PgCluster(bin_dir, fsync=True).start()
                    url = cluster.create_schema()
                r = run(url, mode, a.sessions, a.turns)
                print(f"{db:<10} {r['mode']:<5} {r['turns_per_s']:7.0f} turns/s  commit wait p50 "
                      f"{r['p50_wait_ms']:6.2f} ms  messages {r['messages_bytes_per_turn'] / 1000:6.1f} KB/turn  "
                      f"{r['turns_per_commit']:.1f} turns/commit", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
