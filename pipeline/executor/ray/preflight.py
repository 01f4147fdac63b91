"""The preflight: what every actor stage runs before its first shard (pipeline.executor.ray.pool_workers), and what
``blockpilot preflight`` (stages/preflight.py) runs alone.

One actor per expected worker checks its node (pipeline.executor.preflight.check_worker: devices, models, versions,
output_dir, the memory plan); the driver waits for them as the cluster comes up (a progress line every
``RayActorPool.progress_s``, at most ``workers.wait_s``), has each read every other's probe under ``output_dir``,
prints one short table and refuses before any work, naming the node and the config key. ``blockpilot preflight``
runs it for the label stage (the main job) and stops there; it runs on a laptop as on a cluster.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from pipeline.executor.preflight import driver_probe, one_line, table, unreadable, verdict, where
from pipeline.runtime.log import get as log, said_before


class PreflightRefused(ValueError):
    """A check failed on some worker: nothing was started (the CLI prints it in one line, after the table).
    ``problems``: every (worker, key, message) that refused."""

    def __init__(self, message: str, problems=()):
        super().__init__(message)
        self.problems = list(problems)


@dataclass
class Report:
    spec: Any
    rows: List[Dict[str, Any]]  # one per actor, in the actors' order
    problems: List[tuple]
    excluded: List[int] = field(default_factory=list)  # the actors (indices) that failed, left out of the run


def enough_pass(passed: int, expected: int, min_fraction: float) -> bool:
    """Whether ``passed`` of ``expected`` workers are enough to go on without the others (workers.min_fraction):
    at least one, and at least that share of the expected, rounded up (with 0.9, all of up to 9 workers, 58 of 64)."""
    return passed >= max(1, math.ceil(min_fraction * expected - 1e-9))


def preflight(run, actors, full_table: bool = False) -> Report:
    """The checks on ``actors`` (PoolActors of ``run``, a pipeline.executor.ray.pool_run.PoolRun); raises
    PreflightRefused. ``full_table``: a row per worker even where they are all alike."""
    stage, place, ray = run.stage, run.place, run.ray
    spec = stage.preflight_spec(place, uuid.uuid4().hex[:12])
    rows = _gather(run, actors, spec)
    probes = [r["probe"] for r in rows if r.get("probe")]
    mine = driver_probe(spec) if probes else None
    if probes:  # every worker reads what the others and the driver wrote, the driver what they wrote
        unseen = set(unreadable(probes))
        for r in rows:
            if r.get("probe") in unseen:
                r["problems"].append(("output_dir", f"the driver cannot read what this worker wrote under "
                                                    f"{spec.output_dir} (the driver's node does not see the "
                                                    "workers' storage: mount it there too, or use object storage)"))
                r["output_dir"] = "w"
        reads = _reads(ray, [a.handle.readable.remote(spec, probes + ([mine] if mine else []))
                             for a, r in zip(actors, rows) if "pid" in r], run.pool.check_s)
        for r, bad in zip([r for r in rows if "pid" in r], reads):
            if bad is None:
                r["problems"].append(("workers.check_timeout_s", f"reading the other workers' probes under "
                                      f"{spec.output_dir} did not finish within workers.check_timeout_s="
                                      f"{run.pool.check_s:g} s (storage not answering)"))
                continue
            others = [b for b in bad if b != mine]
            if others:
                r["problems"].append(("output_dir", f"cannot read what {len(others)} other worker(s) wrote under "
                                                    f"{spec.output_dir} (not storage every node reaches)"))
                r["output_dir"] = "w"
            if mine in bad:
                r["problems"].append(("output_dir", f"cannot read what the driver wrote under {spec.output_dir} "
                                                    "(this node does not see the driver's storage)"))
                r["output_dir"] = "w"
    problems = verdict(spec, rows)
    say = log(stage.name)
    ready = f"preflight: {sum('pid' in r for r in rows)}/{len(actors)} workers"
    short = None if full_table else one_line(rows)
    # in one `blockpilot run`, a later stage whose workers are placed and check out as the previous one's says so
    if short and said_before("workers", (place.describe(), place.note, short)):
        say.info(f"{ready} ({place.why}): placed and checked as the previous stage's")
    elif short:  # a stage's run: identical healthy workers in one line (`blockpilot preflight` prints every row)
        say.info(f"{ready} ({place.describe()}; {place.reason}): {short}")
    else:
        say.info(f"{ready} ({place.describe()}; {place.reason})")
        for line in table(rows):
            say.info("  " + line)
    for line in ((rows[0].get("memory") or {}).get("plan") or "").splitlines():  # the first worker's plan, with -v
        say.debug("  " + line)
    _clean(spec)
    bad = [i for i, r in enumerate(rows) if r.get("problems") or "pid" not in r]
    min_fraction = getattr(getattr(stage.cfg, "workers", None), "min_fraction", 1.0)
    cluster_wide = len({r.get("dtype") for r in rows if r.get("dtype")}) > 1  # no worker to leave out for it
    if problems and bad and not cluster_wide and enough_pass(len(rows) - len(bad), len(rows), min_fraction):
        for i in bad:
            r = rows[i]
            say.warning(f"preflight: worker {where(r)} left out, " + "; ".join(f"{k}: {m}" for k, m in
                                                                             r.get("problems", [])))
        say.warning(f"preflight: {len(rows) - len(bad)} of {len(rows)} workers passed (at least workers.min_fraction"
                    f"={min_fraction:g} of them must): going on without the {len(bad)} above")
        return Report(spec, rows, problems, bad)
    if problems:
        first = "; ".join(f"{w}: {k}: {m}" for w, k, m in problems[:3])
        more = f" (and {len(problems) - 3} more above)" if len(problems) > 3 else ""
        for w, k, m in problems[3:]:
            say.error(f"preflight: {w}: {k}: {m}")
        raise PreflightRefused(f"preflight refused, nothing started: {first}{more}", problems)
    return Report(spec, rows, problems)


def _reads(ray, refs, timeout: float) -> List[Optional[List[str]]]:
    """Each worker's unreadable probes, None for a worker whose reads did not answer within ``timeout``."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    done = set(ready)
    return [ray.get(ref) if ref in done else None for ref in refs]


