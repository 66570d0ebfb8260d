"""Serving latency with the page open and without (issue 27): a real `clawbridge up` (the tiny
model, one token per answer, so the proxy and the store dominate) over a 100 000-turn store,
asked the same chat request back to back; in alternate rounds a thread does what an open page
does — polls `/ui/api/now` and, whenever the change token moved (every poll here: each answer
is a new turn), fetches `/ui/api/progress` and `/ui/api/turns`.

    .venv/bin/python bench/ui_queries.py --db /tmp/ui.db        # builds the store once
    .venv/bin/python bench/ui_serving.py --db /tmp/ui.db [--requests 200] [--rounds 4] [--poll 2]

Prints the median and 95th percentile of the chat request's latency, page closed vs open.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from clawbridge.backends.local import LocalBackend
from clawbridge.config import Settings
from clawbridge.server import Running, serve, serving_extras


class Page(threading.Thread):
    """What the page's script does while open, as HTTP requests."""

    def __init__(self, url: str, poll_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.poll_s = url, poll_s
        self.stop = threading.Event()
        self.refreshes = 0
        self.seconds: dict[str, list[float]] = {"now": [], "progress": [], "turns": []}

    def get(self, c: httpx.Client, name: str) -> Any:
        t0 = time.perf_counter()
        r = c.get(f"/ui/api/{name}")
        r.raise_for_status()
        self.seconds[name].append(1000 * (time.perf_counter() - t0))
        return r.json()

    def run(self) -> None:
        token = None
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self.stop.wait(self.poll_s):
                now = self.get(c, "now")
                if now["token"] != token:
                    token = now["token"]
                    self.get(c, "progress")
                    self.get(c, "turns")
                    self.refreshes += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", type=Path, required=True, help="a store built by bench/ui_queries.py (copied, not changed)")
    ap.add_argument("--requests", type=int, default=200, help="chat requests per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, alternating page closed / open")
    ap.add_argument("--poll", type=float, default=2.0, help="the page's poll interval in seconds")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ui-serving-"))
    shutil.copy(args.db, work / "clawbridge.db")
    with sqlite3.connect(work / "clawbridge.db") as db:
        # the built store's versions name weights that do not exist; the server would try to
        # serve the newest at start. The turns, verdicts and gate records the page reads stay.
        db.execute("DELETE FROM policy_versions")
    settings = Settings(model="tiny-random", data_dir=work, port=0, gate="off", default_max_tokens=1,
                        batch_size=10_000)  # training on (so the page is the one `up` serves), never stepping
    ready = threading.Event()
    box: dict[str, Running] = {}

    def started(r: Running) -> None:
        box["r"] = r
        ready.set()

    def run_server() -> None:
        asyncio.run(serve(settings, backend=LocalBackend.from_settings(settings), quiet=True, started=started,
                          **serving_extras(settings)))

    threading.Thread(target=run_server, daemon=True).start()
    if not ready.wait(240):
        sys.exit("the server did not start")
    url = box["r"].base_url
    body = {"model": "tiny-random", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    results: dict[bool, list[float]] = {False: [], True: []}
    refreshes = 0
    page_ms: dict[str, list[float]] = {"now": [], "progress": [], "turns": []}
    with httpx.Client(base_url=url, timeout=60, headers={"X-Train": "false"}) as c:
        for _ in range(10):  # warm up
            c.post("/v1/chat/completions", json=body).raise_for_status()
        for rnd in range(args.rounds):
            open_ = rnd % 2 == 1
            page = Page(url, args.poll) if open_ else None
            if page is not None:
                page.start()
            for _ in range(args.requests):
                t0 = time.perf_counter()
                c.post("/v1/chat/completions", json=body).raise_for_status()
                results[open_].append(1000 * (time.perf_counter() - t0))
            if page is not None:
                page.stop.set()
                page.join()
                refreshes += page.refreshes
                for k, v in page.seconds.items():
                    page_ms[k] += v
    box["r"].server.should_exit = True
    time.sleep(1)
    print(f"store: {args.db} (copied); {args.requests} requests x {args.rounds} rounds; page polls every {args.poll} s, "
          f"{refreshes} full refreshes")
    print(f"{'page':8s} {'median ms':>10s} {'p95 ms':>8s} {'n':>5s}")
    for open_, xs in results.items():
        xs = sorted(xs)
        print(f"{'open' if open_ else 'closed':8s} {statistics.median(xs):10.2f} {xs[int(0.95 * len(xs))]:8.2f} {len(xs):5d}")
    for name, xs in page_ms.items():
        if xs:
            print(f"the page's GET /ui/api/{name}: median {statistics.median(xs):.1f} ms over {len(xs)}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
