"""The engine's forwards, on the scheduler thread: which adapter the LoRA layers point at for a
forward (one shared adapter, or PEFT's mixed batch with one per row; rows on registered adapters
add their deltas from the stack, `multilora`), and long forwards that a closing engine abandons
between two decoder layers (`EngineClosing`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from clawbridge.local_gpu import precision
from clawbridge.local_gpu.adapters import BASE, STALE
from clawbridge.local_gpu.multilora import AdapterStack
from clawbridge.local_gpu.registry import is_row
from clawbridge.protocol import BackendError


class EngineClosing(BackendError):
    """The engine is closing: the forward in progress (a prefill, a score, a training step) is
    abandoned between two decoder layers, so that stopping never waits for a long prompt."""


class Forwarding:
    """Forwards on chosen adapters, mixed into `engine.Engine` (whose `__init__` sets the state
    below)."""

    _model: Any
    _closed: bool
    _lora_layers: list[Any]
    _trainable_active: list[Any]
    _pointed: str | None
    _merged: precision.MergedAdapters | None
    _stack: AdapterStack | None
    _slots_of: Callable[[list[str]], list[int] | None]

    @contextlib.contextmanager
    def _abandonable(self) -> Iterator[None]:
        """While a long forward runs (a prefill, a score, a training step), every decoder layer
        and each of its parts (attention, MLP) first checks that the engine is not closing. Only
        then: hooks would slow every decode step, and a decode step is short anyway."""
        def check(_module: torch.nn.Module, _args: Any) -> None:
            if self._closed:
                raise EngineClosing("the engine is closing")

        handles = [m.register_forward_pre_hook(check) for layer in self._decoder_layers
                   for m in (layer, *layer.children())]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _abandonably(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._abandonable():
            return fn(*args)

    @functools.cached_property
    def _decoder_layers(self) -> list[torch.nn.Module]:
        """The model's decoder layers (the largest ModuleList of the base model)."""
        lists = [list(m) for m in self._model.modules() if isinstance(m, torch.nn.ModuleList)]
        return max(lists, key=len, default=[])

    def _forward(self, names: Sequence[str] | None, **inputs: Any) -> Any:
        """One forward with each row on its adapter (`names`; None: the trainable adapter).

        Rows on several adapters take PEFT's mixed-batch path. When every row shares one (the
        usual case: everyone on the newest version), the LoRA layers are pointed at it for this
        forward instead: the mixed-batch path (per-layer gathers and scatters, hooks on every
        module) costs far more than a plain forward.

        Rows on registered adapters (`registry.ROW` names) run on the base weights here, and the
        stack's hooks add each one's own delta (`multilora`): one forward whatever the mix."""
        slots = None if names is None else self._slots_of(list(names))
        if self._stack is not None and slots is not None:
            self._stack.engage(slots)
        elif self._stack is not None:
            self._stack.disengage()
        if names is None:
            self._point_at(None)
            return self._model(**inputs)
        if slots is not None:
            names = [BASE if is_row(n) else n for n in names]
        unique = set(names)
        if len(unique) > 1:
            if self._merged is not None and self._merged.in_place is not None:
                self._merged.use(None)  # the mixed batch adds each row's adapter to the base's weights
                self._pointed = STALE
            return self._model(**inputs, adapter_names=list(names))
        self._point_at(unique.pop())
        return self._model(**inputs)

    def _point_at(self, name: str | None) -> None:
        """Point every LoRA layer at adapter `name` (None: the trainable one as PEFT set it up),
        only when it changes: the assignment goes through nn.Module.__setattr__ on each of the
        hundreds of LoRA layers, a cost every decode step would otherwise pay. PEFT's own
        set_adapter would also flip requires_grad, which must stay on the trainable adapter. A
        served adapter runs merged into the weights where the engine merges (`_merged`): the
        layers then point at no adapter and hold that adapter's merged weights."""
        if name == self._pointed:
            return
        merged = self._merged is not None and name not in (None, BASE)
        for layer, trainable in zip(self._lora_layers, self._trainable_active, strict=True):
            layer._active_adapter = trainable if name is None else [] if name == BASE or merged else [name]
        if self._merged is not None:
            self._merged.use(name if merged else None)
        self._pointed = name

    def _forget_merged(self, name: str) -> None:
        """Slot `name`'s weights changed or it was freed: its merged copy is stale."""
        if self._merged is not None:
            self._merged.forget(name)
            self._pointed = STALE

