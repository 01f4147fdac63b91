"""A pytest plugin for benchmarks/suite_cpu.py --per-test: each test's start and end, on which xdist worker, and that
worker's own CPU seconds then, one TSV line each (time, worker, start|end, nodeid, cpu) appended to $BP_TIMELINE.

The worker's own CPU comes from here because its /proc environ, which the sampler reads to tell whose process is
whose, predates the PYTEST_XDIST_WORKER that xdist sets inside it (its children, Ray's included, inherit it)."""

import os
import resource
import time

OUT = os.environ.get("BP_TIMELINE")


def _write(event: str, nodeid: str) -> None:
    if not OUT:
        return
    r = resource.getrusage(resource.RUSAGE_SELF)
    with open(OUT, "a") as f:
        f.write(f"{time.time():.2f}\t{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{event}\t{nodeid}\t"
                f"{r.ru_utime + r.ru_stime:.2f}\n")


def pytest_runtest_logstart(nodeid, location):
    _write("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _write("end", nodeid)
