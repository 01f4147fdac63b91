"""The stage driver: the folder bookkeeping of every stage, in one place.

The shape follows datatrove (an executor owns completions and rank-named outputs while a step only processes its
data) and NeMo Curator (a stage declares setup, process and resources; a backend executes it). A shard stage
(:class:`ShardStage`) declares only what is its own:

* ``fingerprint()``: the config values that shape its output;
* ``plan()``: its shard tasks (one output shard each) and any rows rejected before sharding;
* ``setup(worker)``: loads models once per worker (a Ray actor, or the driver process);
* ``process_shard(input, rejects) -> pyarrow.Table``: one shard's rows; a bad row goes to ``rejects``;
* ``resources()``: where it runs (the driver process, or a pool of actors).

:func:`run_stage` owns the rest, the same way for every stage: required inputs, the writable check, fingerprint and
drift refusal (``force``), skip-if-complete, stale temp files, the to-do list, the executor and its retries, the
atomic reject + shard writes, one manifest format, one rejects layout, ``summary.json``, the dataset card and
``_SUCCESS``. Stages that are not shard-shaped (train, report) use :class:`StageFolder` for the same bookkeeping.
This module is the only writer of manifests, reject files and ``_SUCCESS``.

Ray-free: the Ray actor pool is an executor in ``stages/ray_executor.py``; :class:`LocalExecutor` runs a stage in this
process (prepare, and the driver's own tests).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import pyarrow as pa

from pipeline import __version__
from pipeline.runtime.log import get as log
from pipeline.io.shards import encode_metadata
from pipeline.io.storage import location, parquet_file, rmtree, size
from pipeline.io.shards import (
    FINGERPRINT,
    MANIFEST,
    SUCCESS,
    check_fingerprint,
    file_sha256,
    fingerprint_sha256,
    is_complete,
    list_shards,
    normalise,
    output_shard_valid,
    read_jsonl,
    shard_intact,
    shard_name,
    write_json_atomic,
    write_jsonl_atomic,
    write_parquet_atomic,
    write_text_atomic,
)

MANIFEST_VERSION = 1
from pipeline.io.layout import CARD, INPUT_REJECTS, REJECTS, REJECTS_DIR, SUMMARY  # noqa: E402
# So that `datasets.load_dataset(DIR)` (and the Hub, once uploaded unchanged) reads the shards and nothing else in
# the folder: manifest.json, rejects.jsonl, _SUCCESS and _rejects/ are not data files.
FRONT_MATTER = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: "part-*.parquet"
---
"""
CONFIG_FILES = ("config.yaml", "config.sha256")

# Documented once; rendered into every dataset card (see :func:`layout_doc`).
LAYOUT_DOC = f"""## Folder layout (every stage)

| path | what |
| --- | --- |
| `part-NNNNN.parquet` | the output shards; `part-N` is made from input shard `part-N` where the stage has input shards |
| `{REJECTS_DIR}/part-NNNNN.jsonl` | rows of shard N that were rejected, written just before the shard |
| `{REJECTS_DIR}/{INPUT_REJECTS}` | rows rejected before sharding (prepare: bad source rows) |
| `{REJECTS}` | every reject of the stage: `{INPUT_REJECTS}` first, then shard by shard |
| `{MANIFEST}` | the manifest below; written after the last shard, it holds no timings |
| `{SUMMARY}` | the last run's summary: the manifest's counts plus timings, workers and the stage's own results |
| `{FINGERPRINT}` | the config values that shaped the output; a rerun with other values is refused unless `force=true` |
| `config.yaml`, `config.sha256` | the resolved config of the last run and its sha256 |
| `{CARD}` | this card; its YAML front matter names the shards, so `datasets.load_dataset(DIR)` reads them alone |
| `{SUCCESS}` | empty; written last, once every shard is present and valid |

A reject is one JSON object per line: `prompt_id` and `source` where known, `reason`, `detail`, and `worker`
(decoding stages) or `source_row` and `file` (prepare). Every shard carries the key-value metadata
`blockpilot.fingerprint_sha256`, `blockpilot.config_sha256`, `blockpilot.package_version`, `blockpilot.stage` and,
where it has one, `blockpilot.input_shard`. A shard counts as done on a rerun when its footer reads, it carries the
folder's fingerprint, and its rows plus its rejects account for every input row. The folder may live in object
storage (`output_dir=s3://...`): every file is then uploaded whole (one PUT, or a multipart upload completed last),
so an object is visible only once complete, and the same order holds (rejects, shard, manifest, `{SUCCESS}` last).

`{MANIFEST}` (manifest_version {MANIFEST_VERSION}):

| key | meaning |
| --- | --- |
| `manifest_version`, `stage`, `schema_version` | format of this file; the stage; the shards' schema version |
| `files` | one entry per shard: `file`, `rows`, `bytes`, `sha256`, `rejects` (that shard's reject count), `input_rows` (rows of its input; `rows` = (`input_rows` - `rejects`) x rows per input row) |
| `rows`, `shards` | total rows and shard count |
| `rejects`, `rejects_file` | total rejects; `{REJECTS}` |
| `rejects_by_reason`, `rejects_by_source`, `rejects_by_worker` | reject counts by those fields |
| `fingerprint`, `fingerprint_sha256` | as in `{FINGERPRINT}`, and its sha256 (the one in every shard) |
| `workers` | the workers that wrote the shards, earlier interrupted runs' included |
| `summary` | the stage's own summary of the data (e.g. label histograms) |
"""


