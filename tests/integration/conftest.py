"""Process helpers for the integration tests: real subprocesses, killed by process group, no Ray left behind.

Every process a test starts runs in its own session (``start_new_session=True``) and carries a unique marker in its
environment (``BP_IT_MARKER``). Ray's own processes inherit that environment, so whatever a run started, including
Ray workers that move to their own process group, is found in ``/proc/*/environ`` and reaped by pid afterwards. No
test ever runs ``ray stop`` (it would kill every Ray on the machine, other test sessions' included).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # the venv's python, by absolute path (a Ray job's PATH may not have it)
RAY = str(Path(sys.executable).with_name("ray"))
BLOCKPILOT = str(Path(sys.executable).with_name("blockpilot"))
MARKER_VAR = "BP_IT_MARKER"


def short_tmpdir(prefix: str) -> Path:
    """A short folder under /tmp: Ray's unix socket paths live under its temp dir and must stay < 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def base_env(marker: str, **extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never join someone else's cluster by accident
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", **{MARKER_VAR: marker})
    env.update(extra)
    return env


def free_ports(n: int) -> List[int]:
    """n distinct ports that are free now (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_range(n: int, avoid: Sequence[Tuple[int, int]] = (), lo: int = 20000, hi: int = 30000
                    ) -> Tuple[int, int]:
    """A run of n consecutive free ports below the ephemeral range and outside Ray's default worker range, clear of
    the ranges in ``avoid`` (a cluster's other nodes'). Ray binds worker ports only as workers start, so a range
    free now may be another node's: each xdist worker draws from its own share of lo..hi, and a cluster passes
    every range it gave out (growth's five nodes once avoided only the previous one's)."""
    shares = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    share = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0) % max(shares, 1)
    width = (hi - lo) // max(shares, 1)
    lo, hi = lo + share * width, lo + (share + 1) * width
    for _ in range(200):
        start = random.randrange(lo, hi - n)
        if any(a <= start + n and start <= b for a, b in avoid):
            continue
        socks = []
        try:
            for port in range(start, start + n):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return start, start + n - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range found")


def marked_pids(marker: str) -> Dict[int, str]:
    """pid -> process name of every live process whose environment carries this marker."""
    needle = f"{MARKER_VAR}={marker}".encode() + b"\0"
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes() + b"\0":
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # a zombie is dead already; its parent just has not reaped it
                    found[int(d.name)] = (d / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
    return found


def kill_group(proc: subprocess.Popen, grace: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Stop ``proc`` (a session leader) and its process group.

    SIGKILL goes to the whole group at once (a crash). SIGTERM goes to the leader first, so that a ``ray start
    --block`` drains its node and stops its own processes in order (SIGTERM to the whole group stops the GCS under
    the draining head, which then waits 30 s for it); whatever of the group is left after ``grace`` is SIGKILLed.
    """
    try:
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (children can outlive the leader)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def reap(marker: str, wait: float = 20.0) -> Dict[int, str]:
    """Wait up to ``wait`` s for the marked processes to go (Ray workers fate-share with their raylet), SIGKILL
    the rest by pid. Returns what was still alive when the wait ran out (pid -> name)."""
    deadline = time.monotonic() + wait
    left = marked_pids(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = marked_pids(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def ray_sessions(ray_tmp: Path) -> List[str]:
    """The Ray sessions started under ``ray_tmp`` (the RAY_TMPDIR a run was given): a local Ray writes
    ``ray/session_<time>_<pid>`` there as it starts, whatever its log level lets it say."""
    return sorted(p.name for p in (Path(ray_tmp) / "ray").glob("session_2*"))


class Run:
    """A subprocess in its own session, its output (stdout and stderr merged) collected line by line."""

    def __init__(self, cmd: List[str], env_extra: Optional[Dict[str, str]] = None, cwd: Path = REPO):
        self.marker = uuid.uuid4().hex
        env_extra = dict(env_extra or {})
        self.own_tmp = "RAY_TMPDIR" not in env_extra
        if self.own_tmp:  # this run's own Ray temp dir: its local Ray never meets another
            env_extra["RAY_TMPDIR"] = str(short_tmpdir("bpit-"))
        self.ray_tmp = Path(env_extra["RAY_TMPDIR"])
        env = base_env(self.marker, **env_extra)
        self.cmd = cmd
        self.lines: List[str] = []
        self.escaped: Dict[int, str] = {}
        self.left: Dict[int, str] = {}
        self.ray_sessions: List[str] = []
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", bufsize=1,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pred: Callable[[], object], timeout: float, what: str, poll: float = 0.05):
        """Poll ``pred`` every ``poll`` s until it returns something truthy; fail if the process exits first or time
        runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            if self.proc.poll() is not None:
                got = pred()
                if got:
                    return got
                raise AssertionError(f"exited ({self.proc.returncode}) before {what}:\n{self.tail()}")
            time.sleep(poll)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{self.tail()}")

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{' '.join(self.cmd[:4])} ... did not finish in {timeout} s:\n{self.tail()}")
        self._reader.join(timeout=10)
        return rc

    def kill(self, sig: int = signal.SIGKILL) -> Dict[int, str]:
        """Kill the run's process group, then, by pid, whatever of the run escaped it: Ray workers run in sessions
        of their own (they would die a moment later with their raylet, still working meanwhile).

        Returns and keeps in ``self.escaped`` what was alive just after the group kill; Ray's GCS and raylet are in
        the group and must never be in it. ``self.left`` is what was still alive after the pid kills."""
        kill_group(self.proc, grace=5.0, sig=sig)
        deadline = time.monotonic() + 3  # signals are asynchronous: give the group a moment to be gone
        while True:
            self.escaped = marked_pids(self.marker)
            if not set(self.escaped.values()) & {"gcs_server", "raylet"} or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for pid in self.escaped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._reader.join(timeout=10)
        self.reap()
        return self.escaped

    def reap(self) -> Dict[int, str]:
        """Reap what is left of the run (see :func:`reap`) and delete its own Ray temp dir."""
        left = self.left = reap(self.marker)
        self.ray_sessions = ray_sessions(self.ray_tmp)
        if self.own_tmp:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return left

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])


def blockpilot(stage: str, *overrides: str, timeout: float = 300, env: Optional[Dict[str, str]] = None) -> Run:
    """``python -m stages.cli STAGE ...`` run to completion (its own local Ray); leftovers are reaped."""
    run = Run([PYTHON, "-m", "stages.cli", stage, *overrides], env)
    try:
        run.wait(timeout)
    finally:
        run.kill() if run.proc.poll() is None else run.reap()
    return run


class InProcess:
    """What :func:`blockpilot_here` returns: the CLI's exit status and its lines, as :class:`Run` has them, and what
    the session Ray's workers (actors, Ray Train's workers) printed meanwhile (``workers``)."""

    def __init__(self, rc: int, output: str, workers: str = ""):
        self.rc, self.output, self.workers = rc, output, workers
        self.lines = output.splitlines()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])


def blockpilot_here(stage: str, *overrides: str) -> InProcess:
    """The CLI's entry point (``stages.cli.main``) called in this process, on the session's Ray
    (tests/conftest.py::ray_session) instead of a local Ray of its own: for tests of what a stage writes, says or
    refuses, which a fresh interpreter and Ray start-up (10-15 s a run on this machine) add nothing to. Its stdout
    and stderr are captured together; the log's handlers and level and the environment the CLI sets are put back
    afterwards. The Ray lifecycle of a real run (start, kill, nothing left) stays the subprocess tests'
    (:func:`blockpilot`)."""
    import contextlib
    import io
    import logging

    from pipeline.runtime.log import ROOT
    from stages.cli import main

    logger = logging.getLogger(ROOT)
    handlers, level, environ = list(logger.handlers), logger.level, dict(os.environ)
    buf = io.StringIO()
    before = _worker_logs()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                rc = main([stage, *overrides])
            except SystemExit as err:  # argparse's refusals
                rc = err.code
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        os.environ.clear()
        os.environ.update(environ)
    return InProcess(rc, buf.getvalue(), _worker_output_since(before))



def validate(labels) -> subprocess.CompletedProcess:
    """``blockpilot validate LABELS`` through the CLI's entry point here (it starts no Ray): its exit status and
    output, as a subprocess would give them."""
    run = blockpilot_here("validate", str(labels))
    return subprocess.CompletedProcess(["blockpilot", "validate", str(labels)], run.rc, run.output, "")

def _worker_logs() -> Dict[Path, int]:
    """The session Ray's worker output files (``logs/worker-*.out`` and ``.err``: a worker's stdout and stderr go
    there, as the session keeps them from its driver, log_to_driver=False) and their sizes now."""
    import ray

    if not ray.is_initialized():
        return {}
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    return {p: p.stat().st_size for p in [*logs.glob("worker-*.out"), *logs.glob("worker-*.err")]}


def _worker_output_since(before: Dict[Path, int]) -> str:
    """What the session's workers printed since ``before``: the tests of one pytest worker run one at a time on its
    session Ray, so what was added belongs to the call in between."""
    text = []
    for path, size in _worker_logs().items():
        with open(path, "rb") as f:
            f.seek(before.get(path, 0))
            text.append(f.read().decode(errors="replace"))
    return "".join(text)


# ---- a hook injected into a run's processes ------------------------------------------------------------------------
# A process's Python imports this as its sitecustomize (on its PYTHONPATH: a node's, or a run's and its local Ray's):
# when a label actor (its process title says which of its methods runs) calls MODULE.FUNC, it notes its pid in the
# file $BP_PID_FILE and then ACTION. No process without that PYTHONPATH is touched, and nothing polls for the moment:
# the call itself is the event.
HOOK = """
import importlib.abc, importlib.util, os, signal, sys, time

