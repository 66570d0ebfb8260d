"""Sequence packing for the trainer's forward: the samples of a micro-batch laid end to end in one
row, with no padding.

Positions restart at 0 for each sample and no attention mask is passed, so transformers builds a
block-diagonal causal mask from the position ids (its packed-sequence format): a token attends
only to earlier tokens of its own sample, exactly as in a forward of that sample alone. Only the
logits of completion positions are computed (`keep`), which is where the loss lives.

Padding a batch of mixed lengths to its longest sample wastes `rows × longest − Σ lengths` tokens
of compute in every linear layer; packing wastes none. Rows are kept short (`packed_micro_batches`)
because attention costs each token as many keys as its row holds.
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


# Rows are filled up to the longest sample (at least MIN_ROW tokens): attention costs each token
# as many keys as its row holds, so a row no longer than the longest sample costs no more attention
# than the padded batch did, while short samples share rows instead of being padded.
MIN_ROW = 256


def packed_micro_batches(batch: Sequence[Datum], token_budget: int) -> list[list[Datum]]:
    """The samples grouped into rows, first fit by decreasing length, each row at most
    max(longest sample, MIN_ROW) tokens and at most `token_budget` (a longer sample forms its own
    row). Each row is one packed forward; the loss is a token mean over the whole batch, so the
    order does not matter."""

    def size(d: Datum) -> int:
        return len(d.prompt_ids) + len(d.completion_ids)

    if not batch:
        return []
    capacity = min(token_budget, max(MIN_ROW, max(size(d) for d in batch)))
    rows: list[list[Datum]] = []
    room: list[int] = []
    for d in sorted(batch, key=size, reverse=True):
        n = size(d)
        for i, free in enumerate(room):
            if n <= free:
                rows[i].append(d)
                room[i] -= n
                break
        else:
            rows.append([d])
            room.append(capacity - n)
    return rows


@dataclass(frozen=True)
class Stacked:
    """Packed rows stacked into one [R, W] forward (the FSDP trainer's micro-batch): each row
    padded at its end by a segment of its own (positions restart at 0, so it attends only to
    itself and nothing attends to it); `keep` indexes the flattened [R × W] positions."""

    ids: list[list[int]]
    positions: list[list[int]]
    keep: list[int]
    targets: list[int]


def stack(rows: Sequence[Sequence[Datum]], pad_id: int = 0) -> Stacked:
    packed = [pack(row) for row in rows]
    width = max(len(p.ids) for p in packed)
    ids: list[list[int]] = []
    positions: list[list[int]] = []
    keep: list[int] = []
    targets: list[int] = []
    for r, p in enumerate(packed):
        pad = width - len(p.ids)
        ids.append(p.ids + [pad_id] * pad)
        positions.append(p.positions + list(range(pad)))
        keep.extend(r * width + k for k in p.keep)
        targets.extend(p.targets)
    return Stacked(ids, positions, keep, targets)


def stacked_micro_batches(batch: Sequence[Datum], token_budget: int) -> list[list[list[Datum]]]:
    """`packed_micro_batches`' rows, consecutive rows stacked while rows × longest row stays within
    `token_budget` (at least one row each): on a GPU one [R, W] forward of short rows keeps the
    matmuls large and gathers the sharded weights once instead of R times."""

    def size(row: list[Datum]) -> int:
        return sum(len(d.prompt_ids) + len(d.completion_ids) for d in row)

    out: list[list[list[Datum]]] = []
    for row in packed_micro_batches(batch, token_budget):
        if out and (len(out[-1]) + 1) * max(size(row), *(size(r) for r in out[-1])) <= token_budget:
            out[-1].append(row)
        else:
            out.append([row])
    return out
