"""The per-repeat spread of tune's load check in finished runs: for each timing in ``tune/load_check.json`` (b*(c)
and the small b tried after it), its verdict, interval and the standard deviation of its repeats' paired log ratios
over the window both runs shared (what the check's interval is built from), then the root mean square over all.

    python benchmarks/load_check_spread.py runs/default/tune/load_check.json runs/default-2/tune/load_check.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.evaluation.sequential import log_ratios  # noqa: E402  (the check's own paired ratio)


def timings(check: dict):
    for c, load in check.get("loads", {}).items():
        for t in [load, *load.get("small_b", [])]:
            per = t.get("per_repeat", {})
            b = next((k for k in per if k != "AR"), None)
            if b is None:
                continue
            ratios = log_ratios(per[b]["window_throughput"], per["AR"]["window_throughput"])
            yield c, b, t, statistics.stdev(ratios) if len(ratios) > 1 else float("nan")


def main(paths) -> int:
    sds = []
    for path in paths:
        check = json.loads(Path(path).read_text())
        print(f"{path}: {check.get('seconds')} s of timing")
        for c, b, t, sd in timings(check):
            lo, hi = t["interval"]["ci"]
            print(f"  c={c} {b}: {t['verdict']}, {t['repeats']} repeats, {t['interval']['gain']:+.2%} "
                  f"[{lo:+.2%}, {hi:+.2%}], per-repeat SD {sd:.2%}, {t.get('timing')}")
            sds.append(sd)
    if sds:
        print(f"pooled per-repeat SD (root mean square of {len(sds)}): {math.sqrt(sum(s * s for s in sds) / len(sds)):.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
