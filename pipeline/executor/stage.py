"""What a shard stage declares, and nothing it runs.

The shape follows datatrove (an executor owns completions and rank-named outputs while a step only processes its
data) and NeMo Curator (a stage declares setup, process and resources; a backend executes it). A shard stage
(:class:`ShardStage`) declares only what is its own:

* ``fingerprint()``: the config values that shape its output;
* ``plan()``: its shard tasks (one output shard each) and any rows rejected before sharding;
* ``setup(worker)``: loads models once per worker (a Ray actor, or the driver process);
* ``process_shard(input, rejects) -> pyarrow.Table``: one shard's rows; a bad row goes to ``rejects``;
* ``resources()``: where it runs (the driver process, or a pool of actors).

:func:`pipeline.executor.driver.run_stage` owns the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pyarrow as pa

from pipeline.io.layout import MANIFEST
from pipeline.io.shards import recorded_stamps, same_object, shard_name, shard_names
from pipeline.io.storage import listing, location, parallel_map, parquet_file


@dataclass
class Resources:
    """Where a stage's shards are processed: in the driver process, or on a pool of actors (one per GPU when the
    cluster has GPUs, else ``num_workers`` CPU actors of ``cpus_per_worker`` each)."""

    actors: bool = False
    num_workers: Optional[int] = None
    cpus_per_worker: float = 1.0
    max_retries: int = 0
    workers_key: str = ""  # the config key of num_workers, named in messages ("label.num_workers")
    device: str = "auto"  # model.device: cuda waits for GPU actors; auto takes GPUs when the cluster has them


@dataclass
class Worker:
    """Who processes shards: its identity goes into rejects and rows; ``threads`` is its CPU share."""

    identity: str
    threads: Optional[int] = None


@dataclass
class ShardTask:
    name: str  # the output shard's file name, part-NNNNN.parquet
    input: Any  # an input shard's path, or the rows themselves
    rows: int  # input rows: progress, and the done check
    output: str = ""  # filled in by the driver
    rejects: str = ""
    checksum: str = ""  # the shard's sha256 sidecar, written with it (filled in by the driver)
    metadata: Dict[str, Any] = field(default_factory=dict)  # stamped into the shard's schema metadata
    # What the Ray pool learnt of its prompts from device failures (pipeline.executor.failures): prompt id -> the
    # error of those that broke two workers' devices (rejected, not decoded), and the ids to decode alone (a batch's
    # sticky error: alone, the next failure names the one prompt)
    refused: Dict[str, str] = field(default_factory=dict)
    alone: Tuple[str, ...] = ()


@dataclass
class Plan:
    tasks: List[ShardTask]
    rejects: List[Dict[str, Any]] = field(default_factory=list)  # rows rejected before sharding


class Rejects(list):
    """One shard's rejected rows; :meth:`add` fills the fields every reject file carries."""

    def __init__(self, worker: str = "", refused: Optional[Dict[str, str]] = None, alone=()):
        super().__init__()
        self.worker = worker
        # the shard's ShardTask.refused and .alone, for the stage's process_shard (pipeline.executor.local.run_task)
        self.refused: Dict[str, str] = dict(refused or {})
        self.alone = frozenset(alone)

    def add(self, row: Dict[str, Any], reason: str, detail: str) -> None:
        rec = {"prompt_id": row.get("prompt_id"), "source": row.get("source"), "reason": reason,
               "detail": detail[:500]}
        if self.worker:
            rec["worker"] = self.worker
        self.append(rec)