def layout_doc() -> str:
    return LAYOUT_DOC


# ---- what a stage declares ----------------------------------------------------------------------------------------

@dataclass
class Resources:
    """Where a stage's shards are processed: in the driver process, or on a pool of actors (one per GPU when the
    cluster has GPUs, else ``num_workers`` CPU actors of ``cpus_per_worker`` each)."""

    actors: bool = False
    num_workers: Optional[int] = None
    cpus_per_worker: float = 1.0
    max_retries: int = 0


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
    metadata: Dict[str, Any] = field(default_factory=dict)  # stamped into the shard's schema metadata


@dataclass
class Plan:
    tasks: List[ShardTask]
    rejects: List[Dict[str, Any]] = field(default_factory=list)  # rows rejected before sharding


class Rejects(list):
    """One shard's rejected rows; :meth:`add` fills the fields every reject file carries."""

    def __init__(self, worker: str = ""):
        super().__init__()
        self.worker = worker

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
        """The stage's own summary of its data, stored in the manifest (no timings)."""
        return {}

    def manifest_extras(self) -> Dict[str, Any]:
        return {}

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

    def process_shard(self, input: Any, rejects: Rejects) -> pa.Table:
        raise NotImplementedError

    def parquet_options(self, table: pa.Table) -> Dict[str, Any]:
        return {"compression": "zstd"}


# ---- progress ----------------------------------------------------------------------------------------------------

