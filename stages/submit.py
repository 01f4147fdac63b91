"""``blockpilot submit``: run a stage on a Ray cluster as a Ray job.

    blockpilot submit STAGE [-c FILE|published:NAME] [key=value ...] [--address URL] [--python PY] [--no-wait]

What is uploaded (the checkout, less what does not belong in it) is :mod:`stages.upload`'s rule; ``--dry-run`` also
prints what each part of the stage asks Ray for (:func:`pipeline.executor.ray.placement.ray_asks`). Ray is imported only inside
functions.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

from .job_guard import is_relative, relative_output_dir_error
from .upload import RAY_UPLOAD_CAP, SubmitError, UploadPlan, check_size, find_checkout, mib, plan_upload

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Stages with an entrypoint under jobs/ (report runs where the run folder is: `blockpilot report`).
JOB_STAGES = ("prepare", "label", "train", "tune", "evaluate", "run")

SUBMIT_DESCRIPTION = f"""\
Submit `python jobs/STAGE.py [-c ...] [key=value ...]` to a Ray cluster's job server with the checkout as the
job's working_dir, then follow the job's logs until it ends (exit 0 if it SUCCEEDED, 1 otherwise; --no-wait prints
the job id and returns). Exit 2: refused before contacting the cluster (bad config, a relative output_dir, upload
too big).