class ShardStage:
    """A stage that turns tasks into rank-named Parquet shards in ``folder``. Subclasses override the hooks."""

    name = "stage"
    unit = "rows"
    schema_version: Optional[str] = None
    rows_per_input = 1  # output rows per accepted input row (evaluate: one per method)
    extra_outputs: Tuple[str, ...] = ()  # other files it writes; discarded with the shards on force

    def __init__(self, cfg, folder: Path):
        self.cfg = cfg
        self.folder = location(folder)

    # -- the driver process --
    def requires(self) -> List[Tuple[Path, str]]:
        """Folders that must be complete first, with the command that makes each."""
        return []

    def check(self) -> None:
        """Cheap checks before anything is written (missing paths, bad templates)."""

    def fingerprint(self) -> Dict[str, Any]:
        raise NotImplementedError

    def plan(self) -> Plan:
        raise NotImplementedError

    def resources(self) -> Resources:
        return Resources()

    def describe(self) -> str:
        """Shown on the to-do line (e.g. the candidates)."""
        return ""

    def summarize(self, shards: List[Path]) -> Dict[str, Any]:
        """The stage's own summary of its data, stored in the manifest (no timings); read from the shards, so only
        for stages without :meth:`shard_stats`."""
        return {}

    def shard_stats(self, table: pa.Table) -> Optional[Dict[str, Any]]:
        """JSON-able statistics of one shard, computed by the worker that writes it and kept in its sidecar; with
        :meth:`merge_stats` they replace :meth:`summarize`, so that the driver's closing work reads no shard
        again. None: the stage has none (the driver then calls summarize)."""
        return None

    def merge_stats(self, stats: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The summary from every shard's :meth:`shard_stats`."""
        raise NotImplementedError

    def manifest_extras(self) -> Dict[str, Any]:
        return {}

    def max_reject_fraction(self) -> Optional[float]:
        """The share of input rows that may end as decoding rejects before the stage fails (the driver's
        ``_check_rejects``); None: no limit."""
        return None

    def finalize(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        """After every shard is done, before ``_SUCCESS``: derived outputs; returns extra summary fields."""
        return {}

    def card(self, manifest: Dict[str, Any]) -> Optional[str]:
        """The dataset card's stage-specific part (the layout section is appended); None: no card."""
        return None

    def summary_lines(self, summary: Dict[str, Any]) -> List[str]:
        return []

    # -- every worker --
    def setup(self, worker: Worker) -> None:
        """Load what process_shard needs, once per worker."""

    def worker_info(self) -> Dict[str, Any]:
        return {}

    def preflight_spec(self, placement, token: str):
        """What every worker checks before the first shard (pipeline.executor.preflight.PreflightSpec), given the
        pool's placement; None: presence only (a stage without models)."""
        return None

    def memory_check(self, facts: Dict[str, Any], dtype) -> Optional[Dict[str, Any]]:
        """On a worker, in its preflight: {"need", "have" (bytes), "key", "detail"} of the stage's memory plan on that
        device (``facts``: pipeline.executor.preflight.device_facts), or None."""
        return None

    def process_shard(self, input: Any, rejects: Rejects) -> pa.Table:
        raise NotImplementedError

    def parquet_options(self, table: pa.Table) -> Dict[str, Any]:
        return {"compression": "zstd"}


def tasks_from_shards(folder: Path) -> List[ShardTask]:
    """One task per input shard, named like it: ``part-N`` in, ``part-N`` out.

    Each task's row count comes from the input folder's manifest (one read) where its entry's size and stamp equal
    the folder's listing (the shard is the one the manifest describes), else from the shard's footer, read in
    parallel: at 15,625 shards, footers one after another cost minutes of round trips before any work starts."""
    folder = location(folder)
    listed = listing(folder)
    names = shard_names(listed)
    rows = {}
    if MANIFEST in listed:
        try:
            manifest, stamps = json.loads((folder / MANIFEST).read_text()), recorded_stamps(folder, listed)
            rows = {f["file"]: int(f["rows"]) for f in manifest["files"]
                    if same_object({**f, "stamp": stamps.get(f["file"])}, listed.get(f["file"]))}
        except (OSError, ValueError, KeyError, TypeError):
            rows = {}
    unread = [n for n in names if n not in rows]
    rows.update(zip(unread, parallel_map(lambda n: parquet_file(folder / n).metadata.num_rows, unread)))
    return [ShardTask(n, str(folder / n), rows[n], metadata={"input_shard": n}) for n in names]


def numbered_tasks(chunks: Sequence[Any], rows: Callable[[Any], int] = len) -> List[ShardTask]:
    """One task per in-memory chunk, ``part-00000`` upwards."""
    return [ShardTask(shard_name(i), chunk, rows(chunk)) for i, chunk in enumerate(chunks)]
