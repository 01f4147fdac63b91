"""What the vLLM engine reads from vLLM, without vLLM: the last step's clipping (pipeline.decoding.vllm_engine
.committed_per_step), the K a configuration sets at a batch size (stages.deploy_check), and the config's refusals
for label.engine=vllm. The engine itself: tests/integration/test_vllm.py."""

import pytest

from pipeline.decoding.vllm_engine import committed_per_step, undrafted_steps
from pipeline.decoding.vllm_server import Answer, LoadRun
from pipeline.runtime.config import ConfigError, load_config
from stages.deploy_check import _configured_k


def test_the_last_step_is_clipped_to_the_tokens_kept():
    # 1 token from the prefill + steps of 3, 1, 8: 13 tokens if nothing were cut; the request kept 9
    assert committed_per_step([2, 0, 7], 9) == [3, 1, 4]
    assert committed_per_step([2, 0, 7], 13) == [3, 1, 8]  # nothing cut
    assert committed_per_step([], 1) == []  # stopped on the prefill's token: no step
    with pytest.raises(ValueError, match="account for"):
        committed_per_step([2, 0], 9)  # fewer tokens committed than kept: not vLLM's arithmetic
    with pytest.raises(ValueError, match="overshoot"):
        committed_per_step([2, 0, 1], 4)  # the cut would empty the last step


def test_steps_at_k_0_under_a_batch_size_schedule_are_the_tokens_the_drafted_steps_miss():
    # K = 0 while the batch was large (4 one-token steps vLLM does not record), then 2 drafted steps: 1 + 4 + 3 + 2
    committed = committed_per_step([2, 1], 10, k_may_change=True)
    assert committed == [3, 2] and undrafted_steps(committed, 10) == 4
    assert undrafted_steps(committed_per_step([2, 0, 7], 9, k_may_change=True), 9) == 0  # clipped as before
    # what a load reports: a speculating server's request with no drafted step took all its steps at K = 0
    run = LoadRun(16, 1.0, [Answer([1] * 10, [3, 2], [9, 9], 2.5, 4), Answer([1] * 5, [], [], None, 4)])
    assert run.drafted == [0, 9] and run.tau == 2.5
    assert LoadRun(1, 1.0, [Answer([1] * 10, [3, 6], [9, 9], 4.5, 0)]).drafted == [9]
    assert LoadRun(1, 1.0, [Answer([1] * 10, [], [], None, 0)]).drafted == []  # no speculation


def _response(n_tokens, accepted=None, drafted=None):
    """A /v1/completions answer as vLLM 0.32 shapes it (vllm/entrypoints/openai/completion/serving.py), trimmed."""
    out = {"choices": [{"token_ids": list(range(n_tokens))}], "metrics": {}}
    if accepted is not None:
        out["metrics"]["speculative_decoding"] = {
            "per_step_accepted": accepted, "per_step_drafted": drafted,
            "mean_acceptance_length": 1 + sum(accepted) / len(accepted) if accepted else 1.0}
    return out


def test_an_answer_under_a_schedule_counts_its_undrafted_steps_and_a_fixed_k_refuses_a_shortfall():
    fixed = {"method": "dflash", "num_speculative_tokens": 9}
    schedule = {**fixed, "num_speculative_tokens_per_batch_size": [[1, 3, 9], [4, 1024, 0]]}
    # CI's failure: 32 tokens, one drafted step (2 tokens) recorded, the rest at K = 0 while 4+ requests ran
    a = Answer.from_response(_response(32, [1], [9]), schedule)
    assert (a.committed, a.undrafted, a.vllm_acceptance_length) == ([2], 29, 2.0)
    with pytest.raises(ValueError, match="account for"):
        Answer.from_response(_response(32, [1], [9]), fixed)  # one K throughout: a shortfall is not vLLM's arithmetic
    b = Answer.from_response(_response(32, [], []), schedule)  # never drafted
    assert (b.committed, b.undrafted, b.vllm_acceptance_length) == ([], 31, None)
    c = Answer.from_response(_response(32), None)  # no speculation: no metrics at all
    assert (c.committed, c.undrafted) == ([], 0)


def test_the_k_a_schedule_sets_at_each_batch_size_by_vllms_rules():
    spec = {"num_speculative_tokens": 7, "num_speculative_tokens_per_batch_size": [[1, 3, 7], [4, 15, 5],
                                                                                   [16, 1024, 0]]}
    assert [_configured_k(spec, n) for n in (1, 3, 4, 15, 16, 64)] == [7, 7, 5, 5, 0, 0]
    assert _configured_k({"num_speculative_tokens": 3}, 16) == 3  # one K at every load
    assert _configured_k(None, 1) == 0  # no speculation


@pytest.mark.parametrize("override,key", [
    (["label.engine=trt"], "label.engine"),
    (["label.engine=vllm", "label.mode=replay"], "label.mode"),
    (["label.engine=vllm", "decode.top_k=5", "decode.temperature=1"], "decode.top_k"),
    (["label.engine=vllm", "vllm.max_num_seqs=8"], "vllm.max_num_seqs"),  # the profile's grid reaches c = 16
    (["vllm.gpu_memory_utilization=1.5"], "vllm.gpu_memory_utilization"),
    (["vllm.compile=yes"], "vllm.compile"),
])
def test_a_bad_vllm_setting_names_its_key(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(override)
