"""Several `clawbridge up` processes on one PostgreSQL store, driven as a load balancer without
affinity drives them (docs/scale-out.md): each turn of a conversation goes to another proxy,
tagged and untagged conversations alike, and one proxy is killed (SIGKILL, by its pid) in the
middle of a stream whose request the client then sends to another proxy. Checked against the
store: every acknowledged turn is stored, every next state attached, each untagged conversation
is one session, one process trains, and every live proxy serves the newest version after a
publish. The short run is part of `make test`; the soak (`-m slow`) runs more conversations and
kills the trainer too, whose lease a waiting process takes over.

Every server runs under `timeout`: it stops itself if the test dies."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from clawbridge.learning.lease import SERVING_KEY, TRAINER_LEASE
from clawbridge.store import Store
from helpers.processes import free_port, wait_ready
from pg import PgCluster

MODEL = "tiny-random"
LIFE_S = 300  # a server outliving this stops itself (SIGTERM), whatever happens to the test


@dataclass
class Proxy:
    name: str
    url: str
    proc: subprocess.Popen  # `timeout`, whose child is the server
    log: IO[str]
    alive: bool = True

    @property
    def pid(self) -> int:
        """The server's own pid (the child of `timeout`)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(children[0])

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/status", timeout=10).json()


def start(name: str, tmp: Path, db: str, *flags: str) -> Proxy:
    port = free_port()
    cli = Path(sys.executable).with_name("clawbridge")
    log = (tmp / f"{name}.log").open("w")
    proc = subprocess.Popen(
        ["timeout", "-s", "TERM", "-k", "10", str(LIFE_S), str(cli), "up", "--backend", "local", "--model", MODEL,
         "--port", str(port), "--data-dir", str(tmp / name), "--db", db, *flags],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "CLAWBRIDGE_GATE": "off"},
    )
    return Proxy(name, f"http://127.0.0.1:{port}", proc, log)


@contextlib.contextmanager
def proxies(tmp: Path, db: str, specs: list[tuple[str, tuple[str, ...]]]) -> Iterator[list[Proxy]]:
    ps: list[Proxy] = []
    try:
        for name, flags in specs:
            ps.append(start(name, tmp, db, *flags))
        for p in ps:
            wait_ready(p.url, p.proc, timeout=240)
        yield ps
    finally:
        for p in ps:
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGTERM)
        for p in ps:
            try:
                p.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()
            p.log.close()


@dataclass
class Conversation:
    """One user's conversation: its messages so far, and the turns the proxies acknowledged."""

    key: str
    tagged: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    acknowledged: int = 0

    def body(self, stream: bool = False, max_tokens: int = 6) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": max_tokens, "messages": self.messages, "stream": stream,
                "temperature": 1.0}

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Session-Id": self.key} if self.tagged else {}

    def ask(self, proxy: Proxy) -> None:
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json=self.body(), headers=self.headers, timeout=120)
        assert r.status_code == 200, r.text
        self.answered(r.json()["choices"][0]["message"])

    def answered(self, message: dict[str, Any]) -> None:
        self.messages.append({"role": "assistant", "content": message.get("content") or ""})
        self.acknowledged += 1

    def say(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})


def conversations(n: int, name: str = "conv") -> list[Conversation]:
    out = []
    for i in range(n):
        c = Conversation(f"{name}-{i}", tagged=i % 2 == 0)
        c.say(f"{name} {i}: tell me one fact about the number {i * 7 + 3}.")
        out.append(c)
    return out


def play(convs: list[Conversation], live: list[Proxy], turns: int, offset: int = 0) -> None:
    """Each conversation's turn k goes to proxy (i + k + offset) mod n: no two turns of one
    conversation in a row on the same proxy."""
    for k in range(turns):
        for i, c in enumerate(convs):
            if c.messages[-1]["role"] == "assistant":
                c.say("Thanks, that is right!")
            c.ask(live[(i + k + offset) % len(live)])


def kill_mid_stream(c: Conversation, victim: Proxy, survivor: Proxy) -> None:
    """Start a long streamed answer on `victim`, kill it (SIGKILL) after its first tokens, and
    send the same request to `survivor`, as a client whose connection broke retries."""
    c.say("Thanks, that is right!")
    with httpx.stream("POST", f"{victim.url}/v1/chat/completions", json=c.body(stream=True, max_tokens=400),
                      headers=c.headers, timeout=120) as r:
        assert r.status_code == 200
        chunks = r.iter_lines()
        while not next(chunks).startswith("data: {"):
            pass
        os.kill(victim.pid, signal.SIGKILL)
        with contextlib.suppress(httpx.HTTPError):
            for _ in chunks:
                pass
    victim.alive = False
    victim.proc.wait(30)
    c.ask(survivor)


def check_store(db: str, convs: list[Conversation], within_s: float = 10) -> Store:
    """The store's account of `convs` (retried for `within_s`: a next state is written just after
    the response that carried it)."""
    deadline = time.monotonic() + within_s
    while True:
        store = Store.open(db)
        try:
            account(store, convs)
            return store
        except AssertionError:
            store.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def account(store: Store, convs: list[Conversation]) -> None:
    by_first: dict[str, set[str]] = {}
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT id, session_id FROM turns").all()
    sessions_of = {sid for _, sid in rows}
    for sid in sessions_of:
        turns = store.session_turns(sid)
        by_first.setdefault(str(turns[0].messages[0]["content"]), set()).add(sid)
    for c in convs:
        first = str(c.messages[0]["content"])
        sids = by_first.get(first, set())
        assert len(sids) == 1, f"{c.key}: {len(sids)} sessions"
        [sid] = sids
        if c.tagged:
            assert sid == c.key
        turns = store.session_turns(sid)
        assert len(turns) == c.acknowledged, f"{c.key}: {len(turns)} turns stored, {c.acknowledged} acknowledged"
        missing = [t.index for t in turns[:-1] if t.next_state is None]
        assert not missing, f"{c.key}: turns {missing} have no next state"
        assert turns[-1].next_state is None


