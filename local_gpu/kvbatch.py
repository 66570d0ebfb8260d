"""The running decode batch: one left-padded KV cache shared by every active sequence (the
engine's batch unless `static_cache` is on: then `slotbatch.SlotBatch`).

New sequences are prefilled together (`prefill.Prefill`: one forward for the prompts admitted at
once, each continuing its cached prefix, laid out right-aligned with left padding the mask hides),
then merged: the shorter side is padded on the left with zeros that the attention mask hides.
Rotary positions are applied before keys are cached, so padding never shifts a sequence's
positions; each row carries its own position ids. Finished rows are dropped between steps and
columns that have become padding in every row are trimmed, so the cache stays as long as the
longest live sequence.

One forward per step serves every row (one matmul per layer), which is where batching pays;
docs/engine.md has the measured figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from clawbridge.local_gpu.kvcache import CACHE, full_layers, layers_of, pad_left
from transformers import DynamicCache


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

    def add_rows(
        self, cache: DynamicCache, mask: torch.Tensor, lengths: list[int], next_tokens: list[int]
    ) -> None:
        """Append prefilled sequences: `cache` [b, H, L, D] left-padded as `mask` [b, L] says
        (1 = real), row i holding `lengths[i]` real positions."""
        padded = not bool(mask.all())
        if self.cache is None or self.mask is None:
            self.cache, self.mask, self.padded = cache, mask, padded
        else:
            length = max(self.length, int(mask.shape[1]))
            old_pad, new_pad = length - self.length, length - int(mask.shape[1])
            self.padded = self.padded or padded or old_pad > 0 or new_pad > 0
            merged = [
                (
                    torch.cat([pad_left(k0, old_pad), pad_left(k1, new_pad)]),
                    torch.cat([pad_left(v0, old_pad), pad_left(v1, new_pad)]),
                )
                for (k0, v0), (k1, v1) in zip(layers_of(self.cache), layers_of(cache), strict=True)
            ]
            self.cache = DynamicCache(ddp_cache_data=merged)
            self.mask = torch.cat(
                [
                    torch.nn.functional.pad(self.mask, (old_pad, 0)),
                    torch.nn.functional.pad(mask, (new_pad, 0)),
                ]
            )
        self.positions.extend(lengths)
        self.next_tokens.extend(next_tokens)

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
            CACHE: self.cache,
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
        for layer in full_layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self.positions = [self.positions[i] for i in rows]
        self.next_tokens = [self.next_tokens[i] for i in rows]

