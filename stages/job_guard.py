"""A relative ``output_dir`` under a Ray job, refused before any work (``blockpilot submit`` and the stage commands
that the ``jobs/`` entrypoints run).

A Ray job's driver runs in a temporary copy of its working_dir on one node: a relative output_dir would be written
there, out of the other nodes' reach and gone with the copy. Ray imported nowhere here.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

# What tells a Ray job's driver apart: Ray's job supervisor starts the entrypoint with this variable set (the job's
# runtime_env and metadata as JSON; ray/dashboard/modules/job/job_supervisor.py, _get_driver_env_vars). Not
# RAY_JOB_ID: the supervisor removes it from the driver's environment (remove_ray_internal_flags_from_env), it is
# set in Ray's worker processes only.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def in_ray_job(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True in the driver of a Ray job (``ray job submit``, ``blockpilot submit``, a KubeRay RayJob)."""
    return RAY_JOB_ENV in (os.environ if environ is None else environ)


def is_relative(output_dir: str) -> bool:
    """A local path that is not absolute (``runs/x``); object storage (``s3://...``) and ``file:///abs`` are not."""
    from pathlib import Path

    from pipeline.io.storage import location

    where = location(output_dir)
    return isinstance(where, Path) and not where.is_absolute()


def relative_output_dir_error(output_dir: str) -> str:
    """The one-line refusal, the same from ``blockpilot submit`` and from inside a job."""
    return (f"output_dir={output_dir} is relative, and a Ray job runs in a temporary copy of its working dir on one "
            "node: give an absolute path on storage every node shares (output_dir=/shared/runs/NAME) or object "
            "storage (output_dir=s3://BUCKET/runs/NAME)")
