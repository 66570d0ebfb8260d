"""Registered adapters under a memory budget: loaded on demand into the stack's slots
(`multilora.AdapterStack`), the least recently used evicted when a slot is needed, and read back
from disk on their next request (`AdapterRegistry`). Runs on the engine's scheduler thread.

Every registered adapter has a file it comes back from: one registered from weights is written
once, at registration, to the engine's cache dir (`<data_dir>/adapter-cache/`, safetensors),
one registered from a path is read where it is. Eviction therefore never writes: it only frees
the slot. An adapter a running row uses is never evicted (`refs`)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from clawbridge.local_gpu import adapters
from clawbridge.local_gpu.multilora import AdapterStack
from clawbridge.protocol import BackendError

log = logging.getLogger(__name__)

ROW = "\0adapter:"  # a decode row's name for a registered adapter: no PEFT adapter is named so


class UnknownAdapter(BackendError):
    """A request named an adapter that is not registered."""


class AdapterInUse(BackendError):
    """The adapter serves a running request: it cannot be evicted, removed or replaced now."""


class AdapterMemoryFull(BackendError):
    """Every slot holds an adapter a running request uses: the request waits for a row to end."""


def row_name(key: str) -> str:
    return ROW + key


def is_row(name: str) -> bool:
    return name.startswith(ROW)


def key_of(name: str) -> str:
    return name.removeprefix(ROW)


@dataclass
class Entry:
    key: str
    file: Path  # the safetensors it is read back from
    scale: float
    version: int  # what its requests' chunks report
    slot: int | None = None  # resident in this slot of the stack (None: on disk only)
    refs: int = 0  # running requests on it
    used: float = 0.0  # when a request last took it (least recently used goes first)


@dataclass(frozen=True)
class RegistryStats:
    registered: int
    resident: int
    in_use: int
    slots: int  # how many adapters the budget holds
    slot_bytes: int
    resident_bytes: int
    budget_bytes: int
    loads: int  # adapters read back from disk
    evictions: int
    load_ms_last: float  # the last read back's duration
    resident_keys: tuple[str, ...]  # least recently used first


def victims(entries: Sequence[Entry], free: int, need: int) -> list[str]:
    """The keys to evict so that `need` slots are free with `free` free now: resident entries no
    running request uses, least recently used first. Fewer than needed when the rest are in use."""
    idle = sorted((e for e in entries if e.slot is not None and e.refs == 0), key=lambda e: e.used)
    return [e.key for e in idle[: max(0, need - free)]]


def cache_file(root: Path, key: str) -> Path:
    """A file name for `key` that any key maps to safely and no two keys share."""
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:48]
    return root / f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def peft_scale(config: Mapping[str, object], rank: int) -> float:
    """The scale PEFT gives an adapter of `config` (adapter_config.json) and `rank`."""
    alpha = float(config.get("lora_alpha", rank))  # type: ignore[arg-type]
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def adapter_rank(weights: Mapping[str, torch.Tensor]) -> int:
    return max((int(w.shape[0]) for k, w in weights.items() if ".lora_A." in k), default=0)


class AdapterRegistry:
    """Adapters by key, resident in `stack`'s slots within the budget (the stack's size) or on disk."""

    def __init__(self, stack: AdapterStack, cache_dir: Path, *, default_alpha: float, budget_bytes: int) -> None:
        self.stack, self.cache_dir = stack, cache_dir
        self.default_alpha, self.budget_bytes = default_alpha, budget_bytes
        self.entries: dict[str, Entry] = {}
        self.free: list[int] = list(range(stack.slots - 1, -1, -1))
        self.loads = self.evictions = 0
        self.load_ms_last = 0.0

    def register(
        self, key: str, source: Mapping[str, torch.Tensor] | Path, *, version: int = 0, alpha: float | None = None
    ) -> Entry:
        """Register `key` from weights (PEFT's state-dict keys, adapter name removed) or a path (a
        PEFT adapter folder, or a safetensors file). Weights are written to the cache dir and
        stay resident if a slot is free; a path is read on the key's first request. Registering
        a key again replaces its weights (refused while a request runs on it)."""
        if not self.stack.slots:
            raise BackendError(
                f"adapter_memory_mb holds no adapter ({self.stack.slot_bytes / 2**20:.1f} MB each): raise it"
            )
        old = self.entries.get(key)
        if old is not None and old.refs:
            raise AdapterInUse(f"adapter {key!r} serves {old.refs} running request(s): register it again once they end")
        if isinstance(source, Path):
            file, scale = self._from_path(source, alpha)
            weights = None
        else:
            weights = dict(source)
            self.stack.check(weights)
            scale = (self.default_alpha if alpha is None else alpha) / max(adapter_rank(weights), 1)
            file = cache_file(self.cache_dir, key)
        if old is not None:
            self._drop(old)  # before the new weights take its file
            del self.entries[key]
        if weights is not None:
            self._write(file, weights, scale)
        entry = Entry(key, file, scale, version)
        self.entries[key] = entry
        if weights is not None and self.free:
            entry.slot = self.free.pop()
            self.stack.fill(entry.slot, weights, scale)
            entry.used = time.monotonic()
        return entry

    def acquire(self, key: str) -> Entry:
        """Take `key` for a running request: read back into a slot if it is on disk (evicting the
        least recently used idle adapter when no slot is free)."""
        entry = self.entries.get(key)
        if entry is None:
            raise UnknownAdapter(f"no adapter is registered as {key!r}")
        if entry.slot is None:
            for name in victims(list(self.entries.values()), len(self.free), 1):
                self.evict(name)
            if not self.free:
                raise AdapterMemoryFull(
                    f"all {self.stack.slots} adapter slots serve running requests; {key!r} waits for one"
                )
            self._load(entry, self.free.pop())
        entry.refs += 1
        entry.used = time.monotonic()
        return entry

    def release(self, key: str) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.refs -= 1

    def evict(self, key: str) -> bool:
        """Free `key`'s slot (its file stays: it comes back on its next request). False when it
        was not resident; AdapterInUse while a running request uses it."""
        entry = self.entries.get(key)
        if entry is None:
            raise UnknownAdapter(f"no adapter is registered as {key!r}")
        if entry.refs:
            raise AdapterInUse(f"adapter {key!r} serves {entry.refs} running request(s)")
        if entry.slot is None:
            return False
        self.free.append(entry.slot)
        entry.slot = None
        self.evictions += 1
        return True

    def remove(self, key: str) -> None:
        """Forget `key` (and its cached file, if the registry wrote it)."""
        entry = self.entries.get(key)
        if entry is None:
            raise UnknownAdapter(f"no adapter is registered as {key!r}")
        if entry.refs:
            raise AdapterInUse(f"adapter {key!r} serves {entry.refs} running request(s)")
        self._drop(entry)
        del self.entries[key]

    def slot_of(self, key: str) -> int:
        slot = self.entries[key].slot
        assert slot is not None, f"adapter {key!r} is not resident"
        return slot

    def stats(self) -> RegistryStats:
        entries = list(self.entries.values())
        resident = sum(e.slot is not None for e in entries)
        return RegistryStats(
            registered=len(entries),
            resident=resident,
            in_use=sum(e.refs > 0 for e in entries),
            slots=self.stack.slots,
            slot_bytes=self.stack.slot_bytes,
            resident_bytes=resident * self.stack.slot_bytes,
            budget_bytes=self.budget_bytes,
            loads=self.loads,
            evictions=self.evictions,
            load_ms_last=self.load_ms_last,
            resident_keys=tuple(e.key for e in sorted(entries, key=lambda e: e.used) if e.slot is not None),
        )

    # --- disk --------------------------------------------------------------------------------

    def _load(self, entry: Entry, slot: int) -> None:
        from safetensors.torch import load_file

        start = time.perf_counter()
        try:
            weights = load_file(str(entry.file), device=str(self.stack.device))
            self.stack.fill(slot, weights, entry.scale)
        except BaseException:
            self.free.append(slot)
            raise
        entry.slot = slot
        self.loads += 1
        self.load_ms_last = (time.perf_counter() - start) * 1e3
        log.debug("adapter %r read back into slot %d in %.1f ms", entry.key, slot, self.load_ms_last)

    def _write(self, file: Path, weights: Mapping[str, torch.Tensor], scale: float) -> None:
        from safetensors.torch import save_file

        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        cpu = {k: v.detach().to("cpu", self.stack.dtype).contiguous() for k, v in weights.items()}
        save_file(cpu, str(tmp), metadata={"format": "pt", "scale": repr(scale)})
        tmp.replace(file)

    def _from_path(self, path: Path, alpha: float | None) -> tuple[Path, float]:
        """The safetensors file and scale of an adapter at `path` (its header read, not its weights)."""
        from safetensors import safe_open

        file = path / adapters.WEIGHTS if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no adapter weights at {file}")
        with safe_open(str(file), "pt") as f:
            names = list(f.keys())
            unknown = sorted(set(names) - self.stack.keys())
            if unknown:
                raise ValueError(f"{file}: weights that fit no LoRA layer of the model: {unknown[:3]}")
            rank = max((f.get_slice(k).get_shape()[0] for k in names if ".lora_A." in k), default=0)
        if rank > self.stack.rank:
            raise ValueError(f"{file}: rank {rank} is above the engine's slots' rank {self.stack.rank}")
        config_file = file.parent / adapters.CONFIG
        if alpha is not None:
            return file, alpha / max(rank, 1)
        if config_file.exists():
            return file, peft_scale(json.loads(config_file.read_text()), max(rank, 1))
        return file, self.default_alpha / max(rank, 1)

    def _drop(self, entry: Entry) -> None:
        if entry.slot is not None:
            self.free.append(entry.slot)
            entry.slot = None
        if entry.file.parent == self.cache_dir:
            entry.file.unlink(missing_ok=True)
