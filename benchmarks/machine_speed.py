"""The machine's speed now, as one number: CPU seconds of a fixed loop of 3M additions in Python (lower is faster).

This 2-core machine's speed moves by up to about 3x between days and within one (the loop took 0.11-0.22 CPU-s during
one suite run of 2026-12-06 and 0.072-0.122 during one of 2026-12-07), and the test suite's wall clock follows it.
The same 698 tests from fresh clones: 857 s and 887 s at medians of 0.078 and 0.081 (8dfd2d6 and ab19540,
2026-12-07), 1,985 s and 2,093 s at about 0.2 (93d1f5a and 756c455, 2026-12-06 from 23:00; converted from a loop of
the same additions at module level timed beside those runs, median 0.49, which takes 2.1-2.6x this one's time:
0.175-0.215 against 0.083 on 2026-12-07). A suite time or a CPU-seconds figure from this machine is read against this
number, taken beside it: ``benchmarks/suite_cpu.py --reference`` times it every so many seconds during a run, and the
test session prints it at its start and end (tests/conftest.py). Results: benchmarks/results/suite-cpu-by-process.md.

    python benchmarks/machine_speed.py            # the loop, 5 times: min / median / max
"""

from __future__ import annotations

import statistics
import sys
import time


def reference_loop() -> float:
    """CPU seconds of 3M additions in Python (in a function: local variables)."""
    t0, x = time.process_time(), 0
    for i in range(3_000_000):
        x += i
    return time.process_time() - t0


def summary(times) -> str:
    """Several timings of the loop as one line: min / median / max."""
    times = sorted(times)
    return (f"{times[0]:.3f} / {statistics.median(times):.3f} / {times[-1]:.3f} CPU-s (min / median / max of "
            f"{len(times)}; lower is a faster machine)")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 5
    print(f"reference loop (3M additions): {summary(reference_loop() for _ in range(n))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
