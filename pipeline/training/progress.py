"""train's per-epoch metrics file (``metrics.jsonl``) and the driver's view of it while the workers train."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Dict, List

from pipeline.io.layout import METRICS
from pipeline.io.shards import write_jsonl_atomic
from pipeline.io.storage import location
from pipeline.runtime.log import get as log


def write_history(history: List[Dict[str, Any]], train_dir) -> None:
    """The whole history each time, so that a resumed run rewrites the file and never duplicates an epoch. Written
    after the report, so that the file never runs ahead of the checkpoints."""
    write_jsonl_atomic(history, location(train_dir) / METRICS)


class EpochLog:
    """On the driver, while the workers train: follows metrics.jsonl and logs one line every ``every`` epochs (about
    ten lines a run) and the last one. The driver shows the lines, since a worker's own prints reach the driver
    through Ray's log streaming once per worker and sometimes twice."""

    def __init__(self, path: Path, epochs: int, enabled: bool):
        self.path, self.epochs, self.enabled = path, epochs, enabled
        self.every = max(1, epochs // 10)
        self.shown = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)
            self._show()

    def _follow(self) -> None:
        while not self._stop.wait(1.0):
            self._show()

    def lines(self) -> List[str]:
        """The lines not shown yet (marks them shown)."""
        try:
            history = [json.loads(x) for x in self.path.read_text().splitlines()]
        except (OSError, ValueError):  # not written yet, or mid-replace
            return []
        out = []
        for m in history:
            e = m["epoch"]
            if e > self.shown and ((e + 1) % self.every == 0 or e + 1 == self.epochs):
                shown = {k: round(v, 4) for k, v in m.items() if isinstance(v, float)}
                out.append(f"epoch {e + 1}/{self.epochs} {shown}")
                self.shown = e
        return out

    def _show(self) -> None:
        for line in self.lines():
            log("train").info(line)
