"""What ``blockpilot submit`` uploads: the checkout as a Ray ``working_dir`` package, less what does not belong.

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

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

# The job server (the dashboard's aiohttp app) refuses request bodies over this (ray_constants.
# DASHBOARD_CLIENT_MAX_SIZE); a working_dir package is sent as one body.
RAY_UPLOAD_CAP = 100 * 1024 ** 2
# Excluded always, whatever git or .gitignore say (recent Ray excludes these by default too; older Ray does not).
ALWAYS_EXCLUDED = [".git", "__pycache__"]
# Ray's own default excludes (ray_constants.RAY_RUNTIME_ENV_DEFAULT_EXCLUDES), used only to predict the package
# when Ray's constant cannot be read; they are not passed on (Ray adds them itself, and a user may override them).
_RAY_DEFAULT_EXCLUDES_FALLBACK = [".git", ".venv", "venv", "__pycache__"]
# Zip overhead per entry (local header 30 B + central directory record 46 B + the name twice), then 22 B at the end:
# Ray's zip stores files uncompressed, so the package is the files' bytes plus this.
_ZIP_ENTRY_OVERHEAD = 76
_ZIP_END = 22


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


