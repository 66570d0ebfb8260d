"""The engine's versions: which adapter row serves each published version, the serving
slots (`adapters.Slots`) and their reference counts, publishing (served from memory at once,
persisted by a writer thread) and rollback. Runs on the scheduler thread."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from clawbridge.local_gpu import adapters
from clawbridge.local_gpu.adapters import BASE, STALE
from clawbridge.local_gpu.decoding import _Job, _Seq
from clawbridge.local_gpu.kvbatch import KVBatch
from clawbridge.local_gpu.prefixcache import PrefixCache
from clawbridge.local_gpu.slotbatch import SlotBatch
from clawbridge.protocol import BackendError, UnknownVersion, require_published
from clawbridge.types import (
    PolicyVersion,
)

log = logging.getLogger(__name__)


def scaled_delta(weights: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """LoRA weights whose delta is `alpha` times `weights`' (pure): the delta is B @ A (times
    the adapter's constant scale), so scaling every B by `alpha` scales it exactly, and alpha
    between 0 and 1 interpolates between the base model (0) and `weights` (1)."""
    return {k: v * alpha if ".lora_B." in k else v for k, v in weights.items()}  # loading copies them


class VersionSlots:
    """Version routing and publishing, mixed into `engine.Engine` (whose `__init__` sets the
    state below)."""

    data_dir: Path
    device: str
    _adapter_config: str
    _newest: int
    _pointed: str | None
    _batch: KVBatch | SlotBatch
    _inbox: queue.Queue[_Seq | _Job | None]
    _jobs: deque[_Job]
    _initial: dict[str, torch.Tensor]
    _pending: dict[int, dict[str, torch.Tensor]]
    _folders: dict[int, Path]
    _prefixes: PrefixCache
    _refs: dict[int, int]
    _served: dict[int, str]
    _slots: adapters.Slots | None
    _writer: concurrent.futures.ThreadPoolExecutor
    _set_trainable: Callable[[dict[str, torch.Tensor]], None]
    _forget_merged: Callable[[str], None]

    def _row(self, version: int) -> str:
        """The adapter name a row on `version` runs with (acquired: its slot is in memory)."""
        return BASE if version == 0 else self._served[version]

    def _acquire(self, requested: int | None) -> int:
        version = self._newest if requested is None else requested
        if version < 0 or version > self._newest:
            raise BackendError(f"unknown policy version {version}; the newest is {self._newest}")
        if version and version not in self._served:
            self._serve(version, self._weights_of(version, BackendError))
        self._refs[version] = self._refs.get(version, 0) + 1
        return version

    def _weights_of(
        self, version: int, error: Callable[[str], Exception]
    ) -> dict[str, torch.Tensor]:
        """A published version's weights: still in memory while being persisted, else its folder."""
        if version in self._pending:
            return self._pending[version]
        path = self._folders.get(version) or self._adapter_dir(version)
        if not (path / adapters.WEIGHTS).exists():
            raise error(
                f"policy@v{version} is no longer available ({path / adapters.WEIGHTS} is missing)"
            )
        return adapters.read(path, str(self.device))

    def _serve(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Put `version`'s weights in a slot, in the model's dtype. PEFT would upcast a loaded
        adapter to fp32 (its default for training), and then every LoRA layer casts its input up
        and its output back on every token: on a bf16 GPU model that was ~500 extra kernels per
        token. Sampling and `score` of a version both run this copy, so their logprobs agree."""
        assert self._slots is not None
        self._served[version] = self._slots.fill(weights)
        self._restale()

    def _ensure_spare(self) -> None:
        assert self._slots is not None
        self._slots.ensure_spare()
        self._restale()

    def _restale(self) -> None:
        assert self._slots is not None
        if self._slots.changed:  # PEFT re-points layers when adapters come and go
            self._pointed = STALE
            self._slots.changed = False
            if isinstance(self._batch, SlotBatch):
                self._batch.invalidate()  # captured steps read the layers that were replaced

    def _release(self, version: int) -> None:
        self._refs[version] -= 1
        self._collect()

    def _collect(self) -> None:
        """Free the slots of versions nobody uses any more (the newest always stays)."""
        assert self._slots is not None
        for version in sorted(self._served):
            if version != self._newest and self._refs.get(version, 0) <= 0:
                name = self._served.pop(version)
                self._forget_merged(name)  # the slot may be refilled with another version's weights
                self._slots.free(name)
                self._refs.pop(version, None)
        self._restale()
        # cached prompts are keys computed through a version's weights: only its requests reuse
        # them, so a version nobody is served on any more takes its entries along
        live = {self._newest, *self._served, *(v for v, n in self._refs.items() if n > 0)}
        self._prefixes.keep_versions(live)

    def _adapter_dir(self, version: int) -> Path:
        return adapters.folder(self.data_dir / "adapters", version)

    def _publish(self) -> tuple[PolicyVersion, concurrent.futures.Future[None]]:
        """Serve the trainable weights as the next version now; persist them in the background.

        The number is reserved on disk first, so it is never reused: published weights are never
        written over, and a version that served but was never persisted (a crash before the
        rename) keeps its number too. The caller records the version only once the returned
        future says its weights are on disk (`LocalBackend.publish`)."""
        root = self.data_dir / "adapters"
        version = self._newest + 1
        while adapters.taken(root, version):
            version += 1
        adapters.reserve(root, version)
        with torch.no_grad():
            weights = {k: p.detach().clone() for k, p in self._train_params().items()}
        self._serve(version, weights)
        self._pending[version] = weights
        previous, self._newest = self._newest, version
        self._collect()
        # the next publish must find a slot ready: make one after this iteration's admissions
        # and decode step (the new version's first tokens), if freeing none left one spare
        self._jobs.append(_Job(self._ensure_spare, (), concurrent.futures.Future()))
        written = self._writer.submit(adapters.write, root, version, weights, self._adapter_config)
        persisted: concurrent.futures.Future[None] = concurrent.futures.Future()
        written.add_done_callback(
            lambda f: self._inbox.put(_Job(self._persisted, (version, previous, f), persisted))
        )
        log.info("policy@v%d serves; persisting it to %s", version, self._adapter_dir(version))
        return PolicyVersion(version, str(self._adapter_dir(version))), persisted

    def _persisted(
        self, version: int, previous: int, written: concurrent.futures.Future[Path]
    ) -> None:
        """On the scheduler thread once `version`'s write ended; its error is the publish's."""
        self._pending.pop(version, None)
        error = written.exception()
        if error is None:
            return
        # Nothing may rely on weights that are not on disk: new requests go back to the previous
        # version; the number stays taken (its reservation), rows already on it finish on it.
        log.error(
            "persisting policy@v%d failed (%s); serving policy@v%d again", version, error, previous
        )
        if self._newest == version:
            self._newest = previous
            self._collect()
        raise error

    def _train_params(self) -> dict[str, torch.nn.Parameter]:
        assert self._slots is not None
        return self._slots.trainable_params()

    def _published_weights(self, version: int) -> dict[str, torch.Tensor]:
        """A published version's weights (v0: the initial adapter); UnknownVersion when it was
        never published or its weights are gone."""
        require_published(version, self._newest)
        if version == 0:
            return self._initial
        return self._weights_of(version, lambda why: UnknownVersion(version, self._newest, why))

    def _rollback(self, version: int) -> tuple[PolicyVersion, concurrent.futures.Future[None]]:
        self._set_trainable(self._published_weights(version))  # Adam's moments belonged to the weights rolled away from
        published, persisted = self._publish()
        log.info("policy@v%d is a rollback to policy@v%d", published.version, version)
        return published, persisted

    def _blend(self, version: int, alpha: float) -> tuple[PolicyVersion, concurrent.futures.Future[None]]:
        """`version`'s weights with their delta scaled by `alpha` (`scaled_delta`), trainable
        with a fresh optimizer and published as the next version."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"a blend's alpha must be in (0, 1], got {alpha}")
        self._set_trainable(scaled_delta(self._published_weights(version), alpha))  # a fresh optimizer, as for a rollback
        published, persisted = self._publish()
        log.info("policy@v%d is policy@v%d's delta x %g", published.version, version, alpha)
        return published, persisted
