"""The pipeline's log: one ``[stage] message`` line per event on stdout, through the ``logging`` module.

``blockpilot -q`` shows warnings, errors and each stage's closing lines only (its ``done:`` line and the short
summary after it), the default shows the stages' own lines (one per
shard, one per few epochs), ``-v`` adds debug lines and lets Ray's, Ray Train's, Ray Data's and transformers'
own INFO logs and deprecation warnings through (they are silenced by default: they made a default run 900 lines),
and Ray Data's warnings; pipeline/executor/ray/pool.py keeps Ray's internal lines out of a default run.
The verbosity travels to Ray workers in the environment (``BLOCKPILOT_VERBOSITY``), which local Ray inherits.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

ROOT = "blockpilot"
ENV = "BLOCKPILOT_VERBOSITY"  # -1 quiet, 0 default, 1 verbose


class _StageFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stage = record.name.split(".", 1)[1] if "." in record.name else record.name
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"[{stage}] {level}{record.getMessage()}"


class _ClosingLines(logging.Filter):
    """``-q``: warnings and errors, and of the INFO lines only a stage's closing ones: its ``done:`` line (the
    executor's, train's, profile's, report's) and the summary lines it logs after it."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: set = set()  # loggers that have logged their done: line

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if str(record.msg).startswith(DONE):
            self.closed.add(record.name)
        return record.levelno == logging.INFO and record.name in self.closed


DONE = "done:"  # how every stage's closing line begins


def get(stage: str) -> logging.Logger:
    """The logger of one stage (or part): ``get("label").info(...)`` prints ``[label] ...``."""
    return logging.getLogger(f"{ROOT}.{stage}")


def verbosity() -> int:
    try:
        return int(os.environ.get(ENV, "0"))
    except ValueError:
        return 0


def setup(level: int = 0, stream=None) -> None:
    """Configure the log for a command-line run: our lines on ``stream`` (stdout by default; the CLI's ``--json``
    sends them to stderr, keeping stdout for the JSON) at the chosen level, libraries quiet."""
    os.environ[ENV] = str(level)
    logger = logging.getLogger(ROOT)
    logger.handlers.clear()
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(_StageFormatter())
    if level < 0:
        handler.addFilter(_ClosingLines())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if level <= 0 else logging.DEBUG)
    if level < 1:
        quiet_libraries()


def quiet_libraries() -> None:
    """Libraries' INFO chatter and deprecation warnings off, in this process and (through the environment, which
    local Ray workers inherit) in Ray's workers."""
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars
    # Ray Data's execution plans (per dataset and epoch, INFO) and its one-time notes, which it logs as warnings:
    # "Progress bars disabled. To enable, set `ray.data.DataContext...`" once per process that runs a dataset (the
    # pipeline turns the bars off itself, so the note tells a user nothing). Its errors still print.
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "ERROR")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # transformers absent: nothing to quiet
        pass
    for name in ("ray", "ray.train", "ray.tune"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # as RAY_DATA_LOG_LEVEL above, if it is imported already


# Inside one `blockpilot run` (one_run()): what its stages have said that a later stage would repeat (the workers'
# placement and preflight), so that the later one says only what changed. None outside a run: a stage run alone
# says everything.
_SAID: Optional[Dict[str, Any]] = None


@contextmanager
def one_run() -> Iterator[None]:
    global _SAID
    _SAID = {}
    try:
        yield
    finally:
        _SAID = None


def said_before(topic: str, what: Any) -> bool:
    """Within one run: whether ``topic`` was last said as ``what``; remembers ``what`` either way."""
    if _SAID is None:
        return False
    same = topic in _SAID and _SAID[topic] == what
    _SAID[topic] = what
    return same
