"""The engine's scoring, training and checkpoints, on the scheduler thread: logprobs of a
completion under the newest policy or the base, the PPO train step over packed micro-batches,
and the trainable adapter + optimizer saved and loaded."""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from clawbridge.local_gpu import adapters, models
from clawbridge.local_gpu.adapters import BASE, TRAIN
from clawbridge.local_gpu.kvcache import CACHE, cache_of
from clawbridge.local_gpu.packing import pack, packed_micro_batches
from clawbridge.local_gpu.prefixcache import PrefixCache
from clawbridge.loss import batch_tokens, ppo_token_losses, token_logprobs, topk_reverse_kl
from clawbridge.protocol import BackendError, UnknownVersion
from clawbridge.types import (
    Datum,
    LossSpec,
    OptimSpec,
    StepMetrics,
)

log = logging.getLogger(__name__)

# Scoring a longer sequence runs in forwards of this many tokens on one cache, so that one
# layer's attention stays bounded and a closing engine abandons it soon. Chunks cost time on CPU
# (tiny model, 8 K tokens: 1.8 s whole, 2.5 s in chunks of 4 K, 3.3 s of 2 K; same logprobs).
SCORE_CHUNK = 4096
# Scores waiting together are packed into one row of up to this many tokens (`Engine._more_scores`):
# one forward's overhead for all of them, short enough for decode steps to come between.
SCORE_ROW = 1024


