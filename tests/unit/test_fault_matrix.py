"""The fault matrix's verdicts (benchmarks/fault_matrix.py): a row is ok only if its test passed with every expected
row found once; a fault test that recorded nothing is a failure, not a missing line."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fault_matrix import outcomes, table  # noqa: E402


def row(test, expected=4, found=4, lost=0, duplicates=0):
    return {"test": test, "fault": f"fault of {test}", "stage": "label", "expected": expected, "found": found,
            "lost": lost, "duplicates": duplicates}


def test_verdicts():
    results = {"a": "passed", "b": "passed", "c": "failed", "d": "passed", "e": "failed", "f": "skipped"}
    rows = [row("a"), row("b", found=3, lost=1), row("c"), row("d", duplicates=1)]
    lines, bad = table(rows, results)
    verdicts = [ln.rsplit("|", 2)[-2].strip() for ln in lines[2:]]
    assert verdicts == ["ok", "FAIL", "FAIL (test failed)", "FAIL", "FAIL (test failed)", "skipped"]
    assert "(e: no row recorded)" in lines[6] and bad == 4


def test_outcomes_read_pytests_junit_ids(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.unit.test_x" name="test_a"/>'
                   '<testcase classname="tests.unit.test_x" name="test_b[label]"><failure message="x"/></testcase>'
                   '<testcase classname="tests.integration.test_y" name="test_c"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    assert outcomes(xml) == {"tests/unit/test_x.py::test_a": "passed",
                             "tests/unit/test_x.py::test_b[label]": "failed",
                             "tests/integration/test_y.py::test_c": "skipped"}
