"""The engine's decode half, on the scheduler thread: admitting waiting sequences (their
prefill together, with the prefix cache), one decode step of every running row, and drawing each
row's next token exactly as `sampling` says (the recorded logprobs are the policy's)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from clawbridge.local_gpu.kvbatch import KVBatch
from clawbridge.local_gpu.kvcache import cache_of
from clawbridge.local_gpu.prefill import prefill
from clawbridge.local_gpu.prefixcache import PrefixCache
from clawbridge.local_gpu.registry import AdapterMemoryFull, is_row
from clawbridge.local_gpu.sampling import Draw, draw_token, draw_tokens, needs_uniform
from clawbridge.local_gpu.slotbatch import SlotBatch
from clawbridge.protocol import Priority
from clawbridge.types import (
    SamplingParams,
    TokenChunk,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Seq:
    """One completion being generated."""

    prompt: tuple[int, ...]
    params: SamplingParams
    requested_version: int | None
    emit: Callable[[TokenChunk | BaseException], None]
    generator: torch.Generator
    stop_ids: frozenset[int]
    priority: Priority = "user"
    adapter: str | None = None  # a registered adapter's key (None: a version of the engine's own)
    version: int = -1  # set (and held) from its admission on, also while paused
    row: str = ""  # the adapter name the row runs with (`_forward`), set at admission
    tokens: list[int] = field(default_factory=list)
    text_checked: int = 0
    cancelled: bool = False

    @property
    def context(self) -> tuple[int, ...]:
        """What a prefill computes: the prompt, and the tokens drawn before a pause (the
        scheduler pauses a background row for a user's request; it resumes from here)."""
        return self.prompt + tuple(self.tokens) if self.tokens else self.prompt

    @property
    def owner(self) -> int | str:
        """Whose prefix-cache entries the row may reuse: its version's, or its adapter's."""
        return self.version if self.adapter is None else self.row


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: concurrent.futures.Future[Any]


class Decoding:
    """Admission and decoding, mixed into `engine.Engine` (whose `__init__` sets the state below)."""

    context_length: int
    device: str
    tokenizer: Any
    _waiting: deque[_Seq]
    _active: list[_Seq]
    _batch: KVBatch | SlotBatch
    _prefixes: PrefixCache
    _abandonable: Callable[[], AbstractContextManager[None]]
    _forward: Callable[..., Any]
    _new_batch: Callable[[], KVBatch | SlotBatch]
    _lease: Callable[[_Seq], None]
    _unlease: Callable[[_Seq], None]
    _admissions: Callable[[], list[_Seq]]
    _query_dtype: torch.dtype  # the attention's query dtype (the prefill's additive mask matches it)

    def _admit(self) -> None:
        """Admit the sequences the scheduler chose (`_admissions`) into the running batch,
        prefilled together per served version (`prefill.Prefill`)."""
        seqs: list[_Seq] = []
        chosen = self._admissions()
        for k, seq in enumerate(chosen):
            if seq.version < 0:  # a paused sequence holds its version (or its adapter's slot) still
                try:
                    self._lease(seq)
                except AdapterMemoryFull:  # every slot serves a running row: wait for one to end
                    self._waiting.extendleft(reversed(chosen[k:]))
                    break
                except BaseException as exc:
                    seq.emit(exc)
                    continue
            seqs.append(seq)
        groups: dict[str, list[_Seq]] = {}
        for seq in seqs:
            groups.setdefault(seq.row, []).append(seq)
        for name, group in groups.items():
            self._prefill(name, group)

    def _prefill(self, name: str, seqs: list[_Seq]) -> None:
        """One forward over the prompts of `seqs` (all on adapter `name`; the same prompt is
        computed once), each continuing its longest prefix cached on that version; their
        caches kept for later prompts, each sequence's first token drawn, and the sequences
        that go on added to the running batch."""
        owner = seqs[0].owner
        contexts = [seq.context for seq in seqs]  # before drawing: a draw extends `context`
        prompts: dict[tuple[int, ...], int] = {}
        for context in contexts:
            prompts.setdefault(context, len(prompts))
        unique = list(prompts)
        tokens: list[int | None] = []
        try:
            with torch.inference_mode(), self._abandonable():
                cached = [self._prefixes.lookup(owner, p) if self._prefixes.budget else None for p in unique]
                layout = prefill(unique, cached, device=self.device, mask_dtype=self._query_dtype)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("prefill: %d prompts for %d requests, %d of %d prompt tokens cached",
                              len(unique), len(seqs), sum(0 if c is None else c.get_seq_length() for c in cached),
                              sum(len(p) for p in unique))
                out = self._forward([name] * len(unique), **layout.inputs, use_cache=True, logits_to_keep=1)
                cache = cache_of(out)
                # kept before the first token goes out: a caller that has it sees the entry
                for i, p in enumerate(unique):
                    self._prefixes.store(owner, p, layout.row_cache(cache, i))
                logits = out.logits[:, -1]
                for seq, context in zip(seqs, contexts, strict=True):
                    tokens.append(self._take(seq, logits[prompts[context]]))
                rows = [prompts[c] for c, t in zip(contexts, tokens, strict=True) if t is not None]
                if rows:
                    self._batch.add_rows(*layout.take(cache, rows), [t for t in tokens if t is not None])
        except BaseException as exc:
            for i, seq in enumerate(seqs):
                self._unlease(seq)
                if i >= len(tokens) or tokens[i] is not None:  # a finished one has had its end
                    seq.emit(exc)
            return
        for seq, token in zip(seqs, tokens, strict=True):
            if token is None:
                self._unlease(seq)
            else:
                self._active.append(seq)

    def _decode_step(self) -> None:
        try:
            with torch.inference_mode():
                names = [s.row for s in self._active]
                if isinstance(self._batch, SlotBatch):
                    unique = set(names)

                    def forward(inputs: dict[str, Any]) -> torch.Tensor:
                        # a bucketed step has free rows past the live ones: they ride on row 0's
                        # adapter (their logits are dropped)
                        pad = inputs["input_ids"].shape[0] - len(names)
                        rows = names + names[:1] * pad
                        return self._forward(rows, **inputs, use_cache=True).logits[:, -1]

                    # a registered adapter's slot may be refilled with another: never captured
                    one = unique.pop() if len(unique) == 1 else None
                    logits = self._batch.step(forward, None if one is None or is_row(one) else one)
                else:
                    logits = self._forward(
                        names, **self._batch.step_inputs(), use_cache=True
                    ).logits[:, -1]
                nexts = self._take_all(logits)
        except BaseException as exc:
            log.exception("decode step failed; failing %d requests", len(self._active))
            for seq in self._active:
                seq.emit(exc)
                self._unlease(seq)
            self._active, self._batch = [], self._new_batch()
            return
        self._batch.advance([t if t is not None else 0 for t in nexts])
        keep = [i for i, t in enumerate(nexts) if t is not None]
        for i, t in enumerate(nexts):
            if t is None:
                self._unlease(self._active[i])
        self._active = [self._active[i] for i in keep]
        with torch.inference_mode():
            self._batch.keep(keep)

    def _take(self, seq: _Seq, logits: torch.Tensor) -> int | None:
        """Draw the next token, stream it; the token to feed next, or None once finished."""
        if seq.cancelled:
            return None
        return self._accept(seq, draw_token(logits, seq.params, self._uniform(seq)))

    def _take_all(self, logits: torch.Tensor) -> list[int | None]:
        """`_take` for every active row of a decode step, drawn together (`draw_tokens`)."""
        live = [i for i, seq in enumerate(self._active) if not seq.cancelled]
        if not live:
            return [None] * len(self._active)
        rows = (
            logits
            if len(live) == len(self._active)
            else logits[torch.tensor(live, device=logits.device)]
        )
        seqs = [self._active[i] for i in live]
        draws = draw_tokens(rows, [s.params for s in seqs], [self._uniform(s) for s in seqs])
        nexts: list[int | None] = [None] * len(self._active)
        for i, seq, draw in zip(live, seqs, draws, strict=True):
            nexts[i] = self._accept(seq, draw)
        return nexts

    @staticmethod
    def _uniform(seq: _Seq) -> float:
        return (
            float(torch.rand((), generator=seq.generator, dtype=torch.float64))
            if needs_uniform(seq.params)
            else 0.0
        )

    def _accept(self, seq: _Seq, draw: Draw) -> int | None:
        seq.tokens.append(draw.token)
        finish = self._finish_reason(seq, draw.token)
        seq.emit(
            TokenChunk(
                tokens=(draw.token,),
                logprobs=(draw.logprob,),
                version=seq.version,
                finish_reason=finish,
                top_logprobs=(draw.top,) if draw.top is not None else None,
            )
        )
        return None if finish is not None else draw.token

    def _finish_reason(self, seq: _Seq, token: int) -> Literal["stop", "length"] | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop:
            # decode the whole completion (merges and multi-byte characters settle late) but
            # search only the text that could contain a new match
            text = self.tokenizer.decode(seq.tokens, skip_special_tokens=False)
            longest = max(len(s) for s in seq.params.stop)
            window = text[max(0, seq.text_checked - longest + 1) :]
            seq.text_checked = len(text)
            if any(s and s in window for s in seq.params.stop):
                return "stop"
        if len(seq.tokens) >= seq.params.max_tokens:
            return "length"
        if len(seq.prompt) + len(seq.tokens) >= self.context_length:
            return "length"
        return None
