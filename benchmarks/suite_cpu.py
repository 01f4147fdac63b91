"""Where a run's CPU goes, by kind of process: samples every process on the machine every INTERVAL seconds while a
command runs (e.g. the test suite), and prints CPU seconds per kind (Ray actors by class, Ray's daemons, CLI runs,
pytest workers) and the machine's mean busy cores.

    python benchmarks/suite_cpu.py --out cpu.json -- .venv/bin/python -m pytest -q -n 2 --dist loadfile

A process is counted from its first sample (CPU it used before then is not, except for processes started after the
sampler); a process that ends between two samples loses at most one interval of its CPU. Nothing else may run beside
it: every process on the machine is counted. Results: benchmarks/results/suite-cpu-by-process.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

import psutil

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


def sample(stop, interval: float):
    """{kind: CPU seconds}, {kind: processes}, busy cores (mean) until ``stop()``."""
    seen, cpu, count = {}, collections.Counter(), collections.Counter()
    first, busy0, t0 = True, psutil.cpu_times(), time.monotonic()
    while True:
        for p in psutil.process_iter(["pid"]):
            if p.pid == os.getpid():  # the sampler itself is not the measured command
                continue
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    used = t.user + t.system
                    last, k = seen.get(p.pid, (used if first else 0.0, None))
                    if k is None or k in RECLASSIFY:
                        k2 = kind(" ".join(p.cmdline()))
                        if k2 != k:
                            if k is not None:
                                count[k] -= 1
                            count[k2] += 1
                            k = k2
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            cpu[k] += used - last
            seen[p.pid] = (used, k)
        first = False
        if stop():
            break
        time.sleep(interval)
    t1, busy1 = time.monotonic(), psutil.cpu_times()
    busy = sum(busy1) - busy1.idle - busy1.iowait - (sum(busy0) - busy0.idle - busy0.iowait)
    return dict(cpu.most_common()), {k: v for k, v in count.items() if v > 0}, busy / (t1 - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file: CPU seconds and processes per kind, busy cores")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples (default 2)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run and measure, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command to run (give it after --)")
    proc = subprocess.Popen(cmd)
    t0 = time.monotonic()
    cpu, count, busy = sample(lambda: proc.poll() is not None, args.interval)
    wall = time.monotonic() - t0
    with open(args.out, "w") as f:
        json.dump({"command": cmd, "rc": proc.returncode, "wall_s": round(wall, 1), "busy_cores": round(busy, 3),
                   "cpu_s": {k: round(v, 1) for k, v in cpu.items()}, "processes": count}, f, indent=1)
    total = sum(cpu.values())
    print(f"\n{wall:.0f} s wall, {busy:.2f} busy cores on average, {total:.0f} CPU-s counted "
          f"(exit {proc.returncode})")
    print(f"{'CPU-s':>8} {'share':>6} {'procs':>6}  kind")
    for k, v in cpu.items():
        if v >= 0.005 * total:
            print(f"{v:8.1f} {v / total:6.1%} {count.get(k, 0):6d}  {k}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
