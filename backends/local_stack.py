"""`clawbridge up --backend local`: which local stack serves, chosen from the machine.

- no GPU visible: the torch engine on CPU (`LocalBackend`);
- GPUs but SGLang not installed: the torch engine on CUDA in bf16, one GPU (`LocalBackend`);
- GPUs and SGLang: the plan's processes (`layout.plan`) — SGLang servers under the `Supervisor`,
  the FSDP2 trainer under torchrun — behind `SGLangBackend` (`SGLangStack` below).

The start-up line says which one runs and why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from clawbridge.backends.sglang import SGLangBackend
from clawbridge.local_gpu import layout, models
from clawbridge.local_gpu.fsdp import FSDPTrainer
from clawbridge.local_gpu.supervisor import ServerSpec, Supervisor, plan_specs, serving_mode
from clawbridge.protocol import BackendError

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from clawbridge.protocol import Backend
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def gpu_plan(settings: Settings, visible: int) -> layout.Plan:
    """The plan for this machine: NUM_GPUS (default: every visible GPU) split by the role counts,
    validated against what is visible."""
    n = visible if settings.gpus.num_gpus is None else settings.gpus.num_gpus
    p = layout.plan(n, settings.gpus.actor_gpus, settings.gpus.rollout_gpus, settings.gpus.prm_gpus,
                    lora_rank=settings.training.lora_rank)
    layout.validate_visible(p, visible)
    return p


def build_local(settings: Settings, *, visible: int | None = None, sglang_installed: bool | None = None) -> Backend:
    """The `local` backend for this machine (see the module docstring)."""
    from clawbridge.backends.local import LocalBackend

    visible = layout.visible_gpus() if visible is None else visible
    if settings.gpus.num_gpus == 0:
        visible = 0
    mode, line = serving_mode(visible, sglang_installed)
    print(f"clawbridge: {line}", flush=True)
    if mode == "torch-cpu":
        return LocalBackend.from_settings(settings)
    if mode == "torch-cuda":
        import torch

        return LocalBackend.from_settings(settings, device="cuda", dtype=torch.bfloat16)
    return SGLangStack.from_settings(settings, gpu_plan(settings, visible))


class SGLangStack(SGLangBackend):
    """`SGLangBackend` that owns its processes: `start` launches the plan's SGLang servers and the
    trainer (concurrently: both load the model for minutes) and `close` stops them. Everything
    between is the plain `SGLangBackend`."""

    trainer: FSDPTrainer

    def __init__(
        self,
        plan: layout.Plan,
        supervisor: Supervisor,
        trainer: FSDPTrainer,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_path: str,
        model_name: str,
        context_length: int,
        settings: Settings,
        specs: Sequence[ServerSpec] | None = None,
    ) -> None:
        """`specs` default to the plan's SGLang command lines (`plan_specs`); tests pass their
        own servers on the same names."""
        names = {p.role: p.name for p in plan.processes}
        self.plan = plan
        self.supervisor = supervisor
        self.model_path = model_path
        self.specs = list(specs) if specs is not None else plan_specs(
            plan, model_path, lora_rank=settings.training.lora_rank, context_length=context_length)
        ports = {s.name: s.port for s in self.specs}
        judge = names.get("prm")
        super().__init__(
            f"http://127.0.0.1:{ports[names['rollout']]}",
            tokenizer,
            model_name=model_name,
            context_length=context_length,
            data_dir=settings.data_dir,
            trainer=trainer,
            judge_url=f"http://127.0.0.1:{ports[judge]}" if judge in ports else None,
        )

    @classmethod
    def from_settings(cls, settings: Settings, plan: layout.Plan) -> SGLangStack:
        spec = models.resolve(settings.model, settings.cache_dir)
        if spec.path is None:
            raise BackendError(
                f"SGLang serves models from a folder; {settings.model!r} has none "
                "(use the embedded model or a local Hugging Face directory)"
            )
        actor = plan.roles["actor"]
        trainer = FSDPTrainer(
            str(spec.path), nproc=len(actor), device="cuda", gpus=actor,
            lora_rank=settings.training.lora_rank, lora_alpha=settings.training.lora_alpha, seed=settings.seed,
            cache_dir=settings.cache_dir, log_file=settings.data_dir / "logs" / "trainer.log",
        )
        return cls(
            plan, Supervisor(settings.data_dir / "logs"), trainer, models.load_tokenizer(spec),
            model_path=str(spec.path), model_name=settings.serving.served_model_name or spec.name,
            context_length=spec.context_length, settings=settings,
        )

    @property
    def judge_endpoint(self) -> tuple[str, str]:
        """The OpenAI endpoint and model name the `backend` judge uses: the PRM server (frozen
        base) where the plan has one, else the policy server's base model."""
        return self.judge_base_url, self.model_path

    async def start(self) -> None:
        log.info("starting %s", ", ".join(p.name for p in self.plan.processes if p.role != "proxy"))
        starts = [asyncio.create_task(self.supervisor.start(self.specs)),
                  asyncio.create_task(self.trainer.start())]
        try:
            await asyncio.gather(*starts)
            await super().start()
        except BaseException:
            for task in starts:  # the other one may still be loading: stop waiting for it
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            await self.close()
            raise

    async def close(self) -> None:
        await super().close()  # the trainer too
        await self.supervisor.stop()
