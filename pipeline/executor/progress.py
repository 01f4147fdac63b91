"""Progress of a stage's shards, for a terminal or for a log."""

from __future__ import annotations

import sys
import time

from pipeline.runtime.log import get as log


class Progress:
    """Progress of a stage's shards: a tqdm bar when stdout is a terminal, else a line at most every ``every`` seconds
    (done/total, rate, ETA, what finished), which is what a log file or `ray job logs` wants."""

    def __init__(self, name: str, total: int, unit: str = "prompts", every: float = 5.0, enabled: bool = True):
        self.name, self.total, self.unit, self.every, self.enabled = name, total, unit, every, enabled
        self.done = 0
        self.t0 = self._last = time.monotonic()
        self.bar = None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, desc=f"[{name}]", dynamic_ncols=True)

    def update(self, n: int, extra: str = "", force: bool = False) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_postfix_str(extra[:60], refresh=False)
            self.bar.update(n)
            if self.done >= self.total:
                self.bar.close()
            return
        now = time.monotonic()
        # Off a terminal the last update prints nothing: the stage's "done" line, which follows, says it all.
        if self.enabled and (force or (now - self._last >= self.every and self.done < self.total)):
            self._last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            eta_s = f"{eta:,.0f}s" if eta != float("inf") else "?"
            log(self.name).info(f"{self.done}/{self.total} {self.unit} ({rate:.2f}/s, ETA {eta_s}) {extra}".rstrip())