What is uploaded (Ray caps a working_dir package at {RAY_UPLOAD_CAP // 1024 ** 2} MiB):
  git checkout: only the top-level entries that hold a tracked file (jobs/, pipeline/, stages/, ...);
    every other top-level file or folder (venv/, data/, checkpoints/, ...) stays here, whatever its name.
    Untracked files inside those folders go too, unless .gitignore or a .rayignore excludes them.
  not a git checkout: everything not matched by .gitignore / .rayignore or Ray's defaults.
  never: .git, __pycache__, the root .gitignore's patterns, any folder holding a pyvenv.cfg (a virtualenv).
The size is printed before submitting; over the cap, nothing is sent and the biggest paths are named.

The config is validated here first. The job runs in a temporary copy of the checkout on the cluster: give an
absolute output_dir on storage the cluster shares, or s3://... (a relative one is refused, here and by the job's
entrypoint). Example:
  blockpilot submit label -c published:qwen3-8b output_dir=/shared/runs/q8 --address http://head:8265"""


# ------------------------------------------------------------------------------------------------------ the command

class _IntermixedParser(argparse.ArgumentParser):
    """Options and key=value overrides in any order: ``submit label -c F a=1 --address U b=2``. (Plain argparse
    takes the positionals in one run: after ``STAGE -c F`` the overrides would be 'unrecognized'.)"""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):
        if self._inner:  # parse_known_intermixed_args calls back here
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The submit subparser's arguments (``p`` comes from the CLI's subparsers; it is made order-tolerant)."""
    p.__class__ = _IntermixedParser
    p.add_argument("target", metavar="STAGE", choices=JOB_STAGES, help=f"one of {', '.join(JOB_STAGES)} "
                   "(runs jobs/STAGE.py on the cluster)")
    p.add_argument("-c", "--config", metavar="FILE|published:NAME",
                   help="as for the stage itself; a file must lie in the checkout (it is uploaded with it), "
                   "or at the same path on the cluster")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, passed to the job")
    p.add_argument("--address", help=f"the job server (dashboard) URL; default $RAY_ADDRESS, else {DEFAULT_ADDRESS}")
    p.add_argument("--python", default="python", metavar="PY",
                   help="the interpreter that runs the entrypoint on the cluster (default: python, as found on the "
                   "cluster's PATH)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return, without following the job")
    p.add_argument("--working-dir", metavar="DIR", help="the checkout to upload (default: the one this blockpilot "
                   "runs from, else the current folder or a parent holding jobs/ and pipeline/)")
    p.add_argument("--dry-run", action="store_true", help="print what would be uploaded and the entrypoint; "
                   "submit nothing")


def _config_arg(config: Optional[str], root: Path, plan: UploadPlan) -> Optional[str]:
    """The -c value as the job sees it (its cwd is the uploaded root): a path inside the checkout becomes relative
    to the root and must be part of the upload; a published name passes as is."""
    if config is None or config.startswith("published:"):
        return config
    path = Path(config).expanduser().resolve()
    if not path.is_file():
        raise SubmitError(f"config file not found: {config}")
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        print(f"blockpilot submit: note: {config} is outside the checkout and not uploaded; the job reads {path} on "
              "the cluster", file=sys.stderr)
        return str(path)
    if rel not in plan.files:
        raise SubmitError(f"config file {config} is in the checkout but not uploaded (it lies in an excluded "
                          f"folder: {', '.join(r for r, _ in plan.skipped) or 'an ignore file'}); move it into a "
                          "tracked folder or git add it")
    return rel


def entrypoint(stage: str, python: str, config: Optional[str], overrides: Iterable[str]) -> str:
    args = [python, f"jobs/{stage}.py", *(["-c", config] if config is not None else []), *overrides]
    return " ".join(shlex.quote(a) for a in args)


def resolve_address(address: Optional[str]) -> str:
    return address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


def submit_command(args: argparse.Namespace) -> int:
    """``blockpilot submit``: 0 when the job SUCCEEDED (or was submitted with --no-wait), 1 when it did not or could
    not be submitted, 2 when refused before contacting the cluster (bad config, a relative output_dir, too big an
    upload)."""
    from pipeline.runtime.config import ConfigError, load_config

    err = sys.stderr
    try:
        root = find_checkout(Path(args.working_dir) if args.working_dir else None)
        if not (root / "jobs" / f"{args.target}.py").is_file():
            raise SubmitError(f"{root}/jobs/{args.target}.py not found: is {root} a blockpilot checkout?")
        plan = plan_upload(root)
        if f"jobs/{args.target}.py" not in plan.files:
            raise SubmitError(f"jobs/{args.target}.py would not be uploaded ({plan.rule}): is it tracked?")
        config = _config_arg(args.config, root, plan)
        try:  # the job would fail the same way, after the upload: fail here instead
            cfg = load_config(list(args.overrides), args.config)
        except ConfigError as e:
            raise SubmitError(str(e)) from None
        if is_relative(cfg.output_dir):  # the job refuses it too (stages.cli), after the upload: refuse it here
            raise SubmitError(relative_output_dir_error(cfg.output_dir))
        print(f"blockpilot submit: uploading {root} ({plan.rule}): {len(plan.files)} files, "
              f"{mib(plan.package_bytes)} (Ray's cap: {mib(RAY_UPLOAD_CAP)})", file=err)
        if plan.skipped:
            print("  not uploaded: " + ", ".join(f"{rel} ({why})" for rel, why in plan.skipped), file=err)
        check_size(plan)
    except SubmitError as e:
        print(f"blockpilot submit: error: {e}", file=err)
        return 2
    command = entrypoint(args.target, args.python, config, args.overrides)
    address = resolve_address(args.address)
    runtime_env = {"working_dir": str(root), "excludes": plan.excludes}
    print(f"blockpilot submit: entrypoint: {command}", file=err)
    if args.dry_run:
        from pipeline.executor.ray.placement import ray_asks

        for line in ray_asks(cfg, args.target):
            print(f"  asks: {line}", file=err)
        print(f"blockpilot submit: dry run, nothing submitted (address {address}); excludes: {plan.excludes}",
              file=err)
        return 0
    return _submit(address, command, runtime_env, wait=not args.no_wait)


def _submit(address: str, command: str, runtime_env: dict, wait: bool) -> int:
    from ray.job_submission import JobSubmissionClient

    err = sys.stderr
    try:
        client = JobSubmissionClient(address)
        job_id = client.submit_job(entrypoint=command, runtime_env=runtime_env)
    except Exception as e:  # connection refused, 413 if the estimate was off, auth, ...
        print(f"blockpilot submit: error: submitting to {address} failed: {e}", file=err)
        return 1
    if not wait:
        print(job_id, flush=True)
        return 0
    print(f"blockpilot submit: job {job_id} submitted to {address}; following its logs (Ctrl-C stops following, "
          "not the job)", file=err, flush=True)
    try:
        status = _follow(client, job_id)
    except KeyboardInterrupt:
        print(f"\nblockpilot submit: stopped following; job {job_id} keeps running "
              f"(ray job logs -f {job_id} --address {address}; ray job stop {job_id} --address {address})", file=err)
        return 130
    if status == "SUCCEEDED":
        print(f"blockpilot submit: job {job_id} succeeded", file=err, flush=True)
        return 0
    message = ""
    try:
        info = client.get_job_info(job_id)
        message = f": {info.message}" if info.message else ""
    except Exception:
        pass
    print(f"blockpilot submit: job {job_id} ended {status}{message}", file=err, flush=True)
    return 1


def _follow(client, job_id: str):
    """Print the job's logs until it ends; return its final status."""
    import asyncio

    from ray.job_submission import JobStatus

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            sys.stdout.write(lines)
            sys.stdout.flush()

    try:
        asyncio.run(tail())
    except RuntimeError as e:  # the log stream broke off: keep waiting on the status
        print(f"blockpilot submit: warning: log stream lost ({e}); waiting for the job to end", file=sys.stderr)
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    while True:
        status = client.get_job_status(job_id)
        if status in terminal:
            return getattr(status, "value", status)
        time.sleep(1)