class Progress:
    """Progress of a stage's shards: a tqdm bar when stdout is a terminal, else one line per update (done/total,
    rate, ETA, what finished), which is what a log file or `ray job logs` wants."""

    def __init__(self, name: str, total: int, unit: str = "prompts", every: float = 5.0, enabled: bool = True):
        import sys

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
        if self.enabled and (force or now - self._last >= self.every or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            eta_s = f"{eta:,.0f}s" if eta != float("inf") else "?"
            log(self.name).info(f"{self.done}/{self.total} {self.unit} ({rate:.2f}/s, ETA {eta_s}) {extra}".rstrip())


# ---- one task, wherever it runs -----------------------------------------------------------------------------------

def run_task(stage: ShardStage, task: ShardTask, worker: Worker) -> Dict[str, Any]:
    """Process one shard and write it: its rejects first, then the shard, each atomically, so the shard's presence
    is what marks the work done and a reader never sees half of it."""
    t0 = time.perf_counter()
    rejects = Rejects(worker.identity)
    table = stage.process_shard(task.input, rejects)
    expected = (task.rows - len(rejects)) * stage.rows_per_input
    if table.num_rows != expected:  # a stage bug would otherwise pass the done check on a rerun
        raise RuntimeError(f"{stage.name} {task.name}: {table.num_rows} rows for {task.rows} inputs and "
                           f"{len(rejects)} rejects (expected {expected})")
    meta = {**(table.schema.metadata or {}), **encode_metadata(task.metadata)}
    write_jsonl_atomic(rejects, task.rejects)
    write_parquet_atomic(table.replace_schema_metadata(meta), task.output, **stage.parquet_options(table))
    return {"shard": task.name, "rows": table.num_rows, "rejects": len(rejects), "worker": worker.identity,
            "seconds": round(time.perf_counter() - t0, 3)}


# ---- executors ----------------------------------------------------------------------------------------------------

Done = Callable[[ShardTask, Optional[Dict[str, Any]], Optional[str]], None]


@dataclass
class Execution:
    workers: List[Dict[str, Any]]
    failures: List[str]  # "part-NNNNN.parquet: why"


class LocalExecutor:
    """Every task in this process, one after another; a failing task is retried ``retries`` times."""

    def __init__(self, retries: int = 0, identity: str = "driver"):
        self.retries, self.identity = retries, identity

    def run(self, stage: ShardStage, tasks: List[ShardTask], done: Done) -> Execution:
        worker = Worker(self.identity)
        stage.setup(worker)
        failures = []
        for task in tasks:
            for attempt in range(self.retries + 1):
                try:
                    done(task, run_task(stage, task, worker), None)
                    break
                except Exception as err:  # noqa: BLE001 - one shard's failure must not stop the others
                    error = f"{type(err).__name__}: {err}"
                    log(stage.name).warning(f"{task.name} attempt {attempt + 1}/{self.retries + 1} failed: {error}")
            else:
                failures.append(f"{task.name}: {error}")
                done(task, None, error)
        return Execution([], failures)


# ---- the stage folder ---------------------------------------------------------------------------------------------

STANDARD_OUTPUTS = (MANIFEST, REJECTS, SUMMARY, CARD, SUCCESS)


class StageFolder:
    """One stage's output folder: writable check, fingerprint and drift, skip-if-complete, stale temp files,
    ``summary.json`` and ``_SUCCESS``. Used by :func:`run_stage` and directly by train and report."""

    def __init__(self, path: Path, stage: str, extra_outputs: Sequence[str] = ()):
        self.path = location(path)
        self.stage = stage
        self.extra_outputs = tuple(extra_outputs)

    def ensure_writable(self) -> None:
        """Fail before any work when the folder cannot be created or written."""
        import uuid

        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-probe-{uuid.uuid4().hex[:8]}"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise PermissionError(f"output folder {self.path} is not writable: {err.strerror or err}") from None

    def has_output(self) -> bool:
        return (bool(list_shards(self.path)) or is_complete(self.path)
                or any((self.path / p).exists() for p in self.extra_outputs))

    def previous_summary(self, fingerprint: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """The summary of a complete run with this fingerprint whose shards are all still intact, else None."""
        if fingerprint is None or not is_complete(self.path):
            return None
        try:
            if json.loads((self.path / FINGERPRINT).read_text()) != normalise(fingerprint):
                return None
            summary = json.loads((self.path / SUMMARY).read_text())
            manifest_path = self.path / MANIFEST
            if manifest_path.exists():
                manifest = json.loads(manifest_path.read_text())
                sha = fingerprint_sha256(fingerprint)
                if not all(shard_intact(self.path / f["file"], f["rows"], sha) for f in manifest["files"]):
                    return None
        except Exception:  # noqa: BLE001 - anything unreadable means: not complete, redo what is needed
            return None
        return summary

    def skipped(self, summary: Dict[str, Any], t0: float) -> Dict[str, Any]:
        rows = f" ({summary['rows']} rows)" if "rows" in summary else ""
        log(self.stage).info(f"{self.path}: skipped: complete{rows}")
        return {**summary, "status": "skipped: complete", "skipped": True,
                "wall_seconds": round(time.monotonic() - t0, 2)}

    def bind(self, fingerprint: Optional[Dict[str, Any]], force: bool) -> None:
        """Record the fingerprint; refuse output of another config unless ``force`` (which discards it)."""
        if fingerprint is None:
            return
        if check_fingerprint(self.path, fingerprint, force, self.has_output()):
            log(self.stage).warning(f"force=true: config changed, discarding the earlier output in {self.path}")
            self.discard()

    def discard(self) -> None:
        for p in list_shards(self.path):
            p.unlink()
        rmtree(self.path / REJECTS_DIR)
        for name in (*STANDARD_OUTPUTS, *self.extra_outputs):
            p = self.path / name
            rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)

    def start(self, cfg) -> str:
        """The folder is about to change: no longer complete, temp files of killed writers gone, this run's
        resolved config written. Returns the config's sha256."""
        from pipeline.runtime.config import write_resolved

        (self.path / SUCCESS).unlink(missing_ok=True)
        for folder in (self.path, self.path / REJECTS_DIR):
            for stale in folder.glob(".*.tmp-*"):  # left by a writer killed mid-write
                stale.unlink(missing_ok=True)
        return write_resolved(cfg, self.path)

    def complete(self, summary: Dict[str, Any], card: Optional[str] = None) -> None:
        if card is not None:
            write_text_atomic(FRONT_MATTER + card, self.path / CARD)
        write_json_atomic(summary, self.path / SUMMARY)
        mark_complete(self.path)  # last: everything above is in place


def mark_complete(folder: Path) -> None:
    write_text_atomic("", location(folder) / SUCCESS)


def require_complete(required: Iterable[Tuple[Path, str]]) -> None:
    for folder, command in required:
        if not is_complete(folder):
            raise FileNotFoundError(f"no complete output in {folder} (run `{command}` first)")


# ---- manifest -----------------------------------------------------------------------------------------------------

def _counts(records: List[Dict[str, Any]], key: str) -> Dict[str, int]:
    return dict(Counter(r[key] for r in records if r.get(key) is not None))


def write_manifest(stage: ShardStage, tasks: List[ShardTask], fingerprint: Dict[str, Any],
                   workers: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The one manifest format. Reads what is on disk (so it also describes an interrupted run's shards), gathers
    the reject files into ``rejects.jsonl``, and keeps the workers of earlier runs that wrote some shards."""
    folder = stage.folder
    files, rejects = [], read_jsonl(folder / REJECTS_DIR / INPUT_REJECTS)
    for t in tasks:
        p = location(t.output)
        if not p.exists():
            continue
        shard_rejects = read_jsonl(t.rejects)
        rejects.extend(shard_rejects)
        files.append({"file": p.name, "rows": parquet_file(p).metadata.num_rows, "bytes": size(p),
                      "sha256": file_sha256(p), "rejects": len(shard_rejects), "input_rows": t.rows})
    write_jsonl_atomic(rejects, folder / REJECTS)
    if (folder / MANIFEST).exists():
        try:
            earlier = json.loads((folder / MANIFEST).read_text()).get("workers", [])
        except ValueError:
            earlier = []
        seen = {(w.get("identity"), w.get("pid")) for w in workers}
        workers = [w for w in earlier if (w.get("identity"), w.get("pid")) not in seen] + list(workers)
    manifest = {
        "manifest_version": MANIFEST_VERSION, "stage": stage.name, "schema_version": stage.schema_version,
        "files": files, "rows": sum(f["rows"] for f in files), "shards": len(files),
        "rejects": len(rejects), "rejects_file": REJECTS,
        "rejects_by_reason": _counts(rejects, "reason"), "rejects_by_source": _counts(rejects, "source"),
        # A worker with many decode errors (a bad GPU, OOM on long prompts) stands out here.
        "rejects_by_worker": _counts(rejects, "worker"),
        "fingerprint": normalise(fingerprint), "fingerprint_sha256": fingerprint_sha256(fingerprint),
        "workers": workers,
        "summary": stage.summarize([location(t.output) for t in tasks if location(t.output).exists()]),
        **stage.manifest_extras(),
    }
    write_json_atomic(manifest, folder / MANIFEST)
    return manifest


# ---- the driver ---------------------------------------------------------------------------------------------------

def run_stage(stage: ShardStage, executor=None) -> Dict[str, Any]:
    """Run ``stage`` to completion (or skip it when it is complete) and return its summary.

    A rerun after any failure processes only the shards whose output is missing or invalid; shards that failed are
    listed in the error, and the folder stays without ``_SUCCESS`` until a rerun completes it.
    """
    t0 = time.monotonic()
    require_complete(stage.requires())
    folder = StageFolder(stage.folder, stage.name, stage.extra_outputs)
    folder.ensure_writable()
    fp = stage.fingerprint()
    previous = folder.previous_summary(fp)
    if previous is not None:
        return folder.skipped(previous, t0)
    stage.check()
    folder.bind(fp, stage.cfg.force)
    config_sha = folder.start(stage.cfg)

    plan = stage.plan()
    todo = _place(stage, plan, {"stage": stage.name, "fingerprint_sha256": fingerprint_sha256(fp),
                                "config_sha256": config_sha, "package_version": __version__})
    execution = _execute(stage, todo, executor)
    manifest = write_manifest(stage, plan.tasks, fp, execution.workers)
    if execution.failures:
        names = [f.split(":", 1)[0] for f in execution.failures]
        log(stage.name).error(f"{len(names)} shard(s) failed: {names}; rerun `blockpilot {stage.name}` to retry them")
        raise RuntimeError(f"{stage.name}: {len(names)} shard(s) failed after retries: "
                           + "; ".join(execution.failures))
    if manifest["rows"] == 0 and manifest["rejects"]:
        first = read_jsonl(stage.folder / REJECTS)[0].get("detail")
        raise RuntimeError(f"{stage.name}: every row failed ({manifest['rejects']} rejects; first: {first})")
    return _complete(stage, folder, manifest, execution, t0)


def _place(stage: ShardStage, plan: Plan, stamp: Dict[str, Any]) -> List[ShardTask]:
    """Give every planned task its output paths and metadata stamp, write the input rejects, remove shards the
    plan no longer has, and return the tasks whose output is not done yet (the to-do list)."""
    rejects_dir = stage.folder / REJECTS_DIR
    rejects_dir.mkdir(parents=True, exist_ok=True)
    if plan.rejects or (rejects_dir / INPUT_REJECTS).exists():  # only stages that reject before sharding have one
        write_jsonl_atomic(plan.rejects, rejects_dir / INPUT_REJECTS)
    for t in plan.tasks:
        t.output = str(stage.folder / t.name)
        t.rejects = str(rejects_dir / (t.name.rsplit(".", 1)[0] + ".jsonl"))
        t.metadata = {**t.metadata, **stamp}
    planned = {t.name for t in plan.tasks}
    for stale in list_shards(stage.folder):  # from a run with more shards (force with another shard size)
        if stale.name not in planned:
            stale.unlink()
            (rejects_dir / (stale.name.rsplit(".", 1)[0] + ".jsonl")).unlink(missing_ok=True)
    todo = [t for t in plan.tasks if not output_shard_valid(
        t.output, t.rows, t.rejects, stamp["fingerprint_sha256"], stage.rows_per_input)]
    described = f"{stage.describe()}: " if stage.describe() else ""
    log(stage.name).info(f"{described}{len(todo)}/{len(plan.tasks)} shards ({sum(t.rows for t in todo)} "
                         f"{stage.unit}) to do")
    return todo


def _execute(stage: ShardStage, todo: List[ShardTask], executor) -> Execution:
    if not todo:
        return Execution([], [])
    executor = executor or LocalExecutor(stage.resources().max_retries)
    progress = Progress(stage.name, sum(t.rows for t in todo), stage.unit, every=0, enabled=stage.cfg.progress)

    def done(task: ShardTask, result: Optional[Dict[str, Any]], error: Optional[str]) -> None:
        extra = f"FAILED: {error}" if result is None else \
            f"rows={result['rows']} rejects={result['rejects']} by {result['worker']}"
        progress.update(task.rows, f"{task.name} {extra}")

    return executor.run(stage, todo, done)


def _complete(stage: ShardStage, folder: StageFolder, manifest: Dict[str, Any], execution: Execution,
              t0: float) -> Dict[str, Any]:
    """The stage's derived outputs, summary.json, the card, then _SUCCESS; prints the summary."""
    summary = {"stage": stage.name, "status": "done", "skipped": False, "output": str(stage.folder),
               "rows": manifest["rows"], "shards": manifest["shards"], "rejects": manifest["rejects"],
               "rejects_by_reason": manifest["rejects_by_reason"],
               "rejects_by_worker": manifest["rejects_by_worker"], **manifest["summary"],
               "workers": execution.workers}
    summary.update(stage.finalize(manifest))
    summary["wall_seconds"] = round(time.monotonic() - t0, 2)
    card = stage.card(manifest)
    folder.complete(summary, None if card is None else card.rstrip("\n") + "\n\n" + layout_doc())
    reasons = ", ".join(f"{k} {v}" for k, v in summary["rejects_by_reason"].items()) or "none"
    log(stage.name).info(f"done: {summary['rows']} rows in {summary['shards']} shard(s); {summary['rejects']} "
                         f"rejects ({reasons}); {summary['wall_seconds']} s -> {stage.folder}")
    for line in stage.summary_lines(summary):
        log(stage.name).info(line)
    return summary


def tasks_from_shards(folder: Path) -> List[ShardTask]:
    """One task per input shard, named like it: ``part-N`` in, ``part-N`` out."""
    return [ShardTask(p.name, str(p), parquet_file(p).metadata.num_rows, metadata={"input_shard": p.name})
            for p in list_shards(folder)]


def numbered_tasks(chunks: Sequence[Any], rows: Callable[[Any], int] = len) -> List[ShardTask]:
    """One task per in-memory chunk, ``part-00000`` upwards."""
    return [ShardTask(shard_name(i), chunk, rows(chunk)) for i, chunk in enumerate(chunks)]
