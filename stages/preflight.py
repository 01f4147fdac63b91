"""``blockpilot preflight``: the label stage's checks on every worker it expects, and nothing else
(pipeline.executor.ray.preflight: the checks every actor stage runs before its first shard)."""

from __future__ import annotations

import time
from typing import Any, Dict

from pipeline.executor.preflight import where
from pipeline.runtime.config import PipelineConfig
from pipeline.runtime.log import get as log


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    """``blockpilot preflight``: the label stage's checks on every worker it expects, and nothing else."""
    from pipeline.executor.ray.pool import RayActorPool
    from pipeline.executor.ray.pool_run import PoolRun
    from pipeline.executor.ray.preflight import preflight
    from pipeline.executor.ray.runtime import init_ray

    from .label import LabelStage

    t0 = time.monotonic()
    stage = LabelStage(cfg)
    ray = init_ray(cfg.ray)
    pool = RayActorPool(cfg.ray, cfg.workers.wait_s, cfg.workers.check_timeout_s)
    pr = PoolRun(pool, ray, stage, [], lambda *a: None)
    log("preflight").info(f"workers: {pr.place.describe()} ({pr.place.reason})")
    actors = [pr.new_actor() for _ in range(pr.place.num_workers)]
    try:
        report = preflight(pr, actors, full_table=True)
    finally:
        pr.kill_all()
    left_out = f", {len(report.excluded)} left out (above; workers.min_fraction={cfg.workers.min_fraction:g})" \
        if report.excluded else ", no problem"
    log("preflight").info(f"done: {len(report.rows)} worker(s) checked{left_out}; {time.monotonic() - t0:.1f} s")
    return {"stage": "preflight", "status": "done", "workers": [where(r) for r in report.rows],
            "left_out": [where(report.rows[i]) for i in report.excluded],
            "rows": report.rows, "placement": pr.place.describe(), "wall_seconds": round(time.monotonic() - t0, 1)}
