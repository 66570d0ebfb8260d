"""The supervisor against fake SGLang server processes that start slowly, crash, hang and exit."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from clawbridge.local_gpu import layout
from clawbridge.local_gpu.fsdp import free_port
from clawbridge.local_gpu.supervisor import (
    Policy,
    ServerSpec,
    Supervisor,
    SupervisorError,
    plan_specs,
    sglang_argv,
)
from helpers.processes import alive

FAKE = str(Path(__file__).parent / "fakes" / "fake_sglang.py")
FAST = Policy(ready_timeout_s=30, poll_s=0.1, health_timeout_s=0.5, unhealthy_after=2,
              check_every_s=0.2, backoff_s=0.1, backoff_max_s=0.4, max_restarts=3, grace_s=1.0)


def fake(name: str, *flags: str, gpus: tuple[int, ...] = (4, 5)) -> ServerSpec:
    port = free_port()
    return ServerSpec(name, (sys.executable, FAKE, "--no-model", "--port", str(port), *flags), port, gpus)


async def wait_for(cond, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_servers_start_in_their_own_group_with_their_gpus_and_wait_for_health(tmp_path):
    sup = Supervisor(tmp_path / "logs", FAST)
    spec = fake("policy-sglang", "--startup-s", "0.8")
    started = time.monotonic()
    await sup.start([spec])
    try:
        assert time.monotonic() - started >= 0.8  # /health_generate said 503 until then
        pid = sup.pid("policy-sglang")
        assert pid is not None and os.getpgid(pid) == pid != os.getpgid(0)
        await wait_for(lambda: "CUDA_VISIBLE_DEVICES=4,5" in (tmp_path / "logs" / "policy-sglang.log").read_text())
    finally:
        await sup.stop()
    assert not alive(pid)


async def test_a_server_dying_while_starting_is_reported_at_once_and_retried_then_given_up(tmp_path):
    counter = tmp_path / "count"
    sup = Supervisor(tmp_path / "logs", Policy(**{**FAST.__dict__, "max_restarts": 2, "ready_timeout_s": 60}))
    started = time.monotonic()
    with pytest.raises(SupervisorError, match="exited with 1 while starting"):
        await sup.start([fake("policy-sglang", "--startup-s", "30", "--crash-after", "0.2",
                              "--counter", str(counter))])
    assert time.monotonic() - started < 30  # not the 60 s ready timeout
    assert counter.read_text() == "3"  # the first start and two restarts
    assert "gave up" in (sup.failed("policy-sglang") or "")
    await sup.stop()


async def test_a_crashed_server_is_restarted_with_backoff(tmp_path):
    counter = tmp_path / "count"
    sup = Supervisor(tmp_path / "logs", FAST)
    await sup.start([fake("policy-sglang", "--crash-after", "0.5", "--crash-times", "1",
                          "--counter", str(counter))])
    try:
        first = sup.pid("policy-sglang")
        await wait_for(lambda: sup.pid("policy-sglang") not in (None, first)
                       and "ready" in sup.events("policy-sglang")[-1])
        events = sup.events("policy-sglang")
        assert "exited with 1" in events and any(e.startswith("backoff") for e in events)
        assert counter.read_text() == "2"
    finally:
        await sup.stop()


async def test_a_clean_exit_is_restarted_too(tmp_path):
    counter = tmp_path / "count"
    sup = Supervisor(tmp_path / "logs", FAST)
    await sup.start([fake("judge-sglang", "--exit-after", "0.3", "--crash-times", "1",
                          "--counter", str(counter), gpus=(6,))])
    try:
        await wait_for(lambda: counter.read_text() == "2" and sup.events("judge-sglang")[-1] == "ready")
        assert "exited with 0" in sup.events("judge-sglang") and sup.failed("judge-sglang") is None
    finally:
        await sup.stop()


async def test_a_hung_server_is_killed_even_if_it_ignores_sigterm_and_restarted(tmp_path):
    counter = tmp_path / "count"
    sup = Supervisor(tmp_path / "logs", FAST)
    await sup.start([fake("policy-sglang", "--hang-after", "0.5", "--ignore-sigterm",
                          "--crash-times", "1", "--counter", str(counter))])
    try:
        hung = sup.pid("policy-sglang")
        assert hung is not None
        await wait_for(lambda: any("hung" in e for e in sup.events("policy-sglang")))
        await wait_for(lambda: not alive(hung), timeout=10)  # SIGKILL after the grace period
        await wait_for(lambda: sup.pid("policy-sglang") not in (None, hung))
    finally:
        await sup.stop()


def test_sglang_command_lines_follow_the_plan():
    specs = plan_specs(layout.plan(8), "/models/qwen3-4b", lora_rank=32)
    policy, judge = specs
    assert policy.gpus == (4, 5) and judge.gpus == (6, 7)
    assert policy.port == layout.POLICY_PORT and judge.port == layout.JUDGE_PORT
    assert "--enable-lora" in policy.argv and "--enable-lora" not in judge.argv
    assert "--enable-priority-scheduling" in policy.argv  # the user's requests before the learner's
    assert policy.argv[policy.argv.index("--tp-size") + 1] == "2"
    assert policy.argv[policy.argv.index("--max-lora-rank") + 1] == "32"
    (colocated,) = plan_specs(layout.plan(1), "/m", lora_rank=16)
    assert colocated.argv[colocated.argv.index("--mem-fraction-static") + 1] == "0.4"
    assert plan_specs(layout.plan(0), "/m", lora_rank=16) == []
    assert sglang_argv("/m", 1)[1:3] == ("-m", "sglang.launch_server")


def test_without_sglang_a_gpu_machine_serves_with_the_torch_engine_on_cuda_and_says_so():
    from clawbridge.local_gpu.supervisor import serving_mode

    assert serving_mode(8, sglang_installed=True)[0] == "sglang"
    mode, line = serving_mode(1, sglang_installed=False)
    assert mode == "torch-cuda" and "not installed" in line and "CUDA" in line
    assert serving_mode(0, sglang_installed=True)[0] == "torch-cpu"
