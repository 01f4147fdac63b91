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


# What an epoch line shows, in this order: (label, metric key, format). A person follows the loss and whether the
# policy's choices beat the train-chosen fixed b on the val split; the rest stays in metrics.jsonl.
EPOCH_FIELDS = (("loss", "train_loss", "{:.4f}"), ("val acc", "val_accuracy", "{:.1%}"),
                ("tau policy", "val_tau_policy", "{:.3f}"), ("fixed b", "val_tau_best_fixed", "{:.3f}"),
                ("oracle", "val_tau_oracle", "{:.3f}"), ("modelled gain", "val_speed_gain_policy", "{:+.2%}"),
                ("oracle gain", "val_speed_gain_oracle", "{:+.2%}"))


def epoch_metrics(m: Dict[str, Any]) -> str:
    """One epoch's metrics as a short line in a fixed order; a metric the objective does not compute (no val rows,
    no cost profile) is left out rather than shown empty."""
    return "  ".join(f"{label} {fmt.format(m[key])}" for label, key, fmt in EPOCH_FIELDS
                     if isinstance(m.get(key), (int, float)))


class EpochLog:
    """On the driver, while the workers train: follows metrics.jsonl and logs one line every ``every`` epochs (about
    five lines a run) and the last one. The driver shows the lines, since a worker's own prints reach the driver
    through Ray's log streaming once per worker and sometimes twice."""

    def __init__(self, path: Path, epochs: int, enabled: bool):
        self.path, self.epochs, self.enabled = path, epochs, enabled
        self.every = max(1, epochs // 5)
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
                out.append(f"epoch {e + 1}/{self.epochs}  {epoch_metrics(m)}")
                self.shown = e
        return out

    def _show(self) -> None:
        for line in self.lines():
            log("train").info(line)
