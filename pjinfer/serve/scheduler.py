"""Runs many generation requests on one Engine from one thread.

The server's request handlers submit `Job`s from any thread; the scheduler thread alone calls the engine. Each round
admits waiting jobs (up to `max_active`; a new job's prefill runs when it is admitted and gives its first token),
then advances every active job. Jobs past `max_active` wait in a queue of at most `max_queue`; `submit` refuses one
more (`QueueFull`) rather than letting the queue grow without bound. A job that is cancelled (its client went away)
leaves the queue at once, or the batch at the next decode step: the step running when it is cancelled returns early
and the cancelled job gets none of its tokens. One log line says so ("client went away after N tokens"). Every
job's tokens are what `Engine.stream` gives for it alone, bit for bit, so a request's output does not depend on what
else runs.

A round is one `pjinfer.runtime.batch.Batch.step`: up to STEPS tokens of every active job. Where the engine's
backend batches (runtime.backends.BACKENDS says which: dense weights, no bundle) each step reads the weights once for
all of them; other backends take turns, each job's tokens from its own decode loop (the scheduler says so on
stderr once), so N jobs share one stream's rate. A submitted or cancelled job wakes the step, which then returns
after its current decode step, so a new request still joins, and a cancelled one leaves, soon.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from pjinfer.load.tokenizer import StreamDecoder
from pjinfer.runtime import batch as batching
from pjinfer.runtime import tensor_parallel
from pjinfer.runtime.followers import LeaderBatch
from pjinfer.runtime.sampling import Sampling


log = logging.getLogger("pjinfer.serve.scheduler")

STEPS = 8   # batched decode steps per call at most (Batch.step): a call's host overhead spread over them


class SchedulerClosed(Exception):
    """The scheduler takes no new jobs (the server is shutting down)."""


class QueueFull(Exception):
    """Every place in the batch and in the waiting queue is taken: the job was not queued."""


SHUTDOWN = "shutdown"   # the finish reason of the jobs the scheduler's close() ends


@dataclasses.dataclass(eq=False)
class Job:
    """One request. `emit` receives, from the scheduler thread (or from `Scheduler.cancel`), ("text", piece) events
    then one ("done", finish_reason) or ("error", message); it must be thread-safe and must not block.
    finish_reason: "length" (max_tokens reached), "stop" (an end-of-text id or a stop string), SHUTDOWN (the
    scheduler was closed) or "cancelled" (Scheduler.cancel). `cancel_tokens` is completion_tokens when cancel()
    was called; `name` labels the job's log lines."""
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    emit: Callable[[tuple], None]
    stops: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] | None = None     # None: the tokenizer's end-of-text ids
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    cancel_tokens: int | None = None
    name: str = "job"


@dataclasses.dataclass
class _Active:
    """An admitted job: its text decoder and its batch state."""
    job: Job
    decoder: StreamDecoder
    state: batching.State | None = None


