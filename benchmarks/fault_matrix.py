"""The fault matrix: every fault test of the suite (``pytest -m faults``), run once, as one table.

    python benchmarks/fault_matrix.py                 # all of them (~10 minutes on 2 cores: real Ray, a cluster)
    python benchmarks/fault_matrix.py -k disk         # a pytest -k selection of them
    python benchmarks/fault_matrix.py --write         # and benchmarks/results/fault-matrix.md
    python benchmarks/fault_matrix.py --rows R --junit J   # the table of a run already made, e.g. the whole suite's:
        BLOCKPILOT_FAULT_MATRIX=R PYTEST_ADDOPTS=--junitxml=J bash .ci/run

Each fault test injects its fault (a SIGKILL of a driver, an actor or a node, a flipped byte, a full disk, an object
store answering 5xx, resetting or stalling, two writers on one folder), reruns where the product's answer to the
fault is a rerun, and counts the rows it finds against the rows an uninterrupted run gives; it asserts those counts
itself and records them through the ``fault_row`` fixture (tests/conftest.py) into $BLOCKPILOT_FAULT_MATRIX, which
this script sets. A row's verdict is ``ok`` only if its test passed with 0 rows lost and 0 duplicated. Exit status 1
if any row is not ok, or if a selected test recorded no row.

Columns: fault, stage, rows expected (an uninterrupted run's), rows found (distinct ids after the fault and rerun),
lost, duplicates (rows found more than once), what it cost (besides rows: prompts rejected, workers restarted,
retired or left out, shards taken back, the stage's seconds; where the test records it), verdict. For train the "rows" are epochs in metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = "BLOCKPILOT_FAULT_MATRIX"  # tests/conftest.py's FAULT_MATRIX_ENV


def outcomes(junit: Path) -> dict:
    """nodeid -> passed / failed / skipped, from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        nodeid = f"{path}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[nodeid] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return out


def fault_tests() -> set:
    """The node ids of the suite's fault tests (``-m faults``), as pytest collects them."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "faults", "-p",
                          "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def table(rows: list, results: dict) -> tuple:
    lines = ["| fault | stage | rows expected | rows found | lost | duplicates | what it cost | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    bad = 0
    for r in rows:
        passed = results.get(r["test"]) == "passed"
        ok = passed and r["lost"] == 0 and r["duplicates"] == 0 and r["found"] == r["expected"]
        bad += not ok
        verdict = "ok" if ok else ("FAIL" if passed else f"FAIL (test {results.get(r['test'], 'not run')})")
        lines.append(f"| {r['fault']} | {r['stage']} | {r['expected']} | {r['found']} | {r['lost']} | "
                     f"{r['duplicates']} | {r.get('cost') or '-'} | {verdict} |")
    recorded = {r["test"] for r in rows}
    for test, outcome in sorted(results.items()):
        if test not in recorded and outcome != "skipped":  # a fault test that never counted its rows
            bad += 1
            lines.append(f"| ({test}: no row recorded) | | | | | | | FAIL (test {outcome}) |")
        elif test not in recorded:
            lines.append(f"| ({test}: skipped) | | | | | | | skipped |")
    return lines, bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default=None, help="a pytest -k expression over the fault tests")
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/fault-matrix.md")
    ap.add_argument("--rows", type=Path, help="rows recorded by an earlier run (its $%s)" % ENV)
    ap.add_argument("--junit", type=Path, help="that run's JUnit XML (pytest --junitxml)")
    ap.add_argument("--note", default="", help="a sentence for the results file: which run, which commit")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        record, junit = args.rows or Path(d) / "rows.jsonl", args.junit or Path(d) / "junit.xml"
        if args.rows is None:
            cmd = [sys.executable, "-m", "pytest", "-q", "-m", "faults", f"--junitxml={junit}",
                   "-p", "no:cacheprovider"] + (["-k", args.k] if args.k else [])
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, env={**os.environ, ENV: str(record)})
        rows = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
        results = outcomes(junit) if junit.exists() else {}
        if args.rows is not None:  # a whole suite's run: only its fault tests' outcomes matter here
            wanted = fault_tests()
            results = {t: o for t, o in results.items() if t in wanted}
    lines, bad = table(rows, results)
    print("\n".join(lines))
    print(f"{len(rows)} row(s), {bad} not ok")
    if args.write:
        out = ROOT / "benchmarks" / "results" / "fault-matrix.md"
        how = (f"recorded by a run of the whole suite and tabled by `python benchmarks/fault_matrix.py --rows R "
               f"--junit J --write`" if args.rows else "run by `python benchmarks/fault_matrix.py --write`")
        out.write_text(f"# The fault matrix\n\nEvery fault test of the suite, {how}, on this project's 2-core CPU "
                       f"machine (columns: the script's docstring).{args.note and ' ' + args.note}\n\n"
                       + "\n".join(lines) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
