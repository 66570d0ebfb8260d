"""The prefix cache: the KV of recent prompts, so a prompt that shares a prefix with one of them
prefills only the rest (`PrefixCache`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from clawbridge.local_gpu.kvcache import layers_of
from transformers import DynamicCache

Owner = int | str  # a served version, or a registered adapter's row name


@dataclass(eq=False)
class _Prefix:
    version: Owner
    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, kv_heads, len(tokens), dim]
    nbytes: int


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """The KV of recent prompts, so a prompt that shares a prefix with one of them prefills only
    the rest. Least recently used first out, bounded by `budget` bytes (0: off).

    An entry belongs to one served version (or one registered adapter, keyed by its row name):
    its keys were computed through that adapter, so only requests on the same one reuse it, and
    the engine drops a version's entries once the version is no longer served (`keep_versions`),
    an adapter's when its weights are replaced or removed (`drop_owner`). Entries hold the prefill's own
    tensors, never written in place afterwards (a dynamic cache grows by concatenation; the slotted
    cache copies them), so storing costs no copy."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._entries: OrderedDict[int, _Prefix] = OrderedDict()  # id -> entry, oldest first
        self._next = 0
        self.hits = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def versions(self) -> list[Owner]:
        """The version of each entry, least recently used first."""
        return [entry.version for entry in self._entries.values()]

    def lookup(self, version: Owner, prompt: tuple[int, ...]) -> DynamicCache | None:
        """A cache holding the longest cached prefix of `prompt` on `version`, at most all but
        the prompt's last token (whose logits the prefill must produce); None when nothing is
        shared."""
        best, best_len = None, 0
        for key, entry in self._entries.items():
            if entry.version == version:
                n = min(_common(entry.tokens, prompt), len(prompt) - 1)
                if n > best_len:
                    best, best_len = key, n
        if best is None:
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.tokens_reused += best_len
        layers = self._entries[best].layers
        return DynamicCache(
            ddp_cache_data=[(k[:, :, :best_len], v[:, :, :best_len]) for k, v in layers]
        )

    def store(self, version: Owner, prompt: tuple[int, ...], cache: DynamicCache) -> None:
        """Keep `prompt`'s KV (the cache holds exactly its positions). Entries it extends are
        dropped (it serves every request they would), then the oldest until it fits."""
        if not self.budget:
            return
        layers = layers_of(cache)
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.budget:
            return
        for key, entry in list(self._entries.items()):
            if entry.version == version and prompt[: len(entry.tokens)] == entry.tokens:
                self._drop(key)
        while self.used + nbytes > self.budget:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = _Prefix(version, prompt, layers, nbytes)
        self._next += 1
        self.used += nbytes

    def keep_versions(self, versions: set[int]) -> None:
        """Drop the entries of every version not in `versions` (registered adapters' stay)."""
        for key, entry in list(self._entries.items()):
            if isinstance(entry.version, int) and entry.version not in versions:
                self._drop(key)

    def drop_owner(self, owner: Owner) -> None:
        """Drop every entry of `owner`."""
        for key, entry in list(self._entries.items()):
            if entry.version == owner:
                self._drop(key)

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0

    def _drop(self, key: int) -> None:
        self.used -= self._entries.pop(key).nbytes
