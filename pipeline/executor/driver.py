"""The stage driver: the folder bookkeeping of every shard stage, in one place.

A stage (:class:`pipeline.executor.stage.ShardStage`) declares its fingerprint, plan, setup, ``process_shard`` and
resources; :func:`run_stage` owns the rest, the same way for every stage: required inputs, the writable check,
skip-if-complete, the folder's lease (one writer per folder, :mod:`pipeline.executor.lease`), fingerprint and drift
refusal (``force``), stale temp files, the to-do list (a kept shard must be the one recorded when it was written:
its listed stamp, else its sha256), the executor and its retries, the atomic reject + checksum + shard writes, one
manifest format, one rejects layout, ``summary.json``, the dataset card and ``_SUCCESS``. Stages that are not
shard-shaped (train, report) use :class:`pipeline.executor.folder.StageFolder` for the same bookkeeping.

Ray-free: the Ray actor pool is an executor in ``pipeline/executor/ray/pool.py``;
:class:`pipeline.executor.local.LocalExecutor` runs a stage in this process (prepare, and the driver's own tests).
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Tuple

from pipeline import __version__
from pipeline.executor.card import front_matter, layout_doc
from pipeline.executor.failures import RETRIED_REASONS
from pipeline.executor.folder import StageFolder, require_complete
from pipeline.executor.local import Execution, LocalExecutor
from pipeline.executor.manifest import write_manifest
from pipeline.executor.progress import Progress
from pipeline.executor.stage import Plan, ShardStage, ShardTask
from pipeline.io.layout import CHECKSUMS_DIR, INPUT_REJECTS, MANIFEST, REJECTS, REJECTS_DIR
from pipeline.io.shards import (fingerprint_sha256, output_shard_problem, read_jsonl, read_listed_jsonl, read_sidecar,
                                recorded_stamps, shard_names, write_jsonl_atomic)
from pipeline.io.storage import listing, parallel_map
from pipeline.runtime.log import get as log

PROGRESS_EVERY = 60.0  # seconds between progress lines off a terminal


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
    try:
        folder.bind(fp, stage.cfg.force)  # takes the folder's lease first: one writer per folder
        config_sha = folder.start(stage.cfg)
        plan = stage.plan()
        todo, kept = _place(stage, plan, {"stage": stage.name, "fingerprint_sha256": fingerprint_sha256(fp),
                                          "config_sha256": config_sha, "package_version": __version__})
        execution = _execute(stage, todo, executor)
        folder.check_lease()  # another run took the folder over meanwhile: publish nothing over its work
        manifest = write_manifest(stage, plan.tasks, fp, execution.workers, kept)
        if execution.failures:
            names = [f.split(":", 1)[0] for f in execution.failures]
            log(stage.name).error(f"{len(names)} shard(s) failed: {names}; rerun `blockpilot {stage.name}` to "
                                  "retry them")
            raise RuntimeError(f"{stage.name}: {len(names)} shard(s) failed after retries: "
                               + "; ".join(execution.failures))
        _check_visible(stage, plan.tasks, manifest)
        if manifest["rows"] == 0 and manifest["rejects"]:
            first = read_jsonl(stage.folder / REJECTS)[0].get("detail")
            raise RuntimeError(f"{stage.name}: every row failed ({manifest['rejects']} rejects; first: {first})")
        _check_rejects(stage, manifest)
        return _complete(stage, folder, manifest, execution, t0)
    finally:
        folder.release()


def _check_visible(stage: ShardStage, tasks: List[ShardTask], manifest: Dict[str, Any]) -> None:
    """No _SUCCESS over rows the driver cannot see: every planned shard either failed (raised above) or was written,
    by this run or an earlier one, so one missing from what the driver reads (the manifest) was written where the
    driver cannot read it (a disk mounted on the workers' nodes, not on the driver's). Refuses, naming the path."""
    seen = {f["file"] for f in manifest["files"]}
    unseen = [t for t in tasks if t.name not in seen]
    if unseen:
        raise RuntimeError(f"{stage.name}: {len(unseen)} of {len(tasks)} shard(s) were reported written by the "
                           f"workers but the driver cannot see them, e.g. {unseen[0].output}: output_dir must be "
                           "storage that every worker and the driver share (a disk mounted on every node, the "
                           "head's too, or object storage); nothing was published (no _SUCCESS)")


def _check_rejects(stage: ShardStage, manifest: Dict[str, Any]) -> None:
    """Fails the stage, with no _SUCCESS, when its decoding rejects (RETRIED_REASONS) pass the stage's
    ``max_reject_fraction()`` of its input rows (the key STAGE.max_reject_fraction: label's), naming each worker's count: many
    failed prompts mean a broken worker or a bad setting, not bad prompts. The shards stay, and a rerun retries
    the rejected prompts."""
    limit = stage.max_reject_fraction()
    rejects = [r for r in read_jsonl(stage.folder / REJECTS) if r.get("reason") in RETRIED_REASONS] \
        if limit is not None and manifest["rejects"] else []
    total = manifest["rows"] // max(1, stage.rows_per_input) + manifest["rejects"]
    if not rejects or len(rejects) <= limit * total:
        return
    by_worker: Dict[str, int] = {}
    for r in rejects:
        by_worker[r.get("worker") or "?"] = by_worker.get(r.get("worker") or "?", 0) + 1
    workers = ", ".join(f"{w}: {n}" for w, n in sorted(by_worker.items(), key=lambda kv: -kv[1]))
    raise RuntimeError(f"{stage.name}: {len(rejects)} of {total} prompts failed to decode ({len(rejects) / total:.1%}, "
                       f"over {stage.name}.max_reject_fraction = {limit:.1%}) by worker: "
                       f"{workers}; first: {rejects[0].get('detail')}. Rerun `blockpilot {stage.name}` to retry "
                       "them (their shards are redone)")


def _recorded(folder, listed: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """file -> its entry in the folder's manifest, if any, with the manifest's fingerprint and the stamp it was last
    listed with: the fallback record for a shard whose sidecar has no stamp (or none at all: written before sidecars
    existed)."""
    if MANIFEST not in listed:
        return {}
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        stamps = recorded_stamps(folder, listed)
        return {f["file"]: {**f, "fingerprint_sha256": manifest.get("fingerprint_sha256"),
                            "stamp": stamps.get(f["file"])} for f in manifest["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _place(stage: ShardStage, plan: Plan, meta: Dict[str, Any]) -> Tuple[List[ShardTask], Dict[str, Dict]]:
    """Give every planned task its output paths and metadata ``meta``, write the input rejects, remove shards the
    plan no longer has, and return the tasks whose output is not done yet (the to-do list) with the sidecars read
    of the shards kept (name -> sidecar, for the manifest).

    One listing each of the folder, its reject files and its sidecars; then, in parallel, one read of each shard's
    sidecar and of its reject file where that is not empty. A kept shard must be the one recorded when it was
    written: its listed size and stamp equal its sidecar's (else its manifest entry's), and it is not read; any
    other shard is checked the full way, footer and sha256 (pipeline.io.shards.shard_problem)."""
    rejects_dir, checksums = stage.folder / REJECTS_DIR, stage.folder / CHECKSUMS_DIR
    rejects_dir.mkdir(parents=True, exist_ok=True)
    checksums.mkdir(parents=True, exist_ok=True)
    shards, rejected, sidecars = listing(stage.folder), listing(rejects_dir), listing(checksums)
    if plan.rejects or INPUT_REJECTS in rejected:  # only stages that reject before sharding have one
        write_jsonl_atomic(plan.rejects, rejects_dir / INPUT_REJECTS)
    for t in plan.tasks:
        stem = t.name.rsplit(".", 1)[0]
        t.output = str(stage.folder / t.name)
        t.rejects = str(rejects_dir / (stem + ".jsonl"))
        t.checksum = str(checksums / (stem + ".json"))
        t.metadata = {**t.metadata, **meta}
    planned = {t.name for t in plan.tasks}
    for stale in shard_names(shards):  # from a run with more shards (force with another shard size)
        if stale not in planned:
            (stage.folder / stale).unlink()
            stem = stale.rsplit(".", 1)[0]
            (rejects_dir / (stem + ".jsonl")).unlink(missing_ok=True)
            (checksums / (stem + ".json")).unlink(missing_ok=True)
    earlier = _recorded(stage.folder, shards)

    def check(t: ShardTask) -> Tuple[str, Optional[Dict[str, Any]]]:
        if t.name not in shards:
            return "missing", None
        stem = t.name.rsplit(".", 1)[0]
        side = read_sidecar(t.checksum) if stem + ".json" in sidecars else None
        entry = earlier.get(t.name) or {}
        sha = (side or {}).get("sha256") or entry.get("sha256")
        # The manifest's record stands in for a sidecar without a stamp only when both describe the same write: a
        # sidecar published for a shard that was then never written (a kill) must not let the older shard pass.
        recorded = side if side and side.get("stamp") else entry if entry.get("sha256") == sha else None
        rejects = read_listed_jsonl(t.rejects, rejected.get(stem + ".jsonl"))
        why = output_shard_problem(t.output, t.rows, rejects, meta["fingerprint_sha256"], stage.rows_per_input, sha,
                                   RETRIED_REASONS, recorded, shards[t.name])
        # Kept: its bytes are the sidecar's, now with the stamp just listed (a shard touched since, and hashed here,
        # is then recorded in the manifest as it is, and not hashed again).
        return why, side and {**side, "stamp": shards[t.name]["stamp"]}

    todo, kept = [], {}
    for t, (why, side) in zip(plan.tasks, parallel_map(check, plan.tasks)):
        if not why:
            kept[t.name] = side
            continue
        todo.append(t)
        if why != "missing":
            log(stage.name).warning(f"{t.name}: redoing it: {why}")
    described = f"{stage.describe()}: " if stage.describe() else ""
    # Shown where it says something: a stage that describes its work (label, tune, evaluate), or a rerun that keeps
    # shards; a fresh in-process stage (prepare) goes straight to its done line, which counts the same shards.
    say = log(stage.name).info if described or len(todo) < len(plan.tasks) else log(stage.name).debug
    say(f"{described}{len(todo)}/{len(plan.tasks)} shards ({sum(t.rows for t in todo)} {stage.unit}) to do")
    return todo, kept


def _execute(stage: ShardStage, todo: List[ShardTask], executor) -> Execution:
    if not todo:
        return Execution([], [])
    executor = executor or LocalExecutor(stage.resources().max_retries)
    # Off a terminal, a line at most every PROGRESS_EVERY seconds (one per shard made the default run's log 16 lines
    # per stage), none at the end (the done line follows); a failed shard always gets its line.
    progress = Progress(stage.name, sum(t.rows for t in todo), stage.unit, every=PROGRESS_EVERY,
                        enabled=stage.cfg.progress)

    def done(task: ShardTask, result: Optional[Dict[str, Any]], error: Optional[str]) -> None:
        extra = f"FAILED: {error}" if result is None else \
            f"rows={result['rows']} rejects={result['rejects']} by {result['worker']}"
        progress.update(task.rows, f"{task.name} {extra}", force=result is None)

    return executor.run(stage, todo, done)


def _complete(stage: ShardStage, folder: StageFolder, manifest: Dict[str, Any], execution: Execution,
              t0: float) -> Dict[str, Any]:
    """The stage's derived outputs, summary.json, the card, then _SUCCESS; prints the summary."""
    summary = {"stage": stage.name, "status": "done", "skipped": False, "output": str(stage.folder),
               "rows": manifest["rows"], "shards": manifest["shards"], "rejects": manifest["rejects"],
               "rejects_by_reason": manifest["rejects_by_reason"],
               "rejects_by_worker": manifest["rejects_by_worker"], **manifest["summary"],
               "workers": execution.workers}
    if execution.faults:
        summary["faults"] = execution.faults
    summary.update(stage.finalize(manifest))
    summary["wall_seconds"] = round(time.monotonic() - t0, 2)
    card = stage.card(manifest)
    # The front matter carries the folder's content hash, so that `datasets` caches each folder's rows apart.
    folder.complete(summary, None if card is None else
                    front_matter(manifest) + card.rstrip("\n") + "\n\n" + layout_doc())
    reasons = ", ".join(f"{k} {v}" for k, v in summary["rejects_by_reason"].items()) or "none"
    log(stage.name).info(f"done: {summary['rows']} rows in {summary['shards']} shard(s); {summary['rejects']} "
                         f"rejects ({reasons}); {summary['wall_seconds']} s -> {stage.folder}")
    if execution.faults:
        log(stage.name).warning(fault_line(execution.faults))
    for line in stage.summary_lines(summary):
        log(stage.name).info(line)
    return summary


