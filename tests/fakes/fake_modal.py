"""An offline Modal (modal 1.6.4) at its SDK boundary.

`FakeEngine` answers `engine.<method>.remote.aio(*args)` like a deployed class handle, by running
the REAL `clawbridge.backends.modal_app.Engine` class in-process through Modal's own `.local()`
(which needs no credentials), with arguments and results round-tripped through Modal's own
serialiser (`modal._serialization`, pickle-based). Faults are Modal's exception classes (`modal.exception.AuthError`,
`InternalFailure`), raised before the method runs, as a refused or lost call would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawbridge.backends import modal_app
from modal._serialization import deserialize, serialize

from .torch_platform import Faults


class _Remote:
    def __init__(self, engine: FakeEngine, method: str) -> None:
        self._engine = engine
        self._method = method

    async def aio(self, *args: Any, **kwargs: Any) -> Any:
        fault = self._engine.faults.take(self._method)
        if fault is not None:
            raise fault  # type: ignore[misc]
        args, kwargs = deserialize(serialize((args, kwargs)), None)
        result = await getattr(self._engine.obj, self._method).local(*args, **kwargs)
        return deserialize(serialize(result), None)


class _Method:
    def __init__(self, engine: FakeEngine, method: str) -> None:
        self.remote = _Remote(engine, method)


class FakeEngine:
    """`modal.Cls.from_name("clawbridge", "Engine")(model=...)`, served in-process on CPU; the
    state directory stands in for the Volume (a new FakeEngine on the same directory is a cold
    start)."""

    def __init__(self, state_dir: Path, *, model: str = "tiny-random", lora_rank: int = 8,
                 lora_alpha: int | None = None, seed: int = 0) -> None:
        self.obj = modal_app.Engine(model=model, lora_rank=lora_rank, lora_alpha=lora_alpha or lora_rank, seed=seed,
                                    state_dir=str(state_dir), device="cpu")
        self.faults = Faults()

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self, method)

