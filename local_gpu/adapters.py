"""Published adapters: served from memory at once, persisted to `adapters/vK/` in the background.

A publish copies the trainable LoRA weights into a serving slot (a PEFT adapter kept for reuse, so
no LoRA layers are created on the hot path) and serves that slot; a writer thread persists the same
weights, taken in the trainable adapter's dtype, to a temporary folder, syncs it and renames it
to `adapters/vK`. The temporary folder is created before the version serves: it reserves the number,
so a crash between the switch and the rename leaves `.vK.tmp` behind and no later publish reuses K.

What is served is what a restart loads: the slot is filled by `copy_` from the trainable weights,
exactly as loading the persisted folder into a slot does (the same cast to the slot's dtype: the
model's on a GPU, fp32 on a CPU, whose activations stay fp32).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
BASE = "__base__"  # PEFT's row name for "no adapter"
TRAIN = "default"  # the trainable adapter; saved without a sub-folder under this name
STALE = "\0stale"  # no adapter's name: the LoRA layers must be pointed again before a forward
SPARE = 1  # slots kept for the next publish once their version is no longer served


def folder(root: Path, version: int) -> Path:
    return root / f"v{version}"


def _reservation(root: Path, version: int) -> Path:
    return root / f".v{version}.tmp"


def taken(root: Path, version: int) -> bool:
    """The number is used: published (its folder), or reserved by a publish that has not
    finished persisting or never will (a crash)."""
    return folder(root, version).exists() or _reservation(root, version).exists()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reserve(root: Path, version: int) -> Path:
    """Take number `version` on disk before anything serves it (durable: the parent is synced)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = _reservation(root, version)
    tmp.mkdir()
    _fsync_dir(root)
    return tmp


def write(root: Path, version: int, weights: Mapping[str, torch.Tensor], config_json: str) -> Path:
    """Persist a reserved version: weights and config into its temporary folder, synced, then
    renamed to `vK` (a reader sees a whole folder or none)."""
    from safetensors.torch import save_file

    tmp, final = _reservation(root, version), folder(root, version)
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    save_file(cpu, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(config_json)
    for name in (WEIGHTS, CONFIG):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    tmp.rename(final)
    _fsync_dir(root)
    return final


def read(path: Path, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / WEIGHTS), device=device)


def config_json(peft_model: Any, adapter: str) -> str:
    """The adapter_config.json PEFT's `save_pretrained` writes for `adapter`."""
    config = copy.deepcopy(peft_model.peft_config[adapter])
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = (
            peft_model.base_model.model.__dict__.get("name_or_path") or None
        )
    config.inference_mode = True
    out = config.to_dict()
    out = {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}
    if config.task_type is None:
        cls = peft_model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        out["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return json.dumps(out, indent=2, sort_keys=True)


class Slots:
    """Serving adapters in reusable PEFT adapter slots (`serve0`, `serve1`, ...).

    `fill(weights)` copies weights (keyed like PEFT's adapter state dict, adapter name removed)
    into a spare slot, creating one only when none is spare; `free(name)` keeps up to SPARE slots
    for the next publish and deletes the rest. Creating and deleting PEFT adapters re-points
    layers and flips `requires_grad`; both are put back: the trainable adapter stays the only
    one with gradients, and the caller must re-point its layers (`changed` says when)."""

    def __init__(
        self, model: Any, trainable: str, layers: list[Any], trainable_active: list[Any], *, upcast: bool = False
    ) -> None:
        self.model, self.trainable = model, trainable
        # upcast: slots in fp32 whatever the base layers' dtype (a CPU's bf16 matmuls in an fp32
        # model); otherwise in the model's dtype, so that a bf16 GPU model casts nothing per token
        self.upcast = upcast
        self.layers, self.trainable_active = layers, trainable_active
        self.spare: list[str] = []
        self.params: dict[str, dict[str, torch.nn.Parameter]] = {}
        self._count = 0
        self.changed = False  # PEFT adapters were created or deleted since the caller last looked

    def trainable_params(self) -> dict[str, torch.nn.Parameter]:
        return self._params_of(self.trainable)

    def _params_of(self, name: str) -> dict[str, torch.nn.Parameter]:
        marker = re.compile(rf"\.{re.escape(name)}(?=\.|$)")
        return {
            marker.sub("", n): p
            for n, p in self.model.named_parameters()
            if marker.search(n) and "lora_" in n
        }

    @contextmanager
    def _structural(self) -> Iterator[None]:
        for layer, active in zip(self.layers, self.trainable_active, strict=True):
            layer._active_adapter = active
        try:
            yield
        finally:
            for p in self.trainable_params().values():
                p.requires_grad_(True)
            for params in self.params.values():
                for p in params.values():
                    p.requires_grad_(False)
            self.changed = True

    def _create(self) -> str:
        name = f"serve{self._count}"
        self._count += 1
        config = copy.deepcopy(self.model.peft_config[self.trainable])
        config.inference_mode = True
        with (
            self._structural(),
            torch.random.fork_rng(devices=[]),
        ):  # LoRA init must not draw from global RNG
            self.model.add_adapter(name, config, autocast_adapter_dtype=self.upcast)
            self.params[name] = self._params_of(name)
        return name

    def ensure_spare(self) -> None:
        if not self.spare:
            self.spare.append(self._create())

    def fill(self, weights: Mapping[str, torch.Tensor]) -> str:
        name = self.spare.pop() if self.spare else self._create()
        params = self.params[name]
        if weights.keys() != params.keys():
            self.spare.append(name)
            missing, extra = (
                sorted(params.keys() - weights.keys()),
                sorted(weights.keys() - params.keys()),
            )
            raise ValueError(
                f"adapter weights do not fit the model's LoRA layers: missing {missing[:3]}, "
                f"unexpected {extra[:3]}"
            )
        with torch.no_grad():
            for key, p in params.items():
                p.copy_(weights[key])
        return name

    def free(self, name: str) -> None:
        if len(self.spare) < SPARE:
            self.spare.append(name)
            return
        with self._structural():
            self.model.delete_adapter(name)
            del self.params[name]
