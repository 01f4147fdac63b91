"""benchmarks/gpu_check.py's in-process step runner (the CPU dry run's): each way a step can end is one verdict in
status.txt, its output goes to its own log, and a step past its limit is stopped rather than hanging the run. The
whole dry run is tests/integration/test_gpu_check_cpu.py's."""

import sys
import time

from pipeline import ASSETS

sys.path.insert(0, str(ASSETS.parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


def test_each_way_a_step_ends_is_its_verdict_and_its_output_goes_to_its_log(tmp_path):
    log = tmp_path / "step.log"

    def boom():
        raise ValueError("boom")

    assert gpu_check._in_process(lambda: print("hello") or 0, 10, log) == "ok"
    assert gpu_check._in_process(lambda: 1, 10, log) == "FAILED(1)"
    assert gpu_check._in_process(boom, 10, log) == "FAILED(1)"
    assert gpu_check._in_process(lambda: sys.exit(3), 10, log) == "FAILED(3)"  # argparse's refusals exit
    t0 = time.monotonic()
    assert gpu_check._in_process(lambda: time.sleep(30), 1, log) == "FAILED(timeout)"
    assert time.monotonic() - t0 < 20  # stopped at its limit, not slept out
    text = log.read_text()
    assert "hello" in text and "ValueError: boom" in text and "StepTimeout: over its 1 s limit" in text
    # and the run's own output is back where it was
    assert gpu_check._in_process(lambda: 0, 10, log) == "ok" and log.read_text() == text


def test_an_unknown_step_is_refused_naming_the_known_ones(tmp_path, capsys):
    assert gpu_check.run_steps("cpu", tmp_path, ["no-such-step"], isolate=False) == 2
    err = capsys.readouterr().err
    assert "unknown step(s) ['no-such-step']" in err and "'engine-fp32'" in err and "'pipeline'" in err
