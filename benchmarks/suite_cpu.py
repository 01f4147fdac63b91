"""Where a run's CPU goes, by kind of process: samples every process on the machine every INTERVAL seconds while a
command runs (e.g. the test suite), and prints CPU seconds per kind (Ray actors by class, Ray's daemons, CLI runs,
pytest workers) and the machine's mean busy cores.

    python benchmarks/suite_cpu.py --out cpu.json -- .venv/bin/python -m pytest -q -n 2 --dist loadfile

With ``--per-test`` (a pytest command), CPU seconds per test too: every process is charged to the xdist worker whose
environment it inherited (Ray's daemons and actors, a test's subprocesses), and a worker's processes' CPU between
two samples to the test that worker ran then (benchmarks/pytest_timeline.py says which, and when). A session-wide
process (the session's Ray daemons) is charged to whichever test its worker runs: a test's figure includes that
background, a few CPU-s a minute.

``--reference`` times a fixed loop of additions (CPU seconds; benchmarks/machine_speed.py) every so many seconds
beside the command: this machine's speed moves by up to about 3x between days and within one, whatever runs on it, so
that a wall-clock or CPU-seconds figure can be read against the machine's speed then.

A process is counted from its first sample (CPU it used before then is not, except for processes started after the
sampler); a process that ends between two samples loses at most one interval of its CPU. Nothing else may run beside
it: every process on the machine is counted. Results: benchmarks/results/suite-cpu-by-process.md.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import psutil

from machine_speed import reference_loop, summary  # this folder is sys.path[0] when run as a script

# (pattern on the command line, kind); the first match wins. Ray renames a worker's process to its actor's class
# (``ray::StageActor[label]``, ``ray::TrainController``) once the actor starts, so a worker is classified again
# while it is still idle.
KINDS = [
    (r"jobs/(\w+)\.py", "job:{}"), (r"bin/ray (\w+)", "ray-cli:{}"), (r"ray::StageActor\[(\w+)\]", "actor:{}"),
    (r"ray::(\w+)", "actor:{}"), (r"default_worker\.py", "ray-worker (not started)"), (r"/raylet ", "raylet"),
    (r"gcs_server", "gcs"), (r"dashboard/agent\.py", "dashboard-agent"), (r"runtime_env/agent", "runtime-env-agent"),
    (r"dashboard/dashboard\.py", "dashboard"), (r"log_monitor", "log-monitor"), (r"monitor\.py", "autoscaler"),
    (r"vllm|EngineCore", "vllm"), (r"stages\.cli|bin/blockpilot", "cli"), (r"moto", "s3 server"),
    (r"execnet|xdist|import sys;exec", "pytest worker"), (r"pytest", "pytest"), (r"python", "python (other)"),
]
RECLASSIFY = {"ray-worker (not started)", "actor:IDLE", "python (other)"}


def kind(cmdline: str) -> str:
    for pattern, name in KINDS:
        m = re.search(pattern, cmdline)
        if m:
            return name.format(*m.groups())
    return (cmdline.split(" ")[0].rsplit("/", 1)[-1] or "?")[:30]


def xdist_worker(p: psutil.Process) -> str:
    """The PYTEST_XDIST_WORKER a process started with ("" if none, or unreadable)."""
    try:
        return p.environ().get("PYTEST_XDIST_WORKER", "")
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
        return ""


def sample(stop, interval: float, per_test: bool = False, reference: float = 0.0):
    """{kind: CPU seconds}, {kind: processes}, busy cores (mean), [(time, xdist worker, CPU seconds since the last
    sample)] (per_test), [(time, reference loop's CPU seconds)] until ``stop()``."""
    seen, cpu, count, by_worker, ref = {}, collections.Counter(), collections.Counter(), [], []
    first, busy0, t0, last_ref = True, psutil.cpu_times(), time.monotonic(), -1e9
    while True:
        if reference and time.monotonic() - last_ref >= reference:
            last_ref = time.monotonic()
            ref.append((time.time(), round(reference_loop(), 3)))
        now, step = time.time(), collections.Counter()
        for p in psutil.process_iter(["pid"]):
            if p.pid == os.getpid():  # the sampler itself is not the measured command
                continue
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())  # a pid the kernel reuses is another process
                    t = p.cpu_times()
                    used = t.user + t.system
                    last, k, w = seen.get(key, (used if first else 0.0, None, None))
                    if k is None or k in RECLASSIFY:
                        k2 = kind(" ".join(p.cmdline()))
                        if k2 != k:
                            if k is not None:
                                count[k] -= 1
                            count[k2] += 1
                            k = k2
                    if w is None:
                        w = xdist_worker(p) if per_test else ""
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            cpu[k] += used - last
            if not first and used > last:
                step[w] += used - last
            seen[key] = (used, k, w)
        by_worker += [(now, w, c) for w, c in step.items() if w]
        first = False
        if stop():
            break
        time.sleep(interval)
    t1, busy1 = time.monotonic(), psutil.cpu_times()
    busy = sum(busy1) - busy1.idle - busy1.iowait - (sum(busy0) - busy0.idle - busy0.iowait)
    return dict(cpu.most_common()), {k: v for k, v in count.items() if v > 0}, busy / (t1 - t0), by_worker, ref


def per_test_cpu(timeline: str, by_worker, interval: float) -> dict:
    """nodeid -> {cpu_s, wall_s}: the worker's own CPU over the test (pytest_timeline's figures), plus its
    processes' CPU in the samples taken while it ran (a sample up to one interval after its end too: it holds the
    CPU used before it)."""
    runs, started, tests = collections.defaultdict(list), {}, {}
    with open(timeline) as f:
        lines = [line.rstrip("\n").split("\t") for line in f]
    xdist = any(x[1] != "main" for x in lines)  # under xdist the controller relays every test too: not its own
    for t, worker, event, nodeid, own in lines:
        if xdist and worker == "main":
            continue
        if event == "start":
            started[(worker, nodeid)] = (float(t), float(own))
        elif (worker, nodeid) in started:
            t0, own0 = started.pop((worker, nodeid))
            runs[worker].append((t0, float(t), nodeid))
            tests[nodeid] = {"cpu_s": float(own) - own0, "wall_s": float(t) - t0}
    for w in runs:
        runs[w].sort()
    starts = {w: [r[0] for r in v] for w, v in runs.items()}
    for t, w, c in by_worker:
        if w not in runs:
            continue
        i = bisect.bisect_right(starts[w], t) - 1
        if i >= 0 and t <= runs[w][i][1] + interval:
            tests[runs[w][i][2]]["cpu_s"] += c
    return {n: {k: round(v, 1) for k, v in d.items()} for n, d in tests.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file: CPU seconds and processes per kind, busy cores")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples (default 2)")
    ap.add_argument("--per-test", action="store_true",
                    help="a pytest command: CPU seconds per test too (adds -p pytest_timeline to it)")
    ap.add_argument("--reference", type=float, default=0.0, metavar="S",
                    help="time the reference loop every S seconds (0, the default: never)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run and measure, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command to run (give it after --)")
    env = dict(os.environ)
    timeline = None
    if args.per_test:
        if not any("pytest" in c for c in cmd):
            ap.error("--per-test measures a pytest command")
        timeline = tempfile.NamedTemporaryFile(prefix="timeline-", suffix=".tsv", delete=False).name
        here = os.path.dirname(os.path.abspath(__file__))
        env.update(BP_TIMELINE=timeline, PYTHONPATH=os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")])))
        cmd = [*cmd, "-p", "pytest_timeline"]
    proc = subprocess.Popen(cmd, env=env)
    t0 = time.monotonic()
    cpu, count, busy, by_worker, ref = sample(lambda: proc.poll() is not None, args.interval, args.per_test,
                                              args.reference)
    wall = time.monotonic() - t0
    result = {"command": cmd, "rc": proc.returncode, "wall_s": round(wall, 1), "busy_cores": round(busy, 3),
              "cpu_s": {k: round(v, 1) for k, v in cpu.items()}, "processes": count}
    if ref:
        result["reference_s"] = ref
    if timeline:
        result["tests"] = per_test_cpu(timeline, by_worker, args.interval)
        os.unlink(timeline)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    total = sum(cpu.values())
    print(f"\n{wall:.0f} s wall, {busy:.2f} busy cores on average, {total:.0f} CPU-s counted "
          f"(exit {proc.returncode})")
    if ref:
        print(f"reference loop: {summary(x for _, x in ref)}")
    print(f"{'CPU-s':>8} {'share':>6} {'procs':>6}  kind")
    for k, v in cpu.items():
        if v >= 0.005 * total:
            print(f"{v:8.1f} {v / total:6.1%} {count.get(k, 0):6d}  {k}")
    if timeline:
        tests = sorted(result["tests"].items(), key=lambda kv: -kv[1]["cpu_s"])
        print(f"\n{'CPU-s':>8} {'wall s':>7}  test (the {min(25, len(tests))} costliest of {len(tests)})")
        for nodeid, d in tests[:25]:
            print(f"{d['cpu_s']:8.1f} {d['wall_s']:7.1f}  {nodeid}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
