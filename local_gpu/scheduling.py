"""The engine's scheduler loop, on its own thread: it takes requests and jobs from the inbox,
runs one job per iteration between decode steps (waiting scores packed into one forward), admits
waiting sequences, steps the running batch, and on close fails what is left."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections import deque
from collections.abc import Callable
from typing import Any

from clawbridge.local_gpu.decoding import _Job, _Seq
from clawbridge.local_gpu.forwarding import EngineClosing
from clawbridge.local_gpu.kvbatch import KVBatch
from clawbridge.local_gpu.slotbatch import SlotBatch
from clawbridge.local_gpu.training import SCORE_CHUNK, SCORE_ROW
from clawbridge.protocol import BackendError, UnknownVersion

log = logging.getLogger(__name__)


class Scheduling:
    """The scheduler thread's loop, mixed into `engine.Engine` (whose `__init__` sets the state
    below)."""

    _inbox: queue.Queue[_Seq | _Job | None]
    _waiting: deque[_Seq]
    _jobs: deque[_Job]
    _active: list[_Seq]
    _batch: KVBatch | SlotBatch
    _writer: concurrent.futures.ThreadPoolExecutor
    _new_batch: Callable[[], KVBatch | SlotBatch]
    _admit: Callable[[], None]
    _decode_step: Callable[[], None]
    _score: Callable[..., list[float]]
    _scores: Callable[..., list[list[float]]]
    _persisted: Callable[..., Any]

    def _run(self) -> None:
        while True:
            idle = not (self._waiting or self._jobs or self._active)
            try:
                item = self._inbox.get(block=idle)
                while True:
                    if item is None:
                        self._shutdown()
                        return
                    if isinstance(item, _Job):
                        self._jobs.append(item)
                    else:
                        self._waiting.append(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if self._jobs:
                job = self._jobs.popleft()
                self._run_scores([job, *self._more_scores(job)]) if self._scoring(job) else self._run_job(job)
            self._admit()
            if self._active:
                self._decode_step()

    def _scoring(self, job: _Job) -> bool:
        """`job` is a `score` that fits one packed forward (a longer one runs alone, in chunks)."""
        if job.fn != self._score:
            return False
        prompt, completion = job.args[0], job.args[1]
        return bool(prompt) and bool(completion) and len(prompt) + len(completion) <= SCORE_CHUNK

    def _more_scores(self, first: _Job) -> list[_Job]:
        """The other waiting `score` jobs on `first`'s model, taken out of the queue (in order,
        up to SCORE_ROW tokens with `first`'s: one packed forward, decode steps still between):
        callers ask for many at once (a turn's rewrites, a step's teacher), and each alone pays
        a whole forward's overhead for a few dozen tokens. Only scores queued before any other
        job: a score asked after a publish is the new version's."""
        taken: list[_Job] = []
        rest: deque[_Job] = deque()
        room = SCORE_ROW - len(first.args[0]) - len(first.args[1])
        while self._jobs and self._jobs[0].fn == self._score:
            job = self._jobs.popleft()
            size = len(job.args[0]) + len(job.args[1]) if self._scoring(job) else 0
            if size and job.args[2] == first.args[2] and size <= room:
                taken.append(job)
                room -= size
            else:
                rest.append(job)
        self._jobs.extendleft(reversed(rest))
        return taken

    def _run_scores(self, jobs: list[_Job]) -> None:
        """The score jobs as one `_scores` job (failing, or failed, as any job), each given its own."""
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not live:
            return
        together: concurrent.futures.Future[list[list[float]]] = concurrent.futures.Future()
        self._run_job(_Job(self._scores, ([job.args for job in live],), together))
        error = together.exception()
        for i, job in enumerate(live):
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(together.result()[i])

    def _run_job(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn(*job.args))
        except (UnknownVersion, OSError, EngineClosing) as exc:  # the caller's, the disk's, a stop: no traceback
            if isinstance(exc, OSError):
                log.error("engine job %s failed: %s", getattr(job.fn, "__name__", job.fn), exc)
            job.future.set_exception(exc)
        except BaseException as exc:
            log.exception("engine job %s failed", getattr(job.fn, "__name__", job.fn))
            job.future.set_exception(exc)

    def _shutdown(self) -> None:
        error = BackendError("the engine was closed")
        for seq in [*self._active, *self._waiting]:
            seq.emit(error)
        for job in self._jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
        self._active, self._batch = [], self._new_batch()
        self._writer.shutdown(wait=True)  # versions being persisted reach the disk
        while True:  # ... and their publishers hear so
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Job) and item.fn == self._persisted:
                self._run_job(item)
            elif isinstance(item, _Job) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)
            elif isinstance(item, _Seq):
                item.emit(error)
