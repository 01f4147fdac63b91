"""What the vLLM engine reads from vLLM, without vLLM: the last step's clipping (pipeline.decoding.vllm_engine
.committed_per_step), the K a configuration sets at a batch size (stages.deploy_check), and the config's refusals
for label.engine=vllm. The engine itself: tests/integration/test_vllm.py."""

import pytest

from pipeline.decoding.vllm_engine import committed_per_step
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
