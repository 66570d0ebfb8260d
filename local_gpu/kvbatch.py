"""The running decode batch: one left-padded KV cache shared by every active sequence.

A new sequence is prefilled alone (no padding, so its prompt attends exactly), then merged: the
shorter side is padded on the left with zeros that the attention mask hides. Rotary positions are
applied before keys are cached, so padding never shifts a sequence's positions; each row carries
its own position ids. Finished rows are dropped between steps and columns that have become padding
in every row are trimmed, so the cache stays as long as the longest live sequence.

One forward per step serves every row (one matmul per layer), which is where batching pays;
docs/engine.md has the measured figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache


def _full_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers; every one must hold plain growing key/value tensors."""
    return list(cache.layers)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in _full_layers(cache)]


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t


@dataclass
class KVBatch:
    """Row i of every tensor belongs to the i-th sequence the engine tracks."""

    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # [B, L] 1 = real token, 0 = left padding
    positions: list[int] = field(default_factory=list)  # position of each row's next input
    next_tokens: list[int] = field(default_factory=list)  # each row's next input token
    padded: bool = False  # some row has left padding: the model needs the mask

    @property
    def size(self) -> int:
        return len(self.positions)

    @property
    def length(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def add(self, cache: DynamicCache, prompt_len: int, next_token: int) -> None:
        """Append one prefilled sequence (its cache holds exactly `prompt_len` positions)."""
        device = _layers(cache)[0][0].device
        row_mask = torch.ones(1, prompt_len, dtype=torch.long, device=device)
        if self.cache is None or self.mask is None:
            self.cache, self.mask, self.padded = cache, row_mask, False
        else:
            length = max(self.length, prompt_len)
            old_pad, new_pad = length - self.length, length - prompt_len
            self.padded = self.padded or old_pad > 0 or new_pad > 0
            merged = [
                (
                    torch.cat([_pad_left(k0, old_pad), _pad_left(k1, new_pad)]),
                    torch.cat([_pad_left(v0, old_pad), _pad_left(v1, new_pad)]),
                )
                for (k0, v0), (k1, v1) in zip(_layers(self.cache), _layers(cache), strict=True)
            ]
            self.cache = DynamicCache(ddp_cache_data=merged)
            self.mask = torch.cat(
                [
                    torch.nn.functional.pad(self.mask, (old_pad, 0)),
                    torch.nn.functional.pad(row_mask, (new_pad, 0)),
                ]
            )
        self.positions.append(prompt_len)
        self.next_tokens.append(next_token)

    def step_inputs(self) -> dict[str, torch.Tensor | DynamicCache]:
        """Model inputs for one decode step of every row (the cache grows by one column). The
        mask goes to the model only while some row is padded: without padding every cached
        position is attended anyway, and building the 4-D mask each step costs the model's
        Python mask machinery on every token."""
        assert self.mask is not None and self.cache is not None
        device = self.mask.device
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], dim=1)
        inputs: dict[str, torch.Tensor | DynamicCache] = {
            "input_ids": torch.tensor(self.next_tokens, device=device).view(-1, 1),
            "position_ids": torch.tensor(self.positions, device=device).view(-1, 1),
            "past_key_values": self.cache,
        }
        if self.padded:
            inputs["attention_mask"] = self.mask
        return inputs

    def advance(self, tokens: list[int]) -> None:
        self.next_tokens = tokens
        self.positions = [p + 1 for p in self.positions]

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (in order), then trim all-padding columns."""
        if len(rows) == self.size:
            return
        if not rows:
            self.cache, self.mask, self.positions, self.next_tokens = None, None, [], []
            self.padded = False
            return
        assert self.mask is not None and self.cache is not None
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).to(torch.int8).argmax())  # first column some row still uses
        self.mask = mask[:, first:]
        self.padded = not bool(self.mask.all())
        for layer in _full_layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self.positions = [self.positions[i] for i in rows]
        self.next_tokens = [self.next_tokens[i] for i in rows]
