"""A real clawbridge server on 127.0.0.1 (free port) in a background thread: uvicorn, the proxy,
a real store. Tests drive it with real HTTP clients, then stop it (drain included)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from clawbridge.config import Settings
from clawbridge.server import Running, serve
from clawbridge.serving.proxy import Proxy, ProxyHooks


class LiveServer:
    def __init__(self, settings: Settings, backend: Any, store: Any = None, hooks: ProxyHooks | None = None):
        self.settings, self.backend, self.store, self.hooks = settings, backend, store, hooks
        self.running: Running | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="live-clawbridge", daemon=True)

    def _main(self) -> None:
        async def go() -> None:
            self.loop = asyncio.get_running_loop()
            await serve(self.settings, backend=self.backend, store=self.store, hooks=self.hooks,
                        quiet=True, started=self._started)

        try:
            asyncio.run(go())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    def _started(self, running: Running) -> None:
        self.running = running
        self._ready.set()

    def start(self, timeout: float = 240) -> LiveServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("clawbridge did not start")
        if self._error is not None:
            raise RuntimeError("clawbridge failed to start") from self._error
        return self

    def stop(self, timeout: float = 60) -> None:
        if self.running is not None:
            self.running.server.should_exit = True
        self._thread.join(timeout)

    def call(self, coro: Any, timeout: float = 60) -> Any:
        """Run a coroutine on the server's loop (e.g. the backend's score) and wait for it."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def settle(self) -> None:
        """Wait for the proxy's background writes (a next state is attached just after the
        response that carried it), so the store can be read as of the last response."""
        self.call(self.proxy.settle())

    @property
    def url(self) -> str:
        assert self.running is not None
        return self.running.base_url

    @property
    def proxy(self) -> Proxy:
        assert self.running is not None
        return self.running.proxy


@contextlib.contextmanager
def with_learner(settings: Settings, *, poll_s: float = 0.2) -> Iterator[LiveServer]:
    """A live server whose learner runs beside it, as `clawbridge up` runs it; both stopped after."""
    from clawbridge.learning.learner import Learner
    from clawbridge.server import build_backend, learner_hooks, learner_task

    learner = Learner(settings, poll_s=poll_s)
    server = LiveServer(settings, build_backend(settings), hooks=learner_hooks(learner)).start()
    assert server.loop is not None and server.running is not None
    task = asyncio.run_coroutine_threadsafe(learner_task(learner)(server.running), server.loop)
    try:
        yield server
    finally:
        server.loop.call_soon_threadsafe(task.cancel)
        server.stop()