def fault_line(faults: Dict[str, Any]) -> str:
    """The closing line's account of what faults cost (summary.json's ``faults``), e.g. "faults cost: 2 worker
    restart(s), 1 worker retired (node/gpu3: ...), 1 prompt rejected as breaks_device (p-17)"."""
    parts = []
    if faults.get("restarted"):
        parts.append(f"{len(faults['restarted'])} worker restart(s) ("
                     + ", ".join(sorted({r['worker'] for r in faults['restarted']})) + ")")
    for key, what in (("retired", "retired"), ("left_out", "left out by the preflight")):
        if faults.get(key):
            parts.append(f"{len(faults[key])} worker(s) {what} ("
                         + "; ".join(f"{r['worker']}: {r['why'][:120]}" for r in faults[key]) + ")")
    if faults.get("taken_back"):
        parts.append(f"{len(faults['taken_back'])} shard(s) taken back past their deadline ("
                     + ", ".join(f"{t['shard']} from {t['worker']} after {t['seconds']} s"
                                 for t in faults["taken_back"]) + ")")
    if faults.get("prompts_refused"):
        parts.append(f"{len(faults['prompts_refused'])} prompt(s) rejected as breaks_device ("
                     + ", ".join(sorted(faults["prompts_refused"])) + ")")
    return "faults cost: " + ", ".join(parts) + "; every other prompt done"
