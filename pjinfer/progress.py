"""Progress of long work (loading, profiling, training, evaluation, benchmarks) on stderr, drawn by tqdm.

Work reports itself through a plain callable, ``progress(done, total)``, so lower layers need no progress library:
``done == 0`` marks the start (rate and ETA count from there), ``total`` may change as the work learns its size.
The bar is drawn only when stderr is a terminal; in logs and pipes it stays quiet.
"""
from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, label: str, total: int, unit: str = "", *, stream=None):
        self.label, self.total, self.unit = label, total, unit.strip() or "it"
        self.stream = stream or sys.stderr
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int | None = None):
        if total:
            self.total = total
        if self.bar is None or done == 0:
            self._close()
            self.bar = tqdm(total=self.total, desc=self.label, unit=self.unit, file=self.stream,
                            disable=None, dynamic_ncols=True, leave=True)
        if self.bar.total != self.total:
            self.bar.total = self.total
        self.bar.update(done - self.bar.n)
        if done >= self.total:
            self._close()

    def _close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
