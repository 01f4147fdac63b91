"""tests/conftest.py's autouse ``autograd_as_found``: a test that leaves torch's inference mode on or autograd off
fails, naming what it left, and the tests after it run as in a fresh process. It used to turn the state back under a
warning, which no run reads: a leak then surfaced only as unrelated tests failing later in the same worker. Run on
throwaway tests in a pytest of their own (pytester, a subprocess: the leaked guards and the guard that turns a state
back for good must die with their process, not in this one's garbage collection)."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

LEAKS = '''
import pytest
import torch

LEAKED = []  # alive, as a context outliving its owner would be


@pytest.fixture(scope="module")
def left_by_a_module_fixture():
    torch.set_grad_enabled(False)  # before any test's own guard: found at the test's start
    yield


def test_leaves_inference_mode_on():
    LEAKED.append(torch.inference_mode())
    LEAKED[-1].__enter__()  # never exited


def test_leaves_autograd_off():
    torch.set_grad_enabled(False)


def test_after_them_runs_as_in_a_fresh_process():
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_starts_with_autograd_off(left_by_a_module_fixture):
    pass


def test_after_that_runs_as_in_a_fresh_process():
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
'''


@pytest.mark.integration  # the integration layer: a fresh interpreter of its own (tests/conftest.py)
def test_a_test_that_leaves_autograd_changed_fails_naming_it_and_the_next_runs_as_in_a_fresh_process(pytester):
    # the suite's conftest loaded by path (its fixture alone): this folder's tests see it as theirs
    pytester.makeconftest(f"""
import importlib.util

spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
autograd_as_found = suite.autograd_as_found
""")
    pytester.makepyfile(test_leaks=LEAKS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=3)  # the two leaks at teardown, the one found at setup
    out = result.stdout.str()
    assert "ERROR at teardown of test_leaves_inference_mode_on" in out
    assert "this test left torch's inference mode on and autograd off" in out  # inference mode turns autograd off
    assert "ERROR at teardown of test_leaves_autograd_off" in out
    assert "this test left torch's autograd off (restored" in out
    assert "ERROR at setup of test_starts_with_autograd_off" in out
    assert "autograd off at this test's start: left outside any test" in out
