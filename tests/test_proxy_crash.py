"""`clawbridge up` as a subprocess. Durability: killed with SIGKILL under concurrent load, every
turn whose response reached its client is in the store when it is reopened. Drain: Ctrl-C
(SIGINT) lets a stream in flight finish, then the process exits cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from clawbridge.store import Store
from helpers.processes import free_port, wait_ready

pytestmark = pytest.mark.slow


def start_up(port: int, data: Path) -> subprocess.Popen:
    cli = Path(sys.executable).with_name("clawbridge")
    return subprocess.Popen(
        [str(cli), "up", "--backend", "local", "--model", "tiny-random", "--port", str(port),
         "--data-dir", str(data), "--no-train"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        # the drain test's stream takes longer than the default grace (3 s) on a loaded machine
        env={**os.environ, "HF_HUB_OFFLINE": "1", "CLAWBRIDGE_SHUTDOWN_GRACE_S": "60"},
    )


def test_ctrl_c_drains_the_stream_in_flight_then_exits_cleanly(tmp_path: Path):
    port, data = free_port(), tmp_path / "data"
    proc = start_up(port, data)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=240)
        events: list[bytes] = []
        body = {"model": "tiny-random", "max_tokens": 120, "stream": True,
                "messages": [{"role": "user", "content": "a long answer please"}]}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                          headers={"X-Session-Id": "drain-1"}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.encode())
                    if len(events) == 2:  # the stream is under way: Ctrl-C now
                        os.kill(proc.pid, signal.SIGINT)
        assert events[-1] == b"data: [DONE]"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with Store.open(f"sqlite:///{data.resolve() / 'clawbridge.db'}") as store:
        [turn] = store.session_turns("drain-1")
    assert len(turn.completion_ids) > 0 and turn.finish_reason in ("stop", "length")


def test_kill_minus_9_mid_load_loses_no_answered_turn(tmp_path: Path):
    port, data = free_port(), tmp_path / "data"
    proc = start_up(port, data)
    url = f"http://127.0.0.1:{port}"
    completed: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(timeout=30) as h:
            i = 0
            while not stop.is_set():
                sid = f"crash-{k}-{i}"
                i += 1
                try:
                    r = h.post(f"{url}/v1/chat/completions", headers={"X-Session-Id": sid},
                               json={"model": "tiny-random", "max_tokens": 6,
                                     "messages": [{"role": "user", "content": f"request {sid}"}]})
                except httpx.HTTPError:
                    return  # the server died under us: this answer never arrived
                if r.status_code == 200 and r.json()["choices"]:
                    with lock:
                        completed.append(sid)

    try:
        wait_ready(url, proc, timeout=240)
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(completed) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-load: requests are in flight right now
        proc.wait(10)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert len(completed) >= 30
    with Store.open(f"sqlite:///{data.resolve() / 'clawbridge.db'}") as store:
        missing = [sid for sid in completed if len(store.session_turns(sid)) != 1]
    assert missing == []
