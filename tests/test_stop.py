"""A clean, fast stop: SIGTERM to a real `clawbridge up` while the engine scores a long prompt
for the learner (the OPD teacher on a corrected turn) exits 0 within 5 s, every native thread
joined, and the store keeps the turn with its sample not trained (it is judged again after a
restart: nothing captured is lost, nothing trained twice). A stream longer than the grace
period is ended when it runs out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx
import pytest
from clawbridge.store import Store
from helpers.processes import free_port, wait_ready

pytestmark = pytest.mark.slow

# ~24 K tokens of the embedded tokenizer: the teacher's scoring of it takes the tiny model many
# seconds on two busy cores, far longer than the stop may.
LONG = " ".join(f"w{i}" for i in range(4800))


def start_up(port: int, data: Path, log: IO[str], *flags: str) -> subprocess.Popen:
    cli = Path(sys.executable).with_name("clawbridge")
    return subprocess.Popen(
        [str(cli), "up", "--backend", "local", "--model", "tiny-random", "--port", str(port),
         "--data-dir", str(data), *flags],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "CLAWBRIDGE_GATE": "off"},
    )


def test_sigterm_while_the_engine_scores_a_long_prompt_exits_0_within_5_s(tmp_path: Path):
    port, data = free_port(), tmp_path / "data"
    log = (tmp_path / "up.log").open("w")
    proc = start_up(port, data, log, "--method", "opd", "--judge", "rules")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=240)
        messages = [{"role": "user", "content": f"Summarise this: {LONG}"}]
        with httpx.Client(base_url=url, timeout=300, headers={"X-Session-Id": "stop-1"}) as h:
            first = h.post("/v1/chat/completions", json={"model": "tiny-random", "max_tokens": 4,
                                                          "messages": messages})
            assert first.status_code == 200, first.text
            answer = first.json()["choices"][0]["message"]["content"]
            # a correction: the rules judge hints, and the teacher scores the long turn with it
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "No, that is wrong: answer in one short sentence."}]
            assert h.post("/v1/chat/completions", json={"model": "tiny-random", "max_tokens": 4,
                                                         "messages": messages}).status_code == 200
            deadline = time.monotonic() + 120
            while h.get("/v1/status").json().get("extra", {}).get("judged", 0) < 1:
                assert time.monotonic() < deadline, "the learner never judged the turn"
                time.sleep(0.05)
        time.sleep(0.5)  # the judgment is in; the teacher's scoring is under way
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    output = (tmp_path / "up.log").read_text()
    assert code == 0, output[-3000:]
    assert elapsed < 5, f"stopped in {elapsed:.1f} s"
    assert "terminate called" not in output
    with Store.open(f"sqlite:///{data.resolve() / 'clawbridge.db'}") as store:
        turns = store.session_turns("stop-1")
        assert len(turns) == 2 and turns[0].next_state is not None  # the corrected turn is kept
        assert store.pending_samples(state="trained") == []
        [sample] = store.pending_samples(state="pending")  # its advantages were never written
        assert sample.turn_id == turns[0].id


def test_a_stream_longer_than_the_grace_period_is_ended_and_the_process_exits_0(tmp_path: Path):
    port, data = free_port(), tmp_path / "data"
    log = (tmp_path / "up.log").open("w")
    proc = start_up(port, data, log, "--no-train")
    url = f"http://127.0.0.1:{port}"
    body = {"model": "tiny-random", "max_tokens": 20000, "stream": True,
            "messages": [{"role": "user", "content": "an endless answer please"}]}
    try:
        wait_ready(url, proc, timeout=240)
        events = 0
        with pytest.raises(httpx.HTTPError), httpx.stream(  # the server ends it: an incomplete body
                "POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 2:  # under way, and far from done: SIGTERM now
                    t0 = time.monotonic()
                    os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert code == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert elapsed < 5, f"stopped in {elapsed:.1f} s (grace 3 s)"
