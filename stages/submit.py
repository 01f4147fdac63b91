"""``blockpilot submit``: run a stage on a Ray cluster as a Ray job, uploading only what belongs to the checkout.

    blockpilot submit STAGE [-c FILE|published:NAME] [key=value ...] [--address URL] [--python PY] [--no-wait]

The job's code reaches the cluster as a ``working_dir`` package: Ray zips a local folder and PUTs it to the job
server, which refuses any request body over 100 MiB (``413: Maximum request body size 104857600 exceeded``). A
virtualenv, a data folder or checkpoints lying in the checkout are enough to cross that, so this module decides
what is uploaded instead of leaving it to a hand-written ``excludes`` list:

* ``working_dir`` is the checkout's root (the folder holding ``jobs/`` and ``pipeline/``).
* In a git checkout, only top-level entries (files or folders) that hold at least one tracked file are uploaded;
  every other top-level entry is excluded whatever its name (``venv/``, ``data/``, ``checkpoints/``, ...). Inside
  those partly-tracked folders untracked files still go (a new config or module not yet ``git add``-ed is usually
  what the job needs, and is small); ``.gitignore`` (every level, as Ray reads it) and ``.rayignore`` keep the rest
  out.
* Not a git checkout (or no git): the root ``.gitignore`` patterns, ``.rayignore`` files and Ray's own defaults.
* Always: ``.git``, ``__pycache__``, the root ``.gitignore`` patterns, and every folder that is a virtualenv (it
  holds a ``pyvenv.cfg``) wherever it sits, whatever its name.

The files that remain are walked here with Ray's matching rules (gitwildmatch patterns, pruned at excluded
folders, ignore files read per folder) and summed; the submission is refused before contacting the cluster when
the package would exceed Ray's cap, naming the biggest contributors. Ray is imported only inside functions:
``pipeline`` must import without it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

# The job server (the dashboard's aiohttp app) refuses request bodies over this (ray_constants.
# DASHBOARD_CLIENT_MAX_SIZE); a working_dir package is sent as one body.
RAY_UPLOAD_CAP = 100 * 1024 ** 2
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Stages with an entrypoint under jobs/ (report runs where the run folder is: `blockpilot report`).
JOB_STAGES = ("prepare", "label", "train", "tune", "evaluate", "run")
# Excluded always, whatever git or .gitignore say (recent Ray excludes these by default too; older Ray does not).
ALWAYS_EXCLUDED = [".git", "__pycache__"]
# Ray's own default excludes (ray_constants.RAY_RUNTIME_ENV_DEFAULT_EXCLUDES), used only to predict the package
# when Ray's constant cannot be read; they are not passed on (Ray adds them itself, and a user may override them).
_RAY_DEFAULT_EXCLUDES_FALLBACK = [".git", ".venv", "venv", "__pycache__"]
# Zip overhead per entry (local header 30 B + central directory record 46 B + the name twice), then 22 B at the end:
# Ray's zip stores files uncompressed, so the package is the files' bytes plus this.
_ZIP_ENTRY_OVERHEAD = 76
_ZIP_END = 22


SUBMIT_DESCRIPTION = f"""\
Submit `python jobs/STAGE.py [-c ...] [key=value ...]` to a Ray cluster's job server with the checkout as the
job's working_dir, then follow the job's logs until it ends (exit 0 if it SUCCEEDED, 1 otherwise; --no-wait prints
the job id and returns). Exit 2: refused before contacting the cluster (bad config, upload too big).

