"""One progress line on stderr with count, rate and ETA; redrawn in place on a terminal."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, unit: str = "", *, stream=None, every: float = 0.5):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every if self.tty else max(every, 10.0)  # logs get a line every 10 s, not a flood
        self.start = self.last = time.perf_counter()
        self.done = 0

    def __call__(self, done: int, total: int | None = None):
        self.done, self.total = done, total or self.total
        now = time.perf_counter()
        if done == 0:  # the work starts now (after, say, reading a file header): rate and ETA count from here
            self.start = self.last = now
            return
        if done >= self.total or now - self.last >= self.every:
            self.last = now
            self._draw(now, final=done >= self.total)

    def _draw(self, now, final):
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        tail = f"{elapsed:.1f} s" if final else f"ETA {eta:.0f} s"
        line = f"{self.label}: {self.done}/{self.total}{self.unit} ({rate:.1f}{self.unit}/s, {tail})"
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r\033[K" if self.tty else "") + line + end)
        self.stream.flush()
