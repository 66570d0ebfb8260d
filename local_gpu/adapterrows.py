"""What each decode row runs on, on the scheduler thread: a version of the engine's own lineage
(a PEFT serving slot, `versions`) or a registered adapter (a slot of the stack,
`registry.AdapterRegistry`); and the registry's jobs (register, evict, remove)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from clawbridge.local_gpu.decoding import _Seq
from clawbridge.local_gpu.multilora import NONE, AdapterStack
from clawbridge.local_gpu.prefixcache import PrefixCache
from clawbridge.local_gpu.registry import AdapterRegistry, is_row, key_of, row_name


class AdapterRows:
    """Leasing a row's adapter and the registry's jobs, mixed into `engine.Engine` (whose
    `__init__` and `start` set the state below)."""

    _prefixes: PrefixCache
    _registry: AdapterRegistry | None
    _stack: AdapterStack | None
    _acquire: Callable[[int | None], int]
    _release: Callable[[int], None]
    _row: Callable[[int], str]

    def _lease(self, seq: _Seq) -> None:
        """Take what `seq` runs on (its version, or its registered adapter, read back into a
        slot if it was evicted) until `_unlease`."""
        if seq.adapter is None:
            seq.version = self._acquire(seq.requested_version)
            seq.row = self._row(seq.version)
            return
        seq.version = self._adapters().acquire(seq.adapter).version
        seq.row = row_name(seq.adapter)

    def _unlease(self, seq: _Seq) -> None:
        if seq.adapter is None:
            self._release(seq.version)
        else:
            self._adapters().release(seq.adapter)

    def _slots_of(self, names: list[str]) -> list[int] | None:
        """Each row's slot in the stack (NONE: not a registered adapter); None when no row is on one."""
        if self._registry is None or not any(is_row(n) for n in names):
            return None
        return [self._registry.slot_of(key_of(n)) if is_row(n) else NONE for n in names]

    def _adapters(self) -> AdapterRegistry:
        if self._registry is None:
            raise RuntimeError("the engine is not started")
        return self._registry

    def _register_adapter(
        self, key: str, source: Mapping[str, torch.Tensor] | Path, version: int, alpha: float | None
    ) -> None:
        self._adapters().register(key, source, version=version, alpha=alpha)
        self._prefixes.drop_owner(row_name(key))  # keys computed through the weights it replaced

    def _evict_adapter(self, key: str) -> bool:
        return self._adapters().evict(key)

    def _remove_adapter(self, key: str) -> None:
        self._adapters().remove(key)
        self._prefixes.drop_owner(row_name(key))