What is uploaded (Ray caps a working_dir package at {RAY_UPLOAD_CAP // 1024 ** 2} MiB):
  git checkout: only the top-level entries that hold a tracked file (jobs/, pipeline/, stages/, ...);
    every other top-level file or folder (venv/, data/, checkpoints/, ...) stays here, whatever its name.
    Untracked files inside those folders go too, unless .gitignore or a .rayignore excludes them.
  not a git checkout: everything not matched by .gitignore / .rayignore or Ray's defaults.
  never: .git, __pycache__, the root .gitignore's patterns, any folder holding a pyvenv.cfg (a virtualenv).
The size is printed before submitting; over the cap, nothing is sent and the biggest paths are named.

The config is validated here first. The job runs in a temporary copy of the checkout on the cluster: give an
absolute output_dir on storage the cluster shares. Example:
  blockpilot submit label -c published:qwen3-8b output_dir=/shared/runs/q8 --address http://head:8265"""


class SubmitError(Exception):
    """A submission refused before contacting the cluster (exit status 2)."""


@dataclass
class UploadPlan:
    """What ``working_dir`` upload Ray will make of ``root`` with ``excludes``."""

    root: Path
    rule: str  # how the excludes were chosen, in words
    excludes: List[str]  # passed as runtime_env["excludes"]
    skipped: List[Tuple[str, str]]  # (path relative to root, why) for the folders/files excluded by this module
    files: Dict[str, int] = field(default_factory=dict)  # relative posix path -> bytes, what will be uploaded
    empty_dirs: List[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def package_bytes(self) -> int:
        """The zip's size (uncompressed entries, as Ray writes them)."""
        names = [*self.files, *(d + "/" for d in self.empty_dirs)]
        return (self.total_bytes + sum(_ZIP_ENTRY_OVERHEAD + 2 * len(n.encode()) for n in names) + _ZIP_END)

    def biggest(self, n: int = 8) -> List[Tuple[str, int]]:
        """The paths (folders or files) that weigh most, each the most specific one that explains its weight: a
        folder is left out when one of its children holds >= 90 % of it."""
        sizes: Dict[str, int] = {}
        for rel, size in self.files.items():
            parts = rel.split("/")
            for i in range(1, len(parts) + 1):
                key = "/".join(parts[:i])
                sizes[key] = sizes.get(key, 0) + size
        children: Dict[str, int] = {}  # folder -> its biggest child's size
        for key, size in sizes.items():
            if "/" in key:
                parent = key.rsplit("/", 1)[0]
                children[parent] = max(children.get(parent, 0), size)
        floor = max(1, self.total_bytes // 100)  # what weighs under 1 % of the whole explains nothing
        keep = [(k, s) for k, s in sizes.items() if s >= floor and children.get(k, 0) < 0.9 * s]
        keep.sort(key=lambda kv: (-kv[1], kv[0]))
        return [(k + ("/" if k not in self.files else ""), s) for k, s in keep[:n]]


def mib(n: int) -> str:
    return f"{n / 1024 ** 2:.1f} MiB"


# --------------------------------------------------------------------------------------------------------- the rule

def find_checkout(start: Optional[Path] = None) -> Path:
    """The checkout to upload: ``start`` if given, else the one this ``pipeline`` package runs from (an editable
    install), else the current folder or a parent of it holding ``jobs/`` and ``pipeline/``."""
    if start is not None:
        root = Path(start).expanduser().resolve()
        if not root.is_dir():
            raise SubmitError(f"working dir {start} is not a folder")
        return root
    candidates = [Path(__file__).resolve().parent.parent]
    cwd = Path.cwd().resolve()
    candidates += [cwd, *cwd.parents]
    for c in candidates:
        if (c / "jobs").is_dir() and (c / "pipeline").is_dir():
            return c
    raise SubmitError("no blockpilot checkout found (a folder holding jobs/ and pipeline/): run from the checkout "
                      "or pass --working-dir")


def _git_env() -> Dict[str, str]:
    env = dict(os.environ)
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):  # ask about the checkout's own repository
        env.pop(var, None)
    return env


def tracked_top_level(root: Path) -> Optional[Set[str]]:
    """The top-level names under ``root`` that hold a file tracked by git, or None when ``root`` is not in a git
    work tree (or git is missing or refuses, e.g. a repository owned by someone else)."""
    try:
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=root, capture_output=True,
                                text=True, timeout=60, env=_git_env())
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        out = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=root, capture_output=True, timeout=120,
                             env=_git_env())
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    # ls-files run in root lists the tracked paths under root, relative to it, with '/' separators (quoting is off
    # with -z).
    return {p.split("/", 1)[0] for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p}


def gitignore_patterns(root: Path) -> List[str]:
    """The patterns of ``root/.gitignore`` (comments and blank lines dropped), in order."""
    path = root / ".gitignore"
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def anchored(rel: str) -> str:
    """A gitwildmatch pattern that matches exactly ``rel`` (relative to the root) and what lies under it."""
    escaped = "".join("\\" + ch if ch in "\\*?[]!#" else ch for ch in rel)
    if escaped.endswith(" "):
        escaped = escaped[:-1] + "\\ "
    return "/" + escaped


def _pathspec(lines: Sequence[str]):
    try:
        from pathspec import PathSpec  # type: ignore
    except ImportError:  # Ray vendors the same library, which is what its excludes are matched with
        from ray._private.thirdparty.pathspec import PathSpec  # type: ignore
    return PathSpec.from_lines("gitwildmatch", list(lines))


def _ray_default_excludes() -> List[str]:
    try:
        from ray._private import ray_constants

        return list(ray_constants.get_runtime_env_default_excludes())
    except Exception:  # an older or newer Ray without it: the documented defaults
        return list(_RAY_DEFAULT_EXCLUDES_FALLBACK)


def plan_upload(root: Path) -> UploadPlan:
    """Choose the excludes for ``root`` (see the module docstring) and list what Ray will upload with them."""
    root = Path(root).resolve()
    skipped: List[Tuple[str, str]] = []
    tracked = tracked_top_level(root)
    own: List[str] = []
    if tracked is not None:
        rule = "git checkout: top-level entries holding a tracked file, less .gitignore, .rayignore and virtualenvs"
        for entry in sorted(root.iterdir(), key=lambda p: p.name):
            if entry.name not in tracked and entry.name != ".git":
                own.append(anchored(entry.name))
                skipped.append((entry.name + ("/" if entry.is_dir() else ""), "holds no tracked file"))
    else:
        rule = "not a git checkout: everything less .gitignore, .rayignore, Ray's defaults and virtualenvs"
    base = gitignore_patterns(root) + ALWAYS_EXCLUDED + own
    plan = UploadPlan(root=root, rule=rule, excludes=list(base), skipped=skipped)
    # Walk what is left the way Ray's packaging does (ray/_private/runtime_env/packaging.py: _dir_travel): a path
    # is skipped when any active spec matches it relative to the spec's folder, skipped folders are not entered,
    # and each folder's .gitignore (unless RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1) and .rayignore apply below it.
    use_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    top = _pathspec(_ray_default_excludes() + base)
    specs: List[Tuple[Path, object]] = [(root, top)]
    venvs: List[str] = []
    seen: Set[Tuple[int, int]] = set()

    def excluded(path: Path) -> bool:
        for folder, spec in specs:
            if spec.match_file(path.relative_to(folder).as_posix()):
                return True
        return False

    def walk(folder: Path) -> None:
        st = folder.stat()
        if (st.st_dev, st.st_ino) in seen:  # a symlink loop
            return
        seen.add((st.st_dev, st.st_ino))
        added = 0
        for name in ((".gitignore",) if use_gitignore else ()) + (".rayignore",):
            f = folder / name
            if f.is_file():
                specs.append((folder, _pathspec(f.read_text(encoding="utf-8", errors="replace").splitlines())))
                added += 1
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
        if not entries and folder != root:
            plan.empty_dirs.append(folder.relative_to(root).as_posix())
        for path in entries:
            if excluded(path):
                continue
            rel = path.relative_to(root).as_posix()
            if path.is_dir():
                if (path / "pyvenv.cfg").is_file():
                    venvs.append(rel)
                    continue
                walk(path)
            elif path.is_file():
                plan.files[rel] = path.stat().st_size
        for _ in range(added):
            specs.pop()

    walk(root)
    for rel in venvs:
        plan.excludes.append(anchored(rel))
        plan.skipped.append((rel + "/", "a virtualenv (pyvenv.cfg)"))
    return plan


def check_size(plan: UploadPlan, cap: int = RAY_UPLOAD_CAP) -> None:
    """Raise SubmitError, naming the biggest contributors, when the package would exceed ``cap``."""
    size = plan.package_bytes
    if size <= cap:
        return
    lines = [f"the upload of {plan.root} would be {mib(size)} ({len(plan.files)} files), over Ray's {mib(cap)} cap "
             "on a working_dir package (the job server would answer 413 after zipping it all). Biggest:"]
    lines += [f"  {mib(s):>12}  {rel}" for rel, s in plan.biggest()]
    lines.append("Keep them out of the upload: move them out of the checkout, or list them in .gitignore or a "
                 ".rayignore (gitignore syntax) next to them.")
    raise SubmitError("\n".join(lines))


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
    not be submitted, 2 when refused before contacting the cluster (bad config, too big an upload)."""
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
        print(f"blockpilot submit: uploading {root} ({plan.rule}): {len(plan.files)} files, "
              f"{mib(plan.package_bytes)} (Ray's cap: {mib(RAY_UPLOAD_CAP)})", file=err)
        if plan.skipped:
            print("  not uploaded: " + ", ".join(f"{rel} ({why})" for rel, why in plan.skipped), file=err)
        check_size(plan)
    except SubmitError as e:
        print(f"blockpilot submit: error: {e}", file=err)
        return 2
    from pipeline.io.storage import is_uri

    if not (is_uri(cfg.output_dir) or Path(cfg.output_dir).is_absolute()):  # s3://... is shared already
        print(f"blockpilot submit: warning: output_dir={cfg.output_dir} is relative: the job writes it under its "
              "working dir on the cluster (a temporary copy); pass a shared absolute output_dir", file=err)
    command = entrypoint(args.target, args.python, config, args.overrides)
    address = resolve_address(args.address)
    runtime_env = {"working_dir": str(root), "excludes": plan.excludes}
    print(f"blockpilot submit: entrypoint: {command}", file=err)
    if args.dry_run:
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
