"""Running a stage: in the driver process, or on the Ray actor pool (:mod:`pipeline.executor.ray.pool`) when it declares actors.

The pool's placement is decided when the stage driver first computes the stage's fingerprint: where the models run
(``cuda`` or ``cpu``) is part of what a label folder records, so that shards of different numerics never mix.
"""

from __future__ import annotations

from pipeline.executor.driver import run_stage
from pipeline.executor.stage import ShardStage

from .pool import RayActorPool


def execute(stage: ShardStage):
    """run_stage with the executor the stage's resources ask for."""
    if not stage.resources().actors:
        return run_stage(stage, None)
    stage.on_ray = True  # its placement (stages.decoding.DecodingStage.placement) then comes from the cluster
    return run_stage(stage, RayActorPool(stage.cfg.ray, stage.cfg.workers.wait_s))
