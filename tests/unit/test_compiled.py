"""engine.compile's modes (pipeline/decoding/compiled.py); the compiled decodes themselves are checked in
tests/integration/test_compiled.py (each CPU compile takes ~40 s: no place in the fast loop)."""

import pytest

from pipeline.decoding.compiled import compile_state, wants_compile


def test_auto_is_eager_on_cpu_and_bad_modes_are_refused():
    assert not wants_compile("auto", "cpu") and wants_compile("auto", "cuda") and wants_compile("on", "cpu")
    assert not wants_compile("off", "cuda")
    with pytest.raises(ValueError, match="engine.compile"):
        wants_compile("yes", "cpu")


def test_compile_state_refuses_a_module_that_is_not_compiled():
    import torch

    with pytest.raises(ValueError, match="not compiled"):
        compile_state(torch.nn.Linear(2, 2))