class Scheduler:
    def __init__(self, engine, *, max_active: int = 8, max_queue: int = 32):
        self.engine, self.max_active, self.max_queue = engine, max_active, max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._arrived = threading.Condition()     # guards _waiting; notified on submit and close
        self._active: list[_Active] = []
        self._closing = threading.Event()
        reason = batching.unsupported(engine)
        self.batch = (LeaderBatch if engine.backend.parallel else batching.Batch)(engine, max_active)
        self.fatal = None   # the line that ended a tensor-parallel server: a process of its run was lost
        self.stop = lambda: os.kill(os.getpid(), signal.SIGTERM)   # how _lost stops the server (uvicorn's signal)
        if engine.backend.parallel:   # a process that stops answering ends the server as a lost one does
            tensor_parallel.on_silent(lambda line: self._lost(tensor_parallel.Lost(line)))
        if reason:
            print(f"pjinfer: requests take turns, up to {STEPS} tokens each per round: {reason}", file=sys.stderr)
        self._thread = threading.Thread(target=self._run, name="pjinfer-scheduler", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queues `job`; raises SchedulerClosed after close(), QueueFull when every place in the batch is taken and
        max_queue jobs already wait for one."""
        with self._arrived:
            if self._closing.is_set():
                raise SchedulerClosed(self._closing_line())
            # The places free in the batch count too: jobs that wait only for the prefill running now to end
            # (a burst arriving at once) do not fill the queue.
            if len(self._waiting) >= self.max_queue + self.max_active - len(self._active):
                raise QueueFull(f"the server is busy: {self.max_active} requests decoding and {self.max_queue} "
                                f"waiting")
            self._waiting.append(job)
            self._arrived.notify()
        self._wake()

    def cancel(self, job: Job) -> None:
        """From any thread: a waiting job leaves the queue now; an active one ends at the next decode step, with
        finish reason "cancelled" (a no-op once the job is done)."""
        if job.cancelled.is_set():
            return
        job.cancel_tokens = job.completion_tokens
        job.cancelled.set()
        with self._arrived:
            queued = job in self._waiting
            if queued:
                self._waiting.remove(job)
        if queued:
            self._close_job(job, "cancelled")
        elif job.finished is None:
            self._wake()

    def _wake(self) -> None:
        self.batch.wake()

    def close(self) -> None:
        """Takes no new job; active jobs end at the next step (finish reason SHUTDOWN), waiting ones get an error.
        Safe from a signal handler (it takes no lock the interrupted thread may hold)."""
        self._closing.set()
        self._wake()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # ------------------------------------------------------------ the scheduler thread
    def _run(self) -> None:
        while True:
            if self._closing.is_set():
                self._end_all()
                if self.fatal is None:
                    self.batch.close()
                return
            self.batch.clear_wake()   # before looking at the queue: a job submitted from here on wakes the step
            self._admit(block=not self._active)
            for entry in [e for e in self._active if e.job.cancelled.is_set()]:
                self._finish(entry, "cancelled")
            if self._active:
                self._step([e for e in self._active])

    def _next_waiting(self, block: bool) -> Job | None:
        """The oldest waiting job, or None; with `block`, waits a short while for one to arrive."""
        with self._arrived:
            if block and not self._waiting:
                self._arrived.wait(timeout=0.05)
            return self._waiting.popleft() if self._waiting else None

    def _admit(self, block: bool) -> None:
        while len(self._active) < self.max_active:
            job = self._next_waiting(block)
            if job is None:
                return
            block = False
            if job.cancelled.is_set():        # cancelled between leaving the queue and here
                self._close_job(job, "cancelled")
                continue
            entry = _Active(job, StreamDecoder(self.engine.tokenizer, job.stops))
            self._active.append(entry)
            taken = {e.state.slot for e in self._active if e.state is not None}
            slot = min(set(range(self.max_active)) - taken)
            try:
                entry.state = self.batch.start(slot, job.prompt_ids, job.max_tokens, job.sampling, job.stop_ids)
            except Exception as e:            # the engine refusing, or a bug: the job ends, the server goes on
                if self._lost(e):
                    return
                self._finish(entry, None, error=f"{type(e).__name__}: {e}")
                continue
            self._deliver(entry, entry.state.token)

    def _step(self, entries: list[_Active]) -> None:
        """Batched decode steps for every entry (up to STEPS), then each one's new tokens in order; an entry that
        ends on the way (a stop string, its budget) drops the rest of its tokens."""
        try:
            self.batch.step([e.state for e in entries], steps=STEPS)
        except Exception as e:                # a bug: these jobs end, the server goes on
            if self._lost(e):
                return
            for entry in entries:
                self._finish(entry, None, error=f"{type(e).__name__}: {e}")
            return
        for entry in entries:
            for token in entry.state.new:
                if entry not in self._active or entry.job.cancelled.is_set():
                    break
                self._deliver(entry, token)

    def _lost(self, error: Exception) -> bool:
        """A tensor-parallel run that lost a process ends the server (its model is gone): every active and waiting
        job gets a 503 error, and `stop` (the server's: SIGTERM to this process) is called. True when it did."""
        line = tensor_parallel.lost(error)
        if line is None:
            return False
        self.fatal = line
        self._closing.set()
        for entry in list(self._active):
            self._active.remove(entry)
            entry.job.finished = time.perf_counter()
            entry.job.emit(("error", self._closing_line()))
        self._end_all()
        self.stop()
        return True

    def _deliver(self, entry: _Active, token: int) -> None:
        """Hands a job its next token, and ends the job where Engine.stream would stop."""
        job, decoder = entry.job, entry.decoder
        if token in entry.state.stops:
            self._finish(entry, "stop")       # an end-of-text id
            return
        if job.first_token is None:
            job.first_token = time.perf_counter()
        job.completion_tokens += 1
        piece = decoder.push(token)
        if piece:
            job.emit(("text", piece))
        if decoder.stop is not None:
            self._finish(entry, "stop")
        elif job.completion_tokens >= job.max_tokens:
            self._finish(entry, "length")

    def _finish(self, entry: _Active, reason: str | None, *, error: str | None = None) -> None:
        job, decoder = entry.job, entry.decoder
        self._active.remove(entry)
        if entry.state is not None:
            self.batch.release(entry.state.slot)
        if error is not None:
            job.finished, job.finish_reason = time.perf_counter(), None
            job.emit(("error", error))
            return
        if reason != "cancelled":
            rest = decoder.flush()
            if rest:
                job.emit(("text", rest))
        self._close_job(job, reason)

    @staticmethod
    def _close_job(job: Job, reason: str) -> None:
        """Marks `job` finished with `reason` and sends its ("done", reason); a cancelled one gets its log line."""
        job.finished, job.finish_reason = time.perf_counter(), reason
        if reason == "cancelled":
            log.info("%s client went away after %d tokens (%d after it went)", job.name, job.completion_tokens,
                     job.completion_tokens - (job.cancel_tokens or 0))
        job.emit(("done", reason))

    def _end_all(self) -> None:
        for entry in list(self._active):
            self._finish(entry, SHUTDOWN)
        with self._arrived:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for job in waiting:
            job.emit(("error", self._closing_line()))

    def _closing_line(self) -> str:
        """What a job that will not run is told: the line that ended a tensor-parallel server, where one did."""
        return "the server is shutting down" + (f": {self.fatal}" if self.fatal else "")
