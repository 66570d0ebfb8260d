"""The bridge's handle on the FSDP2 LoRA trainer: launches `torchrun` (one rank per actor GPU, or
CPU ranks on gloo) running `clawbridge.local_gpu.fsdp_worker`, and drives it over a small
authenticated RPC (`multiprocessing.connection`, pickled dataclasses) so the ranks keep the model
and optimizer between steps. Implements `clawbridge.backends.sglang.Trainer`.

The trainer runs in its own process group: `close()` asks it to shut down, then `killpg` with
SIGTERM and, after a grace period, SIGKILL — never anything by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import IO, Any

from clawbridge.local_gpu.supervisor import terminate_group
from clawbridge.protocol import BackendError
from clawbridge.types import Datum, LossSpec, OptimSpec, StepMetrics

log = logging.getLogger(__name__)


class TrainerError(BackendError):
    """The trainer processes failed (the message carries every failing rank's traceback)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FSDPTrainer:
    def __init__(
        self,
        model: str,
        *,
        nproc: int = 1,
        device: str = "cpu",
        gpus: Sequence[int] = (),
        lora_rank: int = 32,
        lora_alpha: int = 32,
        seed: int = 0,
        cache_dir: Path | None = None,
        log_file: Path | None = None,
        master_port: int | None = None,
        threads: int = 0,
        extra_args: Sequence[str] = (),
        step_timeout_s: float = 1800.0,
        start_timeout_s: float = 600.0,
        grace_s: float = 10.0,
    ) -> None:
        self.model = model
        self.nproc = nproc
        self.device = device
        self.gpus = tuple(gpus)
        self.lora_rank, self.lora_alpha, self.seed = lora_rank, lora_alpha, seed
        self.cache_dir = cache_dir
        self.log_file = log_file
        self.master_port = master_port
        self.threads = threads
        self.extra_args = tuple(extra_args)
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lock = asyncio.Lock()
        self._log: IO[bytes] | None = None

    def argv(self, rpc_port: int, master_port: int) -> list[str]:
        args = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(self.nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(master_port),
            "-m", "clawbridge.local_gpu.fsdp_worker",
            "--model", self.model, "--rpc-port", str(rpc_port), "--device", self.device,
            "--lora-rank", str(self.lora_rank), "--lora-alpha", str(self.lora_alpha),
            "--seed", str(self.seed), "--threads", str(self.threads),
        ]
        if self.cache_dir is not None:
            args += ["--cache-dir", str(self.cache_dir)]
        return args + list(self.extra_args)

    async def start(self) -> None:
        rpc_port = free_port()
        master_port = self.master_port or free_port()
        key = secrets.token_hex(16)
        env = {**os.environ, "CLAWBRIDGE_TRAINER_KEY": key, "OMP_NUM_THREADS": str(self.threads or 1)}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        out: IO[bytes] | int = subprocess.DEVNULL
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log = out = open(self.log_file, "ab")  # noqa: SIM115 - lives as long as the trainer
        self.proc = subprocess.Popen(self.argv(rpc_port, master_port), env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise TrainerError(f"the trainer exited with {self.proc.returncode} while starting"
                                   f"{self._log_hint()}")
            try:
                self._conn = await asyncio.to_thread(Client, ("127.0.0.1", rpc_port), authkey=key.encode())
                break
            except (ConnectionRefusedError, OSError):
                if time.monotonic() > deadline:
                    await self.close()
                    raise TrainerError(f"the trainer did not start in {self.start_timeout_s:.0f} s") from None
                await asyncio.sleep(0.2)
        log.info("FSDP trainer up: %d rank(s) on %s (pid %d)", self.nproc, self.device, self.proc.pid)

    def _log_hint(self) -> str:
        return f"; see {self.log_file}" if self.log_file else ""

    async def call(self, name: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if self._conn is None:
            raise TrainerError("the trainer is not started")
        conn = self._conn
        limit = timeout_s or self.step_timeout_s

        def roundtrip() -> Any:
            conn.send((name, kwargs))
            deadline = time.monotonic() + limit
            while not conn.poll(0.2):
                if self.proc is not None and self.proc.poll() is not None:
                    raise TrainerError(f"the trainer died during {name} (exit {self.proc.returncode})"
                                       f"{self._log_hint()}")
                if time.monotonic() > deadline:
                    raise TrainerError(f"the trainer did not finish {name} in {limit:.0f} s")
            return conn.recv()

        async with self._lock:  # one command at a time: every rank runs it in lockstep
            status, value = await asyncio.to_thread(roundtrip)
        if status != "ok":
            raise TrainerError(f"{name} failed:\n{value}")
        return value

    async def train_step(self, batch: Sequence[Datum], loss: LossSpec = LossSpec(),
                         optim: OptimSpec = OptimSpec()) -> StepMetrics:
        if not batch:
            raise ValueError("train_step needs at least one Datum")
        m = await self.call("train_step", batch=list(batch), loss=loss, optim=optim)
        return StepMetrics(**m)

    async def save_adapter(self, path: Path) -> None:
        await self.call("save_adapter", path=str(path))

    async def load_adapter(self, path: Path | None) -> None:
        await self.call("load_adapter", path=None if path is None else str(path))

    async def save_state(self, path: Path) -> None:
        await self.call("save_state", path=str(path))

    async def load_state(self, path: Path) -> None:
        await self.call("load_state", path=str(path))

    async def info(self) -> dict[str, Any]:
        return dict(await self.call("info"))

    def _stop_group(self, proc: subprocess.Popen[bytes]) -> None:
        """Give torchrun a moment to exit after "shutdown", then stop its process group (the
        ranks it spawned share it) as the supervisor stops a server."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=min(self.grace_s, 5.0))
        terminate_group(proc, self.grace_s)

    async def close(self) -> None:
        if self._conn is not None:
            try:
                await self.call("shutdown", timeout_s=self.grace_s)
            except (TrainerError, OSError, EOFError) as e:
                log.warning("trainer shutdown: %s", e)
            self._conn.close()
            self._conn = None
        if self.proc is not None:
            await asyncio.to_thread(self._stop_group, self.proc)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
