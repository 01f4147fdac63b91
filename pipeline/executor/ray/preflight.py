"""The preflight: what every actor stage runs before its first shard (pipeline.executor.ray.pool_workers), and what
``blockpilot preflight`` (stages/preflight.py) runs alone.

One actor per expected worker checks its node (pipeline.executor.preflight.check_worker: devices, models, versions,
output_dir, the memory plan); the driver waits for them as the cluster comes up (a progress line every
``RayActorPool.progress_s``, at most ``workers.wait_s``), has each read every other's probe under ``output_dir``,
prints one short table and refuses before any work, naming the node and the config key. ``blockpilot preflight``
runs it for the label stage (the main job) and stops there; it runs on a laptop as on a cluster.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List

from pipeline.executor.preflight import table, unreadable, verdict
from pipeline.runtime.log import get as log


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


def preflight(run, actors) -> Report:
    """The checks on ``actors`` (PoolActors of ``run``, a pipeline.executor.ray.pool_run.PoolRun); raises PreflightRefused."""
    stage, place, ray = run.stage, run.place, run.ray
    spec = stage.preflight_spec(place, uuid.uuid4().hex[:12])
    rows = _gather(run, actors, spec)
    probes = [r["probe"] for r in rows if r.get("probe")]
    if len(probes) > 1:  # every worker reads what the others wrote: storage every node reaches
        reads = ray.get([a.handle.readable.remote(spec, probes) for a, r in zip(actors, rows) if "pid" in r])
        for r, bad in zip([r for r in rows if "pid" in r], reads):
            if bad:
                r["problems"].append(("output_dir", f"cannot read what {len(bad)} other worker(s) wrote under "
                                                    f"{spec.output_dir} (not storage every node reaches)"))
                r["output_dir"] = "w"
    problems = verdict(spec, rows)
    say = log(stage.name)
    say.info(f"preflight: {sum('pid' in r for r in rows)}/{len(actors)} workers ({place.describe()})")
    for line in table(rows):
        say.info("  " + line)
    for line in ((rows[0].get("memory") or {}).get("plan") or "").splitlines():  # the first worker's plan, with -v
        say.debug("  " + line)
    _clean(spec)
    if problems:
        first = "; ".join(f"{w}: {k}: {m}" for w, k, m in problems[:3])
        more = f" (and {len(problems) - 3} more above)" if len(problems) > 3 else ""
        for w, k, m in problems[3:]:
            say.error(f"preflight: {w}: {k}: {m}")
        raise PreflightRefused(f"preflight refused, nothing started: {first}{more}", problems)
    return Report(spec, rows, problems)


def _gather(run, actors, spec) -> List[Dict[str, Any]]:
    """Every actor's preflight row, waiting for actors still without a node up to workers.wait_s; an actor that
    never answers gets a row saying so."""
    ray, pool, place, say = run.ray, run.pool, run.place, log(run.stage.name)
    refs = {a.handle.preflight.remote(spec): i for i, a in enumerate(actors)}
    rows: Dict[int, Dict[str, Any]] = {}
    t0 = time.monotonic()
    next_line = t0 + pool.progress_s
    while refs and time.monotonic() - t0 < pool.wait_s:
        # Wake at each answer and when a progress line is due: waiting for all of them at once kept the line from
        # being said while the first workers were still starting on a loaded machine.
        now = time.monotonic()
        ready, _ = ray.wait(list(refs), num_returns=1,
                            timeout=max(0.05, min(t0 + pool.wait_s - now, next_line - now)))
        for ref in ready:
            i = refs.pop(ref)
            try:
                rows[i] = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - its checks themselves broke: said as its problem
                rows[i] = {"identity": f"worker {i}", "problems": [("preflight", f"{type(err).__name__}: "
                                                                                 f"{str(err).splitlines()[-1:]}")]}
        if refs and time.monotonic() >= next_line:
            next_line += pool.progress_s
            say.info(f"waiting for workers: {len(rows)}/{len(actors)} up after {time.monotonic() - t0:.0f} s "
                     f"(each asks {place.asks()}; the cluster: {_resources(ray)}; workers.wait_s={pool.wait_s:g})")
    for i in refs.values():
        rows[i] = {"identity": f"worker {i}", "problems": [(place.key, (
            f"not started within workers.wait_s={pool.wait_s:g} s: it asks {place.asks()} and the cluster has "
            f"{_resources(ray)} (nodes not joined yet, or the resources held by another job); wait longer "
            f"(workers.wait_s), add nodes, or ask for fewer workers ({place.key})"))]}
    return [rows[i] for i in range(len(actors))]


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
