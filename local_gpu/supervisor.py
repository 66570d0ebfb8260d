"""Launches and keeps alive the SGLang servers of the GPU plan (policy, judge).

Each server is its own process group with its own `CUDA_VISIBLE_DEVICES` and port, logging to
`<data_dir>/logs/<name>.log`. Ready means `/health_generate` answers 200 while the process is
alive (a process that dies while starting is reported at once, not after the timeout). A watcher
restarts a server that exits or stops answering health checks, with exponential backoff; after
`max_restarts` failures in a row it gives up and says so. Stopping is SIGTERM to the group, then
SIGKILL after a grace period — by process group id, never by name.

SGLang is imported and launched only where it is installed (the `gpu` extra); `sglang_argv`
builds its command line from the plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from clawbridge.local_gpu.layout import Plan

log = logging.getLogger(__name__)


class SupervisorError(RuntimeError):
    pass


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


@dataclass(frozen=True)
class ServerSpec:
    name: str  # "policy-sglang", "judge-sglang"
    argv: tuple[str, ...]
    port: int
    gpus: tuple[int, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    health_path: str = "/health_generate"


@dataclass(frozen=True)
class Policy:
    ready_timeout_s: float = 900.0  # big models take minutes to load and capture CUDA graphs
    poll_s: float = 0.5
    health_timeout_s: float = 10.0
    unhealthy_after: int = 3  # consecutive failed health checks of a running server = hung
    check_every_s: float = 5.0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    max_restarts: int = 5
    grace_s: float = 30.0


def sglang_argv(
    model_path: str,
    port: int,
    *,
    tp: int = 1,
    mem_fraction: float = 0.85,
    lora_rank: int | None = None,
    lora_targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    max_loras_per_batch: int = 4,
    context_length: int | None = None,
    served_model_name: str | None = None,
    python: str = sys.executable,
) -> tuple[str, ...]:
    """SGLang's launch command. With `lora_rank`, the server accepts adapters loaded at run time
    up to that rank on those modules (`policy@vK`); several versions share a batch while old
    requests drain, hence max_loras_per_batch > 1; it serves a user's request ahead of the
    learner's (priority scheduling, `sglang.PRIORITY`)."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(tp),
            "--mem-fraction-static", str(mem_fraction), "--skip-server-warmup"]
    if lora_rank:
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--lora-target-modules",
                 *lora_targets, "--max-loras-per-batch", str(max_loras_per_batch),
                 "--enable-priority-scheduling"]
    if context_length:
        argv += ["--context-length", str(context_length)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    return tuple(argv)


@dataclass
class _Managed:
    spec: ServerSpec
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    restarts: int = 0  # consecutive failed (re)starts or crashes
    starts: int = 0
    failed: str | None = None  # why it was given up on
    events: list[str] = field(default_factory=list)


class Supervisor:
    def __init__(self, log_dir: Path, policy: Policy = Policy()) -> None:
        self.log_dir = log_dir
        self.policy = policy
        self._servers: dict[str, _Managed] = {}
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False
        self._http: aiohttp.ClientSession | None = None

    # --- public ---------------------------------------------------------------------------------

    async def start(self, specs: Sequence[ServerSpec]) -> None:
        """Start every server and wait until all are ready; then watch them."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in specs:
            self._servers[spec.name] = _Managed(spec)
        await asyncio.gather(*(self._start_until_ready(m) for m in self._servers.values()))
        self._watch = asyncio.create_task(self._watch_loop())

    def pid(self, name: str) -> int | None:
        m = self._servers[name]
        return m.proc.pid if m.proc is not None and m.proc.poll() is None else None

    def events(self, name: str) -> list[str]:
        return list(self._servers[name].events)

    def failed(self, name: str) -> str | None:
        return self._servers[name].failed

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self._servers[name].spec.port}"

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.gather(*(self._terminate(m, "stop") for m in self._servers.values()))
        if self._http is not None:
            await self._http.close()

    # --- lifecycle ------------------------------------------------------------------------------

    def _spawn(self, m: _Managed) -> None:
        env = {**os.environ, **dict(m.spec.env)}
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, m.spec.gpus))
        if m.log is None:
            m.log = open(self.log_dir / f"{m.spec.name}.log", "ab")  # noqa: SIM115 - kept open across restarts
        m.log.write(f"\n=== clawbridge: starting {m.spec.name} at {time.ctime()} ===\n".encode())
        m.log.flush()
        m.proc = subprocess.Popen(m.spec.argv, env=env, stdout=m.log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        m.starts += 1
        m.events.append(f"start pid={m.proc.pid}")
        log.info("started %s (pid %d, GPUs %s, port %d)", m.spec.name, m.proc.pid,
                 list(m.spec.gpus), m.spec.port)

    async def _healthy(self, m: _Managed) -> bool:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        url = f"http://127.0.0.1:{m.spec.port}{m.spec.health_path}"
        try:
            async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=self.policy.health_timeout_s)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def _wait_ready(self, m: _Managed) -> None:
        deadline = time.monotonic() + self.policy.ready_timeout_s
        while True:
            assert m.proc is not None
            if m.proc.poll() is not None:
                raise SupervisorError(f"{m.spec.name} exited with {m.proc.returncode} while starting; "
                                      f"see {self.log_dir / (m.spec.name + '.log')}")
            if await self._healthy(m):
                m.events.append("ready")
                return
            if time.monotonic() > deadline:
                raise SupervisorError(f"{m.spec.name} was not ready in {self.policy.ready_timeout_s:.0f} s")
            await asyncio.sleep(self.policy.poll_s)

    async def _start_until_ready(self, m: _Managed) -> None:
        while True:
            self._spawn(m)
            try:
                await self._wait_ready(m)
                return
            except SupervisorError as e:
                m.events.append(f"failed: {e}")
                await self._terminate(m, "failed start")
                if not await self._backoff(m, str(e)):
                    raise

    async def _backoff(self, m: _Managed, why: str) -> bool:
        """Count one failure; sleep the backoff and return True to retry, or give up."""
        m.restarts += 1
        if m.restarts > self.policy.max_restarts:
            m.failed = f"gave up after {self.policy.max_restarts} restarts: {why}"
            m.events.append("gave up")
            log.error("%s: %s", m.spec.name, m.failed)
            return False
        delay = min(self.policy.backoff_s * 2 ** (m.restarts - 1), self.policy.backoff_max_s)
        m.events.append(f"backoff {delay:.2f}s")
        log.warning("%s: %s; restarting in %.1f s", m.spec.name, why, delay)
        await asyncio.sleep(delay)
        return True

    async def _terminate(self, m: _Managed, why: str) -> None:
        if m.proc is None:
            return
        code = await asyncio.to_thread(terminate_group, m.proc, self.policy.grace_s)
        m.events.append(f"stopped ({why}) code={code}")
        m.proc = None

    async def _watch_loop(self) -> None:
        misses: dict[str, int] = {n: 0 for n in self._servers}
        while not self._stopping:
            await asyncio.sleep(self.policy.check_every_s)
            for name, m in self._servers.items():
                if m.failed or m.proc is None:
                    continue
                code = m.proc.poll()
                why = None
                if code is not None:
                    why = f"exited with {code}"
                elif await self._healthy(m):
                    misses[name] = 0
                    m.restarts = 0  # healthy again: the backoff starts over
                else:
                    misses[name] += 1
                    if misses[name] >= self.policy.unhealthy_after:
                        why = f"no answer to {misses[name]} health checks (hung)"
                if why is None:
                    continue
                misses[name] = 0
                m.events.append(why)
                await self._terminate(m, why)
                if await self._backoff(m, why):
                    # on failure _start_until_ready has recorded why it gave up
                    with contextlib.suppress(SupervisorError):
                        await self._start_until_ready(m)


def terminate_group(proc: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM to the process group, SIGKILL after `grace_s`; reaps the leader."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
    # children left in the group (SGLang's schedulers) go with it
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.poll()


def plan_specs(
    plan: Plan,
    model_path: str,
    *,
    lora_rank: int,
    judge_model_path: str | None = None,
    context_length: int | None = None,
) -> list[ServerSpec]:
    """The SGLang servers of a GPU plan: the policy server (LoRA enabled) and, where the plan has
    PRM GPUs of its own, the judge server (frozen base)."""
    from clawbridge.local_gpu import layout

    specs = []
    for proc in plan.processes:
        if proc.role == "rollout":
            fraction = layout.COLOCATED_FRACTION if plan.mode == "colocated" else layout.DEDICATED_FRACTION
            specs.append(ServerSpec(proc.name, sglang_argv(
                model_path, proc.port, tp=len(proc.gpus), mem_fraction=fraction,
                lora_rank=lora_rank, context_length=context_length), proc.port, proc.gpus))
        elif proc.role == "prm":
            specs.append(ServerSpec(proc.name, sglang_argv(
                judge_model_path or model_path, proc.port, tp=len(proc.gpus),
                mem_fraction=layout.DEDICATED_FRACTION, context_length=context_length),
                proc.port, proc.gpus))
    return specs


def serving_mode(visible_gpus: int, sglang_installed: bool | None = None) -> tuple[str, str]:
    """How the `local` backend serves here, and the start-up line that says so:
    SGLang where it is installed and a GPU is visible, else the torch engine on CUDA, else CPU."""
    installed = sglang_available() if sglang_installed is None else sglang_installed
    if visible_gpus <= 0:
        return "torch-cpu", "no GPU visible: serving and training with the torch engine on CPU"
    if not installed:
        return "torch-cuda", (f"{visible_gpus} GPU(s) but SGLang is not installed "
                              "(pip install 'clawbridge[gpu]'): serving with the torch engine on CUDA")
    return "sglang", f"{visible_gpus} GPU(s): SGLang servers per the plan, FSDP2 trainer under torchrun"