MODULE, FUNC, TITLE = {module!r}, {func!r}, {title!r}


def act():
{action}


class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = getattr(module, FUNC)

            def hooked(*args, **kwargs):
                with open("/proc/self/cmdline", "rb") as f:
                    if f.read().startswith(TITLE.encode()):
                        with open(os.environ["BP_PID_FILE"], "a") as log:
                            log.write(f"{{os.getpid()}}\\n")
                        act()
                return real(*args, **kwargs)

            setattr(module, FUNC, hooked)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Hook())
"""
# A label actor's prompts wait for the file $BP_RELEASE (each notes its pid first): its first prompt is held there
# until the test writes it (test_cluster_growth, test_faults).
HOLD_FIRST_PROMPT = dict(module="pipeline.labelling.labels", func="logits_to_numpy",
                         title="ray::StageActor[label].process",
                         action="    while not os.path.exists(os.environ['BP_RELEASE']):\n        time.sleep(0.2)")


def inject_hook(folder, hook) -> dict:
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(HOOK.format(**hook))
    return {"PYTHONPATH": str(folder), "BP_PID_FILE": str(folder / "pids.txt"), "BP_RELEASE": str(folder / "go")}


def hook_pids(env) -> list:
    try:
        with open(env["BP_PID_FILE"]) as f:
            return f.read().split()
    except FileNotFoundError:
        return []
