"""README command 1 as a user runs it: ``blockpilot run`` (the installed console script) as a process of its own,
which starts its own local Ray, chains prepare -> label -> train -> tune -> evaluate -> report and exits.

The other tests of the six stages (test_stages, test_sampled_run, test_real_shapes) call them in this process on the
session's Ray; only here does one command start a Ray, keep it through every stage and leave nothing behind. The
settings are the stage tests' FAST ones (tests/conftest.py: 16 prompts, 32 new tokens, one actor per stage, a 4-epoch
MLP, evaluate at c = 1), the smallest that still run every stage for real; the default's mix of sources and its load
grid are the stage tests' to cover.

The run gets its own Ray temp dir (RAY_TMPDIR, which Ray's local start-up and its lookup of a running cluster both
read) and no RAY_ADDRESS, so it can neither join the test session's Ray nor anybody else's, and a marker in its
environment, which every process it starts inherits (Ray's GCS, raylet and workers included): what is left of it
afterwards is found by that marker and its temp dir, never by a name, and no ``ray stop`` is ever run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid

import psutil

from conftest import FAST
from pipeline.evaluation.table import format_rows
from pipeline.io import layout
from pipeline.io.layout import RunLayout

from .conftest import BLOCKPILOT, MARKER_VAR, base_env, ray_sessions, short_tmpdir

STAGES = ("prepare", "label", "train", "tune", "evaluate", "report")  # stages/run.py's ORDER
# Ray's processes are gone when the driver's ray.shutdown returns (GCS and raylet, killed and waited for); its
# workers notice their raylet's end on their own, a moment later. This is how long they get before one still alive
# counts as left behind (a grace period for process exit, not an assertion on how long anything took).
EXIT_GRACE_S = 30.0


def _processes_of(marker: str, ray_tmp: str, before: set) -> dict:
    """pid -> 'name: cmdline' of the live processes the run started: its marker in their environment or its Ray temp
    dir on their command line, and not alive before it started (pid and start time)."""
    found = {}
    needle = f"{MARKER_VAR}={marker}"
    for p in psutil.process_iter(["pid", "name", "create_time", "cmdline", "status"]):
        info = p.info
        if (info["pid"], info["create_time"]) in before or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(info["cmdline"] or [])
        try:
            env = p.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            env = {}
        if env.get(MARKER_VAR) == marker or ray_tmp in cmdline or needle in cmdline:
            found[info["pid"]] = f"{info['name']}: {cmdline[:160]}"
    return found


def _kill(pids) -> None:
    for pid in pids:  # by pid: each was started by this test's run
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_blockpilot_run_as_a_process_runs_every_stage_on_its_own_ray_and_leaves_no_ray_behind(tmp_path):
    out = tmp_path / "run"
    ray_tmp = short_tmpdir("bpcli-")  # short: Ray's unix socket paths live under it
    marker = uuid.uuid4().hex
    env = base_env(marker, RAY_TMPDIR=str(ray_tmp))  # RAY_ADDRESS dropped: a local Ray of the run's own
    before = {(p.info["pid"], p.info["create_time"]) for p in psutil.process_iter(["pid", "create_time"])}
    # Its output to files, not pipes: a process it left behind would hold a pipe open, and reading to the pipe's end
    # would wait for that process instead of the run.
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        proc = subprocess.Popen([BLOCKPILOT, "run", f"output_dir={out}", *FAST], cwd=tmp_path, env=env, stdout=so,
                                stderr=se, start_new_session=True)
    left: dict = {}
    try:
        try:
            proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"blockpilot run did not end in 900 s:\n{(tmp_path / 'stdout').read_text()[-4000:]}")
        stdout, stderr = ((tmp_path / name).read_text(errors="replace") for name in ("stdout", "stderr"))
        deadline = time.monotonic() + EXIT_GRACE_S
        left = _processes_of(marker, str(ray_tmp), before)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _processes_of(marker, str(ray_tmp), before)
        sessions = ray_sessions(ray_tmp)
    finally:
        _kill(_processes_of(marker, str(ray_tmp), before))  # whatever the run left, so the next test starts clean
        shutil.rmtree(ray_tmp, ignore_errors=True)

    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-6000:]}\n{stderr[-6000:]}"
    # One local Ray, started in the run's own temp dir and kept through all six stages: a second session would be a
    # Ray shut down and started again between stages, none a Ray joined elsewhere.
    assert len(sessions) == 1, sessions
    assert not left, f"processes of the run alive {EXIT_GRACE_S} s after it exited: {left}"

    run = RunLayout(out)
    folders = {"prepare": [run.prompts], "label": [run.labels], "train": [run.train], "tune": [run.tune],
               "evaluate": [run.eval_prompts, run.eval], "report": [run.report]}
    assert set(folders) == set(STAGES)
    missing = [str(f) for stage in STAGES for f in folders[stage] if not (f / layout.SUCCESS).is_file()]
    assert not missing, missing

    # Each stage's done: line, in the order run chains them (evaluate's own prepare of its prompts before it), and
    # the closing line with each stage's seconds.
    done = [m.group(1) for m in re.finditer(r"^\[(\w+)\] done: ", stdout, re.M)]
    assert done == ["prepare", "label", "train", "tune", "prepare", "evaluate", "report"], done
    closing = re.search(r"^\[run\] done in [\d.]+ s \((.*)\); speedups over autoregressive decoding, average of the "
                        r"held-out sets:$", stdout, re.M)
    assert closing, stdout[-3000:]
    assert [part.split()[0] for part in closing.group(1).split(", ")] == list(STAGES)

    # The closing table: exactly the rows the report recorded, under its header, then the report's path, last.
    summary = json.loads((run.report / layout.SUMMARY).read_text())
    rows = summary["headline"]["rows"]
    table = format_rows(rows)
    lines = table.splitlines()
    assert re.fullmatch(r"method +modelled +wall  gain vs train-chosen b=\d+ \(modelled, 95 % CI\)", lines[0]), lines
    assert [r["row"].split(" (")[0] for r in rows][:1] == ["adaptive"] and rows[-1]["row"] == "oracle (per prompt)"
    assert any(line.startswith(f"train-chosen b={rows[0]['baseline_b']} ") and line.endswith("(baseline)")
               for line in lines[1:]), lines
    after = stdout.split(closing.group(0), 1)[1]
    assert after.startswith("\n" + table + "\n"), after[:3000]
    assert after.rstrip("\n").splitlines()[-1] == f"report: {run.report / 'report.md'}"
    assert (run.report / "report.md").is_file()