def _gather(run, actors, spec) -> List[Dict[str, Any]]:
    """Every actor's preflight row. Two clocks: an actor not started (no node with its resources yet) is waited for
    up to workers.wait_s from now; one that started (its ``where`` answered) has workers.check_timeout_s from its
    start for its checks. An actor that never answers gets a row saying which of the two it ran out of."""
    ray, pool, place, say = run.ray, run.pool, run.place, log(run.stage.name)
    # ``where`` first: an actor runs its calls in order, so it answers as soon as the actor's process is up
    starts = {a.handle.where.remote(): i for i, a in enumerate(actors)}
    checks = {a.handle.preflight.remote(spec): i for i, a in enumerate(actors)}
    started: Dict[int, float] = {}  # actor -> when its start was seen
    rows: Dict[int, Dict[str, Any]] = {}
    late: Set[int] = set()  # actors given up on (their deadline passed): not "checked", whatever their row says
    t0 = time.monotonic()
    next_line = t0 + pool.progress_s

    def deadline(i: int) -> float:
        return started[i] + pool.check_s if i in started else t0 + pool.wait_s

    while checks:
        now = time.monotonic()
        for ref, i in list(checks.items()):
            if now >= deadline(i):
                del checks[ref]
                late.add(i)
                rows[i] = _late_row(i, i in started, pool, place, ray)
        if not checks:
            break
        # Wake at each answer, at the next deadline and when a progress line is due: waiting for all of them at once
        # kept the line from being said while the first workers were still starting on a loaded machine.
        wake = min([next_line] + [deadline(i) for i in checks.values()])
        ready, _ = ray.wait(list(checks) + list(starts), num_returns=1, timeout=max(0.05, wake - now))
        for ref in ready:
            if ref in starts:
                started.setdefault(starts.pop(ref), time.monotonic())
                continue
            i = checks.pop(ref)
            started.setdefault(i, time.monotonic())
            try:
                rows[i] = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - its checks themselves broke: said as its problem
                rows[i] = {"identity": f"worker {i}", "problems": [("preflight", f"{type(err).__name__}: "
                                                                                 f"{str(err).splitlines()[-1:]}")]}
        if checks and time.monotonic() >= next_line:
            next_line += pool.progress_s
            checking = sum(i in started for i in checks.values())
            say.info(f"waiting for workers: {len(rows) - len(late)}/{len(actors)} checked, {checking} checking, "
                     f"{len(checks) - checking} not started{f', {len(late)} given up' if late else ''} after "
                     f"{time.monotonic() - t0:.0f} s (each asks "
                     f"{place.asks()}; the cluster: {_resources(ray)}; workers.wait_s={pool.wait_s:g})")
    return [rows[i] for i in range(len(actors))]


def _late_row(i: int, started: bool, pool, place, ray) -> Dict[str, Any]:
    if started:
        return {"identity": f"worker {i}", "problems": [("workers.check_timeout_s", (
            f"started, but its checks did not finish within workers.check_timeout_s={pool.check_s:g} s (hashing a "
            "large local model folder, or storage or the hub not answering): allow longer (workers.check_timeout_s)"
            " or see its log"))]}
    return {"identity": f"worker {i}", "problems": [(place.key, (
        f"not started within workers.wait_s={pool.wait_s:g} s: it asks {place.asks()} and the cluster has "
        f"{_resources(ray)} (nodes not joined yet, or the resources held by another job); wait longer "
        f"(workers.wait_s), add nodes, or ask for fewer workers ({place.key})"))]}


def _resources(ray) -> str:
    try:
        total, free = ray.cluster_resources(), ray.available_resources()
    except Exception:  # noqa: BLE001 - the control store busy: said so
        return "(unknown)"
    keys = [k for k in ("GPU", "CPU") if k in total]
    return ", ".join(f"{k} {free.get(k, 0):g} free of {total[k]:g}" for k in keys) + f", {len(ray.nodes())} nodes"


def _clean(spec) -> None:
    """The probes go once read (best effort: a folder left behind holds a few bytes)."""
    if spec is None or not spec.output_dir:
        return
    from pipeline.io.storage import location, rmtree

    try:
        rmtree(location(spec.output_dir) / ".preflight" / spec.token)
        folder = location(spec.output_dir) / ".preflight"
        if folder.exists() and not any(folder.iterdir()):
            folder.rmdir()
    except Exception:  # noqa: BLE001 - cleaning is not a check
        pass


def late_problems(spec, row: Dict[str, Any]) -> List[tuple]:
    """A worker that starts after the preflight (a joining GPU, a replacement): its own problems and its own probe
    read back (what the others wrote was read at the start)."""
    problems = list(row.get("problems", []))
    if row.get("probe") and unreadable([row["probe"]]):
        problems.append(("output_dir", "the driver cannot read what this worker wrote"))
    return problems
