"""What one bare Ray actor costs the machine, with and without a job ``runtime_env`` (env_vars only), side by side.

The test suite's session Ray (tests/conftest.py ``ray_session``) starts ~100 actors and Ray Train workers; it used to
hand its workers the S3 client environment as a job ``runtime_env``, and now lets them inherit it from the
environment its local Ray starts in. This measures the difference: each side starts a fresh local Ray (num_cpus=4),
lets it settle, measures the machine's idle CPU rate, then starts, calls and kills N actors one after another, and
reports the machine's CPU seconds per actor (from /proc/stat, the idle rate taken off) and the wall seconds to an
actor's first answer. Sides alternate, --rounds each.

    .venv/bin/python benchmarks/ray_worker_start.py [--actors 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def machine_cpu_s() -> float:
    fields = open("/proc/stat").readline().split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def one_side(with_env: bool, actors: int) -> dict:
    import ray

    kw = {"runtime_env": {"env_vars": {"BENCH_VAR": "1"}}} if with_env else {}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, **kw)

    @ray.remote(num_cpus=0.5)
    class Bare:
        def ping(self) -> str:
            return os.environ.get("BENCH_VAR", "")

    time.sleep(8)  # the start-up's own processes settle
    c0, w0 = machine_cpu_s(), time.monotonic()
    time.sleep(5)
    idle = (machine_cpu_s() - c0) / (time.monotonic() - w0)
    c0, w0, first = machine_cpu_s(), time.monotonic(), []
    for _ in range(actors):
        t = time.monotonic()
        a = Bare.remote()
        assert ray.get(a.ping.remote()) == ("1" if with_env else "")
        first.append(time.monotonic() - t)
        ray.kill(a)
    time.sleep(2)
    wall = time.monotonic() - w0
    cpu = (machine_cpu_s() - c0 - idle * wall) / actors
    ray.shutdown()
    return {"runtime_env": with_env, "cpu_s_per_actor": cpu, "first_answer_s": statistics.median(first)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", choices=["env", "none"], help=argparse.SUPPRESS)  # one side, in its own process
    a = ap.parse_args(argv)
    if a.side:
        print(json.dumps(one_side(a.side == "env", a.actors)))
        return 0
    rows = []
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    for r in range(a.rounds):
        for side in (("env", "none") if r % 2 == 0 else ("none", "env")):
            proc = subprocess.run([sys.executable, __file__, "--side", side, "--actors", str(a.actors)], env=env,
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {side:>4}: {rows[-1]}", flush=True)
    print("\n| job runtime_env | machine CPU-s per actor (per round) | wall to first answer, s (per round) |")
    print("| --- | --- | --- |")
    for with_env in (True, False):
        mine = [x for x in rows if x["runtime_env"] == with_env]
        print(f"| {'env_vars' if with_env else 'none (inherited environment)'} | "
              f"{', '.join('%.2f' % x['cpu_s_per_actor'] for x in mine)} | "
              f"{', '.join('%.2f' % x['first_answer_s'] for x in mine)} |")
    med = {e: statistics.median(x["cpu_s_per_actor"] for x in rows if x["runtime_env"] == e) for e in (True, False)}
    print(f"\nratio none/env_vars: {med[False] / med[True]:.2f}x CPU per actor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
