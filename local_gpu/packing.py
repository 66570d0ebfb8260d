"""Sequence packing for the trainer's forward: the samples of a micro-batch laid end to end in one
row, with no padding.

Positions restart at 0 for each sample and no attention mask is passed, so transformers builds a
block-diagonal causal mask from the position ids (its packed-sequence format): a token attends
only to earlier tokens of its own sample, exactly as in a forward of that sample alone. Only the
logits of completion positions are computed (`keep`), which is where the loss lives.

Padding a batch of mixed lengths to its longest sample wastes `rows × longest − Σ lengths` tokens
of compute in every linear layer; packing wastes none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clawbridge.types import Datum


@dataclass(frozen=True)
class Packed:
    """One packed row: token ids, their positions, and the row positions whose logits predict
    the completion tokens (in the order of the samples and their tokens)."""

    ids: list[int]
    positions: list[int]
    keep: list[int]
    targets: list[int]


def pack(group: Sequence[Datum]) -> Packed:
    ids: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    targets: list[int] = []
    for d in group:
        if not d.prompt_ids:
            raise ValueError("a sample needs at least one prompt token")
        start = len(ids)
        seq = (*d.prompt_ids, *d.completion_ids)
        ids.extend(seq)
        positions.extend(range(len(seq)))
        first = start + len(d.prompt_ids) - 1  # the logits at position t predict token t + 1
        keep.extend(range(first, first + len(d.completion_ids)))
        targets.extend(d.completion_ids)
    return Packed(ids, positions, keep, targets)


def packed_micro_batches(batch: Sequence[Datum], token_budget: int) -> list[list[Datum]]:
    """Consecutive groups of the batch of at most `token_budget` tokens each (a longer single
    sample forms its own group), so one packed row bounds activation memory as the padded
    micro-batches did, without counting padding."""
    groups: list[list[Datum]] = []
    current: list[Datum] = []
    size = 0
    for d in batch:
        n = len(d.prompt_ids) + len(d.completion_ids)
        if current and size + n > token_budget:
            groups.append(current)
            current, size = [], 0
        current.append(d)
        size += n
    if current:
        groups.append(current)
    return groups