class Training:
    """Scoring, the train step and checkpoints, mixed into `engine.Engine` (whose `__init__` sets
    the state below)."""

    spec: models.ModelSpec
    data_dir: Path
    device: str
    lora_rank: int
    lora_alpha: int
    train_token_budget: int
    _model: Any
    _newest: int
    _steps: int
    _optimizer: torch.optim.AdamW | None
    _initial: dict[str, torch.Tensor]
    _prefixes: PrefixCache
    _abandonable: Callable[[], AbstractContextManager[None]]
    _forward: Callable[..., Any]
    _acquire: Callable[[int | None], int]
    _release: Callable[[int], None]
    _row: Callable[[int], str]
    _adapter_dir: Callable[[int], Path]
    _served: dict[int, str]
    _folders: dict[int, Path]
    _serve: Callable[[int, dict[str, torch.Tensor]], None]
    _yield_to_users: Callable[[], None]

    def _score(
        self,
        prompt: tuple[int, ...],
        completion: tuple[int, ...],
        model: Literal["policy", "base"],
        temperature: float,
        version: int | None = None,
    ) -> list[float]:
        if not prompt or not completion:
            raise ValueError("score needs a non-empty prompt and completion")
        if model == "base":
            return self._score_on(BASE, prompt, completion, temperature)
        held = self._acquire(version)  # "policy": the newest, or the version asked for
        try:
            return self._score_on(self._row(held), prompt, completion, temperature)
        finally:
            self._release(held)

    def _score_on(self, name: str, prompt: tuple[int, ...], completion: tuple[int, ...], temperature: float) -> list[float]:
        ids, keep = prompt + completion, len(completion) + 1
        with torch.inference_mode(), self._abandonable():
            parts, cache = [], None
            for at in range(0, len(ids), SCORE_CHUNK):  # one chunk unless the sequence is long
                end = min(at + SCORE_CHUNK, len(ids))
                want = end - max(at, len(ids) - keep)  # this chunk's positions among the last `keep`
                inputs: dict[str, Any] = {"input_ids": torch.tensor([ids[at:end]], device=self.device),
                                          "logits_to_keep": max(want, 1)}
                if len(ids) > SCORE_CHUNK:
                    inputs.update({"use_cache": True, CACHE: cache},
                                  position_ids=torch.arange(at, end, device=self.device).view(1, -1))
                out = self._forward([name], **inputs)
                cache = cache_of(out)
                if want > 0:
                    parts.append(out.logits[0, -want:])
            logits = torch.cat(parts)[:-1]
            targets = torch.tensor(completion, device=self.device)
            lp = token_logprobs(logits, targets, temperature if temperature > 0 else 1.0)
        return [float(x) for x in lp.tolist()]

    def _scores(self, asked: list[tuple[tuple[int, ...], tuple[int, ...], str, float, int | None]]) -> list[list[float]]:
        """Several `_score`s on one model and version (`asked`: their arguments, SCORE_CHUNK tokens
        at most in all) in one packed forward: one forward's overhead for all of them. Each is a
        solo `_score`'s logprobs up to the matmuls' rounding at another shape (exact in fp32)."""
        model, version = asked[0][2], asked[0][4]
        held = None if model == "base" else self._acquire(version)
        name = BASE if held is None else self._row(held)
        data = [Datum(p, c, (0.0,) * len(c), (0.0,) * len(c), t if t > 0 else 1.0) for p, c, _, t, _ in asked]
        try:
            with torch.inference_mode(), self._abandonable():
                lp = self._batch_logprobs(data, name).tolist()
        finally:
            if held is not None:
                self._release(held)
        out, at = [], 0
        for d in data:
            out.append([float(x) for x in lp[at : at + len(d.completion_ids)]])
            at += len(d.completion_ids)
        return out

    def _logits(self, ids: tuple[int, ...], requested: int | None) -> torch.Tensor:
        if not ids:
            raise ValueError("logits needs at least one token")
        version = self._acquire(requested)
        try:
            with torch.inference_mode():
                x = torch.tensor([ids], device=self.device)
                return self._forward([self._row(version)], input_ids=x).logits[0].float().cpu()
        finally:
            self._release(version)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self._model.parameters() if p.requires_grad]

    def _get_optimizer(self) -> torch.optim.AdamW:
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self._params(), lr=1e-4)
        return self._optimizer

    def _completion_logits(self, group: list[Datum], name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits at every completion position of `group` ([tokens, V], concatenated) and
        the completion tokens, under adapter `name` (None: the trainable one). The group is
        packed into one row without padding (`packing.py`); only completion positions' logits
        are materialised."""
        packed = pack(group)
        device = self.device
        logits = self._forward(
            None if name is None else [name],
            input_ids=torch.tensor([packed.ids], device=device),
            position_ids=torch.tensor([packed.positions], device=device),
            logits_to_keep=torch.tensor(packed.keep, device=device),
            use_cache=False,  # with a cache transformers would not read the packed positions
        ).logits[0]
        return logits, torch.tensor(packed.targets, device=device)

    @staticmethod
    def _logprobs_of(group: list[Datum], logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        parts, at = [], 0
        for d in group:
            n = len(d.completion_ids)
            temperature = d.temperature if d.temperature > 0 else 1.0
            parts.append(token_logprobs(logits[at : at + n], targets[at : at + n], temperature))
            at += n
        return torch.cat(parts)

    def _batch_logprobs(self, group: list[Datum], name: str | None = None) -> torch.Tensor:
        """New logprobs of every completion token of `group`, concatenated, each datum at its
        own temperature, under adapter `name` (None: the trainable one)."""
        return self._logprobs_of(group, *self._completion_logits(group, name))

    def _topk_kl(self, group: list[Datum], student: torch.Tensor, k: int,
                 teacher_model: Literal["base", "policy"] = "base") -> torch.Tensor:
        """Per completion token of `group`: KL(student || teacher) over the teacher's top-k
        (`loss.topk_reverse_kl`) where the datum has a teacher prompt, 0 elsewhere. The teacher
        is the base model (adapter off), or with `teacher` "policy" the trainable adapter as the
        step found it (no gradient), under the teacher prompt + the same completion."""
        taught = [d for d in group if d.teacher_prompt_ids is not None]
        out = torch.zeros(student.shape[0], device=student.device, dtype=torch.float32)
        if not taught:
            return out
        with torch.no_grad():
            teacher, _ = self._completion_logits(
                [replace(d, prompt_ids=d.teacher_prompt_ids) for d in taught],  # type: ignore[arg-type]
                BASE if teacher_model == "base" else None)
        at = t_at = 0
        for d in group:
            n = len(d.completion_ids)
            if d.teacher_prompt_ids is not None:
                out[at : at + n] = topk_reverse_kl(student[at : at + n], teacher[t_at : t_at + n], k, d.temperature)
                t_at += n
            at += n
        return out

    def _train_step(
        self, batch: tuple[Datum, ...], loss: LossSpec, optim: OptimSpec
    ) -> StepMetrics:
        if not batch:
            raise ValueError("train_step needs at least one Datum")
        started = time.perf_counter()
        total = batch_tokens(batch)
        optimizer = self._get_optimizer()
        for param_group in optimizer.param_groups:
            param_group.update(
                lr=optim.learning_rate,
                betas=(optim.beta1, optim.beta2),
                eps=optim.eps,
                weight_decay=optim.weight_decay,
            )
        optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped = kl = topk_sum = 0.0
        for group in packed_micro_batches(batch, self.train_token_budget):
            base = None
            if loss.kl_coef:
                with torch.no_grad():
                    base = self._batch_logprobs(group, BASE)
            logits, targets = self._completion_logits(group)
            new = self._logprobs_of(group, logits, targets)
            old = torch.tensor(
                [x for d in group for x in d.logprobs], device=new.device, dtype=new.dtype
            )
            adv = torch.tensor(
                [x for d in group for x in d.advantages], device=new.device, dtype=new.dtype
            )
            terms = ppo_token_losses(new, old, adv, torch.ones_like(new), loss, base)
            per_token = terms.loss
            if loss.topk > 0:
                distill = self._topk_kl(group, logits, loss.topk, loss.topk_teacher)
                per_token = per_token + loss.topk_coef * distill.to(per_token.dtype)
                topk_sum += float(distill.detach().sum())
            del logits
            part = per_token.sum() / total  # token-mean over the WHOLE batch
            part.backward()
            loss_sum += float(part.detach())
            clipped += float(terms.clipped.sum())
            kl += float(terms.approx_kl.sum())
            self._yield_to_users()  # a user's request waits for one micro-batch, not the step
        max_norm = optim.grad_clip_norm if optim.grad_clip_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params(), max_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return StepMetrics(
            loss=loss_sum,
            clip_fraction=clipped / total,
            approx_kl=kl / total,
            grad_norm=grad_norm,
            tokens=total,
            samples=len(batch),
            seconds=time.perf_counter() - started,
            extra={"topk_kl": topk_sum / total} if loss.topk > 0 else {},
        )

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self._model, adapter_name=TRAIN)
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    # --- checkpoints ---------------------------------------------------------------------------

    def _checkpoint_dir(self, name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() else self.data_dir / "checkpoints" / name

    def _save_state(self, name: str) -> str:
        path = self._checkpoint_dir(name)
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._model.save_pretrained(str(tmp / "adapter"), selected_adapters=[TRAIN])
        optimizer = self._optimizer.state_dict() if self._optimizer is not None else None
        torch.save({"optimizer": optimizer}, tmp / "optimizer.pt")
        meta = {
            "version": self._newest,
            "steps": self._steps,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "model": self.spec.name,
        }
        (tmp / "state.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        return str(path)

    def _set_trainable(self, weights: dict[str, torch.Tensor]) -> None:
        """The trainable adapter's weights, and a fresh optimizer for them."""
        from peft import set_peft_model_state_dict

        with torch.no_grad():
            set_peft_model_state_dict(self._model, weights, adapter_name=TRAIN)
        self._optimizer = None

    def _restore(self, version: int, path: str | None) -> None:
        """After a restart: train on from the weights published as `version` (at `path`), with a
        fresh optimizer, and serve them as the newest version."""
        self._set_trainable(self._weights_at(version, path))
        self._prefixes.clear()  # a version number read back from disk: cache nothing across
        self._newest = version
        self._release(self._acquire(None))  # loads the newest version's adapter if missing

    def _weights_at(self, version: int, path: str | None) -> dict[str, torch.Tensor]:
        """The weights published as `version` (at `path`; v0: the initial adapter)."""
        if version == 0:
            return self._initial
        folder = Path(path) if path else self._adapter_dir(version)
        file = folder / adapters.WEIGHTS
        if not file.exists():
            raise UnknownVersion(version, self._newest, f"policy@v{version}'s weights are gone ({file} is missing)")
        if folder != self._adapter_dir(version):  # another process's (docs/scale-out.md)
            self._folders[version] = folder
        return adapters.read(folder, str(self.device))

    def _switch(self, state: str | None, version: int, path: str | None) -> None:
        """Another lineage's trainable weights and optimizer (`Engine.switch`); what serves and
        the newest version are left alone."""
        if state is None:
            self._set_trainable(self._weights_at(version, path))
        else:
            self._load_checkpoint(self._checkpoint_dir(state))

    def _load_state(self, name: str) -> None:
        meta = self._load_checkpoint(self._checkpoint_dir(name))
        self._prefixes.clear()
        self._newest = int(meta["version"])
        self._release(self._acquire(None))  # loads the newest version's adapter if missing

    def _load_checkpoint(self, path: Path) -> dict[str, Any]:
        """The trainable weights and the optimizer's state saved at `path`; returns its meta."""
        from safetensors.torch import load_file

        if not (path / "state.json").exists():
            raise BackendError(f"no checkpoint at {path}")
        meta: dict[str, Any] = json.loads((path / "state.json").read_text())
        self._set_trainable(
            load_file(str(path / "adapter" / "adapter_model.safetensors"), device=str(self.device))
        )
        saved = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True)
        if saved["optimizer"] is not None:
            self._get_optimizer().load_state_dict(saved["optimizer"])
        self._steps = int(meta["steps"])
        return meta
