"""The engine's scheduler loop, on its own thread: it takes requests and jobs from the inbox,
runs one job per iteration between decode steps (waiting scores packed into one forward), chooses
which waiting sequences to admit (a user's request first), steps the running batch, and on close
fails what is left."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from clawbridge.local_gpu.decoding import _Job, _Seq
from clawbridge.local_gpu.forwarding import EngineClosing
from clawbridge.local_gpu.kvbatch import KVBatch
from clawbridge.local_gpu.slotbatch import SlotBatch
from clawbridge.local_gpu.training import SCORE_CHUNK, SCORE_ROW
from clawbridge.protocol import BackendError, UnknownVersion

log = logging.getLogger(__name__)

# The learner's turn while users' requests keep the engine busy starts once it has earned this
# much engine time (seconds; `background_share` of the time passing) and lasts until it has spent
# it: bursts, not a step here and there, since pausing and resuming background rows costs a prefill.
BURST_S = 0.5
DEBT_S = 4.0  # the most the learner owes after one long job (a publish, a long micro-batch)
# ... and it earns nothing in the first seconds users' requests keep the engine busy: a user's
# request of a few seconds is served as if the learner were not there (strict priority); only
# users who keep it busy longer share it
PATIENCE_S = 4.0
# Users' requests less than this apart are one stretch: between a request's end and the next's
# arrival the engine has no user's request for a client's round trip (milliseconds, a tenth of a
# second on a busy CPU), and two users who never pause are both in one now and then. A longer
# pause ends the stretch: the next request is served with the patience again.
GAP_S = 1.0


class Scheduling:
    """The scheduler thread's loop, mixed into `engine.Engine` (whose `__init__` sets the state
    below)."""

    user_first: bool
    background_share: float  # of the engine's time, the learner's while users keep it busy
    _credit: float  # seconds of the learner's share earned and not spent (users in flight)
    _clock: float | None  # when `_credit` was last brought up to date (None: no stretch of users' requests)
    _turn: bool  # the learner's burst is on
    _gap: float | None  # since when no user's request has been in flight (None: one is, or none came yet)
    max_batch: int
    _inbox: queue.Queue[_Seq | _Job | None]
    _waiting: deque[_Seq]
    _jobs: deque[_Job]
    _active: list[_Seq]
    _batch: KVBatch | SlotBatch
    _writer: concurrent.futures.ThreadPoolExecutor
    _new_batch: Callable[[], KVBatch | SlotBatch]
    _admit: Callable[[], None]
    _decode_step: Callable[[], None]
    _unlease: Callable[[_Seq], None]
    _score: Callable[..., list[float]]
    _scores: Callable[..., list[list[float]]]
    _persisted: Callable[..., Any]

    def _run(self) -> None:
        while True:
            if not self._drain(block=not (self._waiting or self._jobs or self._active)):
                self._shutdown()
                return
            if self._jobs and self._background_may_run():
                job = self._jobs.popleft()
                self._run_scores([job, *self._more_scores(job)]) if self._scoring(job) else self._run_job(job)
            self._admit()
            if self._active:
                self._decode_step()

    def _drain(self, *, block: bool) -> bool:
        """Move what the inbox holds into the queues (first waiting for an item if `block`);
        False once the engine is closing."""
        try:
            item = self._inbox.get(block=block)
            while True:
                if item is None:
                    return False
                if isinstance(item, _Job):
                    self._jobs.append(item)
                else:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    # --- the user first (docs/engine.md#the-user-first) ---------------------------------------

    def _background_may_run(self) -> bool:
        """No user's request is in flight, or the learner's share is due (its burst is on).

        While users' requests keep the engine busy, the learner earns `background_share` of the
        time passing and spends all the time its burst takes (jobs, and decode steps with its
        rows beside the users'): a burst starts once `BURST_S` is earned and ends once it is
        spent, and nothing is earned in the first `PATIENCE_S` of a stretch of users' requests. A
        short request is then served as if the learner were not there, a longer stretch of users'
        requests takes at most about 1 / (1 - share) its time alone on average, and the learner
        still progresses under a user who never pauses. A share of 0: the learner waits for the
        users' requests to end, however long.

        A stretch ends only once no user's request has been in flight for `GAP_S`: the moments
        between two back-to-back requests (the learner has the engine to itself then, neither
        earning nor spending) leave its credit and its burst as they were; restarting the
        patience at each of them would withhold the share from users who never pause."""
        now = time.monotonic()
        if not self._users_in_flight():
            if self._gap is None:
                self._gap = now
            return True
        if self._gap is not None:  # users' requests again, after a moment with none
            gap, self._gap = now - self._gap, None
            if gap >= GAP_S:
                self._clock = None  # the users had paused: a new stretch
            elif self._clock is not None:
                self._clock += gap  # the stretch goes on, the gap left out of its accounts
        if self._clock is None:  # a stretch of users' requests starts now, with the patience
            self._credit, self._turn, self._clock = -self.background_share * PATIENCE_S, False, now
        elapsed, self._clock = now - self._clock, now
        earned = self._credit + self.background_share * elapsed - (elapsed if self._turn else 0.0)
        self._credit = min(BURST_S, max(-DEBT_S, earned))
        self._turn = self._credit > 0 if self._turn else (self.background_share > 0 and self._credit >= BURST_S)
        return self._turn

    def _users_in_flight(self) -> bool:
        """A user's request waits or runs. Never with `user_first` off: every request is then
        served alike, in arrival order, and jobs interleave with decode steps."""
        return self.user_first and any(
            s.priority == "user" and not s.cancelled for s in (*self._waiting, *self._active)
        )

    def _admissions(self) -> list[_Seq]:
        """The waiting sequences to admit now, taken out of the queue (`Decoding._admit`
        prefills them).

        With `user_first`, while a user's request waits or runs, background rows are paused
        (`_pause`: a decode step of many rows costs a CPU several times one row's) and only
        users' requests are admitted, at once. Otherwise in arrival order, and while rows run
        and more wait than fit, only once a chunk of rows is free (`_admit_chunk`): a forward's
        fixed cost (~60 ms of the embedded model's on a CPU, whatever it computes) is then paid
        once for the chunk, not once for each sequence as the rows free one by one."""
        self._forget_cancelled()
        learners = self._background_may_run()  # (kept up to date, users or not) the learner's burst
        if self._users_in_flight():
            if not learners:  # ... or its rows pause for the users'
                self._pause()
            users = [s for s in self._waiting if s.priority == "user"]
            rest = [s for s in self._waiting if s.priority != "user"] if learners else []
            chosen = [*users, *rest][: self.max_batch - len(self._active)]
            self._waiting = deque(s for s in self._waiting if s not in chosen)
            return chosen
        free = self.max_batch - len(self._active)
        if not self._waiting or free <= 0:
            return []
        if self._active and len(self._waiting) > free and free < self._admit_chunk:
            return []
        return [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]

    @property
    def _admit_chunk(self) -> int:
        return max(1, self.max_batch // 8)

    def _forget_cancelled(self) -> None:
        """Drop cancelled sequences from the queue (a paused one gives its version back)."""
        if not any(s.cancelled for s in self._waiting):
            return
        for seq in self._waiting:
            if seq.cancelled and seq.version >= 0:
                self._unlease(seq)
        self._waiting = deque(s for s in self._waiting if not s.cancelled)

    def _pause(self) -> None:
        """Free the rows of the background sequences running, at this step boundary. They wait
        at the head of the queue, holding their version, and resume later with one prefill of
        their prompt and what they drew (the prompt's KV is in the prefix cache): the completion
        each draws uninterrupted (tests/test_user_first.py). A row on a registered adapter gives
        its slot back while paused (a user's request may need it: holding it would wait for ever)
        and takes it again when it resumes."""
        paused = [i for i, s in enumerate(self._active) if s.priority == "background"]
        if not paused:
            return
        for i in paused:
            seq = self._active[i]
            if seq.adapter is not None:
                self._unlease(seq)
                seq.version = -1
        keep = [i for i in range(len(self._active)) if i not in paused]
        self._waiting.extendleft(reversed([self._active[i] for i in paused]))
        self._active = [self._active[i] for i in keep]
        with torch.inference_mode():
            self._batch.keep(keep)

    def _yield_to_users(self) -> None:
        """Called by a train step between two micro-batches: while a user's request waits or
        runs, admit and decode as the loop does (no job starts), so that a user waits for at
        most the micro-batch in progress; then the step goes on where it was."""
        while True:
            if not self._drain(block=False):
                self._inbox.put(None)  # for the loop, once the step has stopped
                raise EngineClosing("the engine is closing")
            if self._background_may_run():
                return
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
        """The other waiting `score` jobs on `first`'s model and version, taken out of the queue (in order,
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
            if size and job.args[2] == first.args[2] and job.args[4] == first.args[4] and size <= room:
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
