"""Runs many generation requests on one Engine from one thread, a token at a time each, in turns.

The server's request handlers submit `Job`s from any thread; the scheduler thread alone calls the engine. Each round
admits waiting jobs (up to `max_active`), then advances every active job by one token: a new job's first turn is its
prefill. A job that is cancelled (its client went away) is dropped at its next turn. Every job's tokens are what
`Engine.stream` gives for it alone, so a request's greedy output does not depend on what else runs.

Each job decodes with its own KV cache and its own decode step: the weights are read once per job per token, so
the aggregate rate of N jobs is about one stream's. A batched decode step (one weight read for every active job)
is not built yet.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable

from pjinfer.load.tokenizer import StreamDecoder
from pjinfer.runtime.sampling import Sampling


class SchedulerClosed(Exception):
    """The scheduler takes no new jobs (the server is shutting down)."""


@dataclasses.dataclass
class Job:
    """One request. `emit` receives, from the scheduler thread, ("text", piece) events then one
    ("done", finish_reason) or ("error", message); it must be thread-safe and must not block."""
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


class Scheduler:
    def __init__(self, engine, *, max_active: int = 8):
        self.engine, self.max_active = engine, max_active
        self._waiting: queue.Queue[Job] = queue.Queue()
        self._active: list[tuple[Job, object, StreamDecoder]] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pjinfer-scheduler", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._active)

    def submit(self, job: Job) -> None:
        if self._closing.is_set():
            raise SchedulerClosed("the server is shutting down")
        self._waiting.put(job)

    def close(self) -> None:
        """Takes no new job; waiting and active jobs end at the next round ("stop"). Safe from a signal handler."""
        self._closing.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # ------------------------------------------------------------ the scheduler thread
    def _run(self) -> None:
        while True:
            if self._closing.is_set():
                self._end_all()
                return
            self._admit(block=not self._active)
            for entry in list(self._active):
                self._advance(entry)

    def _admit(self, block: bool) -> None:
        while len(self._active) < self.max_active:
            try:
                job = self._waiting.get(timeout=0.05) if block else self._waiting.get_nowait()
            except queue.Empty:
                return
            block = False
            tokens = self.engine.stream(job.prompt_ids, max_new_tokens=job.max_tokens, sampling=job.sampling,
                                        stop_ids=job.stop_ids)
            self._active.append((job, tokens, StreamDecoder(self.engine.tokenizer, job.stops)))

    def _advance(self, entry) -> None:
        job, tokens, decoder = entry
        if job.cancelled.is_set():
            self._finish(entry, "cancelled")
            return
        try:
            token = next(tokens)
        except StopIteration:
            self._finish(entry, "stop")       # an end-of-text id
            return
        except Exception as e:                # a bug, or the engine refusing: the job ends, the server goes on
            self._finish(entry, None, error=f"{type(e).__name__}: {e}")
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

    def _finish(self, entry, reason: str | None, *, error: str | None = None) -> None:
        job, tokens, decoder = entry
        self._active.remove(entry)
        tokens.close()
        job.finished, job.finish_reason = time.perf_counter(), reason
        if error is not None:
            job.emit(("error", error))
            return
        rest = decoder.flush()
        if rest:
            job.emit(("text", rest))
        job.emit(("done", reason))

    def _end_all(self) -> None:
        for entry in list(self._active):
            self._finish(entry, "stop")
        while True:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                return
            job.emit(("error", "the server is shutting down"))