def wait_for(what: str, ok: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = ok()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def run_scale_out(tmp: Path, db: str, n_convs: int, turns: int, kill_trainer: bool) -> None:
    train = ("--method", "binary", "--judge", "rules", "--batch-size", "4")
    specs = [("a", train), ("b", train), ("c", ("--no-train",))]
    with proxies(tmp, db, specs) as ps:
        a, b, c = ps
        trainers = [p for p in (a, b) if p.status()["extra"]["trainer"] == "this process"]
        assert len(trainers) == 1, [p.status()["extra"]["trainer"] for p in ps]
        convs = conversations(n_convs)
        play(convs, ps, turns)
        kill_mid_stream(convs[1], c, a)  # untagged
        live = [a, b]
        play(convs, live, 1, offset=1)
        store = check_store(db, convs)
        timings: dict[str, Any] = {}
        try:
            trainer = trainers[0]
            lease = store.lease(TRAINER_LEASE)
            assert lease is not None and str(trainer.pid) in lease.holder
            newest = wait_for("a published version", lambda: (v := store.latest_version()) and v.version >= 1 and v,
                              120)
            wait_for("the trainer to serve it", lambda: (store.get_meta(SERVING_KEY) or {}).get("version")
                     == store.latest_version().version, 60)
            newest = store.latest_version()
            assert newest is not None
            t0 = time.monotonic()
            wait_for(f"every proxy on v{newest.version}",
                     lambda: all(p.status()["version"] >= newest.version for p in live), 20)
            timings["every proxy on the served version (s)"] = round(time.monotonic() - t0, 2)
            steps = store.training_steps()
            assert [s.step for s in steps] == list(range(1, len(steps) + 1))  # one trainer numbers them
            if kill_trainer:
                other = b if trainer is a else a
                os.kill(trainer.pid, signal.SIGKILL)
                trainer.alive = False
                t0 = time.monotonic()
                wait_for("the waiting process to take over",
                         lambda: other.status()["extra"]["trainer"] == "this process", 40)
                timings["takeover after SIGKILL (s)"] = round(time.monotonic() - t0, 2)
                more = conversations(n_convs, "after")
                play(more, [other], turns)
                check_store(db, convs + more).close()
                before = newest.version
                wait_for("a version trained by the new holder",
                         lambda: store.latest_version().version > before, 120)
        finally:
            timings["versions"] = [v.version for v in store.versions()]
            store.close()
        logs = {p.name: (tmp / f"{p.name}.log").read_text() for p in ps}
        assert sum("holds the trainer lease" in text for text in logs.values()) == (2 if kill_trainer else 1), logs
        print(json.dumps(timings))  # shown with -s: the figures of docs/measurements.md


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> str:
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    return cluster.create_database()


def test_three_proxies_without_affinity_lose_nothing_and_share_one_trainer(tmp_path: Path, pg_url: str):
    run_scale_out(tmp_path, pg_url, n_convs=6, turns=3, kill_trainer=False)


@pytest.mark.slow
def test_soak_the_trainer_dies_and_a_waiting_process_takes_over(tmp_path: Path, pg_url: str):
    run_scale_out(tmp_path, pg_url, n_convs=20, turns=4, kill_trainer=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (apt install nginx-light)")
def test_the_load_balancer_example_loses_no_next_state_with_a_proxy_killed(tmp_path: Path, pg_url: str):
    """examples/scale_out as the docs run it: run.sh (two proxies and nginx), conversations.py
    through nginx, once as is and once with a proxy killed by its pid mid-run."""
    root = Path(__file__).resolve().parents[1]
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DATABASE_URL": pg_url, "RUN_DIR": str(tmp_path / "run"), "PORT": str(port),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log:
        up = subprocess.Popen(
            ["timeout", "-s", "TERM", str(LIFE_S), str(root / "examples/scale_out/run.sh"), "2",
             "--backend", "local", "--model", MODEL, "--no-train"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,
        )
        try:
            wait_for("nginx", lambda: "nginx: http" in log_path.read_text() or up.poll() is not None, 240)
            assert up.poll() is None, log_path.read_text()
            drive = [sys.executable, str(root / "examples/scale_out/conversations.py"), "--db", pg_url,
                     "--url", f"http://127.0.0.1:{port}", "--conversations", "20"]
            calm = json.loads(subprocess.run(drive, capture_output=True, text=True, env=env, check=True).stdout)
            second = next(line for line in log_path.read_text().splitlines() if line.startswith("proxy 2:"))
            victim = int(second.split("pid ")[1].split(",")[0])
            run = subprocess.Popen(drive, stdout=subprocess.PIPE, text=True, env=env)
            time.sleep(4)
            os.kill(victim, signal.SIGKILL)
            killed = json.loads(run.communicate(timeout=240)[0])
        finally:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(60)
    for got in (calm, killed):
        assert got["answered"] == got["turns_stored"] == 60, got
        assert got["next_states_attached"] == got["next_states_expected"] == 40, got
        assert got["sessions"] == 20 and got["conversations_split"] == 0, got
