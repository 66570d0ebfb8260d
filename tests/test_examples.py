"""Every example, run as a user runs it, against a live `clawbridge up --model tiny-random` on
127.0.0.1 (a real subprocess, stopped by PID with SIGTERM); the store is then read to check what
each example promises."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from clawbridge.cli.main import app
from clawbridge.config import Settings
from clawbridge.openclaw import provider as oc
from clawbridge.server import build_backend
from clawbridge.store import Store
from clawbridge.types import Completion, SamplingParams
from live_server import LiveServer
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CLI = Path(sys.executable).with_name("clawbridge")
T = TypeVar("T")


class Up:
    def __init__(self, url: str, data_dir: Path) -> None:
        self.url, self.data_dir = url, data_dir
        self.db = f"sqlite:///{data_dir / 'clawbridge.db'}"

    def run(self, script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([sys.executable, str(EXAMPLES / script), "--url", self.url, *args],
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert r.returncode == 0, f"{script} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return r

    def eventually(self, read: Callable[[Store], T], ok: Callable[[T], bool], timeout: float = 20) -> T:
        """The proxy commits in groups: poll the store until `ok` (or give the last value)."""
        deadline = time.monotonic() + timeout
        with Store.open(self.db) as store:
            while True:
                value = read(store)
                if ok(value) or time.monotonic() > deadline:
                    return value
                time.sleep(0.2)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    data = tmp_path_factory.mktemp("examples")
    env = {**os.environ, "CLAWBRIDGE_DEFAULT_MAX_TOKENS": "16", "CLAWBRIDGE_BATCH_SIZE": "64",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [str(CLI), "up", "--model", "tiny-random", "--port", "0", "--data-dir", str(data)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    lines: list[str] = []
    found = threading.Event()

    def pump() -> None:  # keep reading, or the server blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"endpoint\s+http://127\.0\.0\.1:\d+/v1", line):
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not found.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("clawbridge up did not start:\n" + "".join(lines[-40:]))
        url = re.search(r"endpoint\s+(http://127\.0\.0\.1:\d+)/v1", "".join(lines)).group(1)  # type: ignore[union-attr]
        yield Up(url, data)
    finally:
        proc.send_signal(signal.SIGTERM)  # drains in-flight requests, flushes the store
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


def test_sdk_agent_records_a_tagged_session_with_next_states(up: Up):
    r = up.run("sdk_agent.py", "--user", "example-sdk")
    sid = re.search(r"session (\S+) done", r.stdout).group(1)  # type: ignore[union-attr]
    turns = up.eventually(lambda s: s.session_turns(sid), lambda ts: len(ts) == 3)
    assert [t.turn_type for t in turns] == ["main"] * 3 and all(t.tagged for t in turns)
    assert turns[0].next_state == [{"role": "user", "content": "Thanks! Can you make it shorter?"}]
    assert turns[1].next_state is not None and turns[2].next_state is None
    assert up.eventually(lambda s: s.get_session(sid), lambda x: x is not None and x.done).done


def test_tool_agent_sends_tool_results_or_the_next_question_as_next_state(up: Up):
    r = up.run("tool_agent.py", "--max-tokens", "24")
    summary = _last_json(r.stdout)
    sid = summary["session_id"]
    turns = up.eventually(lambda s: s.session_turns(sid), lambda ts: len(ts) >= 2)
    assert all(t.tools and t.tools[0]["function"]["name"] == "get_weather" for t in turns)
    first = turns[0]
    assert first.next_state, "the first turn got no next state"
    if first.response.get("tool_calls"):  # the model called the tool: the results are the next state
        assert [m["role"] for m in first.next_state] == ["tool"] * len(first.response["tool_calls"])
    else:  # it answered in text (the random tiny model does): the next question is
        assert first.next_state == [{"role": "user", "content": "And in Tokyo? Answer in five words."}]
    assert summary["messages"] >= 5  # system, two questions, two answers (plus any tool traffic)


def test_explicit_feedback_is_stored_as_the_users_judgment(up: Up):
    r = up.run("explicit_feedback.py")
    summary = _last_json(r.stdout)
    fb = summary["feedback"]
    assert [f["reward"] for f in fb] == [1, -1]
    assert fb[1]["hint"].startswith("Show that") and fb[0]["turn_id"] != fb[1]["turn_id"]
    judged = up.eventually(lambda s: [s.judgments(f["turn_id"]) for f in fb], lambda js: all(js))
    for f, js in zip(fb, judged, strict=True):
        [mine] = [j for j in js if j.kind == "feedback"]
        assert mine.judge == "user" and mine.reward == f["reward"]


def test_train_agent_runs_groups_of_tool_episodes_that_settle_with_their_reason(up: Up):
    r = up.run("train_agent.py", "--tasks", "2", "--n", "3", "--max-tokens", "16", "--max-steps", "2")
    summary = _last_json(r.stdout)
    assert len(summary["groups"]) == 2
    for g in summary["groups"]:
        assert g["state"] in ("trained", "dropped") and g["reason"], g
        assert len(g["outcomes"]) == 3 and all(o in (0.0, 0.1, 1.0) for o in g["outcomes"])
        for eid in g["episodes"]:  # every episode's requests are its own session, main turns
            turns = up.eventually(lambda s, eid=eid: s.session_turns(eid), lambda ts: len(ts) >= 1)
            assert turns and all(t.turn_type == "main" and t.tools for t in turns)
    with Store.open(up.db) as store:
        grp = store.get_group(summary["groups"][0]["id"])
    assert grp is not None and grp.task["answer"] > 0 and all(e.state == "scored" for e in grp.episodes)


def test_read_store_summarises_the_live_store_and_an_export_alike(up: Up, tmp_path: Path):
    up.run("sdk_agent.py", "--user", "example-read")  # at least one finished session to read
    live = _last_json(subprocess.run(
        [sys.executable, str(EXAMPLES / "read_store.py"), "--data-dir", str(up.data_dir), "--json"],
        capture_output=True, text=True, timeout=120, check=True).stdout)
    with Store.open(up.db) as store:
        stats = store.stats()
    assert live["total"]["turns"] <= stats.turns and live["total"]["turns"] >= 3
    assert any(s["turns"] == 3 and s["with_next_state"] == 2 for sid, s in live["sessions"].items()
               if sid.startswith("example-read"))
    dump = tmp_path / "turns.jsonl"
    exported = CliRunner().invoke(app, ["export", "--data-dir", str(up.data_dir), "-o", str(dump)])
    assert exported.exit_code == 0, exported.output
    offline = _last_json(subprocess.run(
        [sys.executable, str(EXAMPLES / "read_store.py"), "--jsonl", str(dump), "--json"],
        capture_output=True, text=True, timeout=120, check=True).stdout)
    assert offline["total"]["turns"] >= live["total"]["turns"]
    assert offline["sessions"].keys() >= live["sessions"].keys()


def test_switch_backends_commands_use_real_flags():
    text = (EXAMPLES / "switch_backends.md").read_text()
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                for line in block.splitlines() if "clawbridge " in line]
    assert len(commands) >= 8
    runner = CliRunner()
    for cmd in commands:
        words = shlex.split(cmd[cmd.index("clawbridge "):])
        sub = [w for w in words[1:3] if not w.startswith("-")][:2 if words[1] == "modal" else 1]
        help_text = runner.invoke(app, [*sub, "--help"], terminal_width=200).output
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert flag in help_text, f"{cmd}: {flag} is not an option of clawbridge {' '.join(sub)}"
        for var in re.findall(r"CLAWBRIDGE_([A-Z_]+)=", cmd):
            from clawbridge.config import FLAT

            assert var.lower() in FLAT, f"{cmd}: no setting {var.lower()}"


def test_openclaw_example_is_what_the_config_writer_produces():
    frag = oc.fragment(oc.provider_entry("http://127.0.0.1:30000", "smollm2-135m-instruct", context_window=32768,
                                         max_tokens=128),
                       Path("/home/you/.openclaw/extensions/clawbridge"))
    assert (EXAMPLES / "openclaw.json").read_text() == oc.dumps(frag)


class FirstCallsTool:
    """The real tiny-random backend, except that its first completion is a Hermes tool call to
    get_weather (a random model never calls a tool). The call's logprobs come from the real
    backend's `score`, so the captured turn stays exact; everything else is the real thing."""

    CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0
        self.name, self.model_name, self.context_length = real.name, real.model_name, real.context_length

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    @property
    def version(self) -> int:
        return int(self.real.version)

    async def sample(self, prompt_ids: Any, params: SamplingParams, *, n: int = 1,
                     version: int | None = None, priority: str = "user") -> list[Completion]:
        self.calls += 1
        if self.calls > 1:
            return await self.real.sample(prompt_ids, params, n=n, version=version, priority=priority)  # type: ignore[no-any-return]
        tok = self.real.tokenizer()
        ids = [*tok.encode(self.CALL, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
        lps = await self.real.score(prompt_ids, ids, temperature=params.temperature)
        return [Completion(tuple(ids), tuple(lps), "stop", self.version) for _ in range(n)]


def test_tool_agent_tool_results_are_the_next_state_of_the_calling_turn(tmp_path: Path):
    settings = Settings(model="tiny-random", port=0, data_dir=tmp_path, train=False, default_max_tokens=8)
    server = LiveServer(settings, FirstCallsTool(build_backend(settings))).start()
    try:
        up = Up(server.url, tmp_path)
        r = up.run("tool_agent.py", "--max-tokens", "8")
        summary = _last_json(r.stdout)
        assert summary["tool_calls"] == 1 and "get_weather" in r.stdout
        sid = summary["session_id"]
        t0, t1, *_ = up.eventually(lambda s: s.session_turns(sid),
                                   lambda ts: len(ts) >= 3 and ts[1].next_state is not None)
        [call] = t0.response["tool_calls"]
        assert t0.finish_reason == "tool_calls"
        assert t0.next_state == [{"role": "tool", "tool_call_id": call["id"], "content": "14°C, light rain"}]
        assert t1.next_state == [{"role": "user", "content": "And in Tokyo? Answer in five words."}]
    finally:
        server.stop()
