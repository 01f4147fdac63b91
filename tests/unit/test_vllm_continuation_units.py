"""label.continuation=vllm without vLLM: the check that a continuation is the target's greedy one, the choice under
auto, the memory plan beside vLLM, vLLM's max_model_len. The route itself: tests/integration/test_vllm_continuation.py."""

import pytest
import torch

from pipeline.decoding import memory
from pipeline.decoding.memory import LabelMemory, auto_batch_size
from pipeline.decoding.vllm_engine import model_len_needed
from pipeline.labelling import greedy, vllm_continuation
from pipeline.labelling.continuation import ContinuationChoice
from pipeline.labelling.vllm_continuation import check_continuation
from test_continuation import _profile
from test_memory_plan import WEIGHTS, small_pair


def test_a_continuation_is_accepted_only_as_the_targets_greedy_one():
    stops = [0]
    assert check_continuation([5, 6, 7], [5, 6, 7], 3, stops) is None  # the budget
    assert check_continuation([5, 0], [5, 0], 8, stops) is None  # a stop token ends it
    assert "token 1 is 9, the target's argmax is 6" in check_continuation([5, 9, 7], [5, 6, 7], 3, stops)
    assert "without a stop token" in check_continuation([5, 6], [5, 6], 8, stops)  # cut short
    assert "past the stop token 0" in check_continuation([5, 0, 7], [5, 0, 7], 3, stops)
    assert "more than" in check_continuation([5, 6, 7, 8], [5, 6, 7, 8], 3, stops)
    assert check_continuation([], [], 3, stops) == "no new token"
    assert check_continuation([5, 6, 7], [5, 6, 7], 3, stops, "vLLM finish_reason abort") == \
        "vLLM finish_reason abort"
    assert check_continuation([5, 6], [5, 6], 8, None) is not None  # no stop tokens: the budget only


def test_auto_takes_vllm_only_where_its_measured_costs_predict_it_cheaper():
    choice = ContinuationChoice("auto", 8, _profile(10, 30))  # greedy 10 ms a step at every batch
    assert not choice.use_vllm(64, 128, 100)  # no vLLM costs: never
    # vLLM 2 ms a step of 64 requests, the teacher-forced pass 1 us a token: 128 x 2 ms + 64 x 228 us < 128 x 10 ms
    choice.vllm_costs = {"step": {16: 0.001, 64: 0.002}, "teacher_per_token": 1e-6}
    assert choice.use_vllm(64, 128, 100)
    assert choice.predict_vllm(64, 128, 100) == pytest.approx(128 * 0.002 + 1e-6 * 64 * 228)
    assert "predicted vllm" in choice.describe_vllm()
    choice.vllm_costs = {"step": {64: 0.02}, "teacher_per_token": 1e-6}  # a vLLM step dearer than ours
    assert not choice.use_vllm(64, 128, 100)
    assert ContinuationChoice("vllm", 8, None).use_vllm(64, 128, 100)  # forced
    assert not ContinuationChoice("greedy", 8, None).use_vllm(64, 128, 100)
    choice.add({"continuation": "vllm", "rows": 4, "fallback": 1})
    assert choice.counts(choice.drained()) == {"continuation_greedy": 0, "continuation_speculative": 0,
                                               "continuation_vllm": 1, "continuation_vllm_fallback": 1}


def test_the_memory_plan_holds_vllm_beside_the_replay():
    target, draft = small_pair()
    ours = LabelMemory(target, draft, torch.float32, 100, 50, [2, 3, 4], 5, device="cpu", weights=WEIGHTS)
    beside = LabelMemory(target, draft, torch.float32, 100, 50, [2, 3, 4], 5, device="cpu", weights=WEIGHTS,
                         vllm_bytes=10_000_000)
    plan = beside.at(8)
    assert plan.weights["vLLM engine (continuation)"] == 10_000_000 and "g from vLLM" in plan.what
    # our decode's phases are vLLM's now; the teacher-forced pass and the replay's are ours
    assert {"prefill", "handoff", "decode", "features"}.isdisjoint(plan.phases)
    assert {"teacher-forced", "walks", "trace"} <= set(plan.phases)
    assert plan.peak >= 10_000_000 + sum(WEIGHTS.values()) + sum(ours.at(8).phases["walks"].values())
    budget = 12_000_000
    assert auto_batch_size(beside, budget).batch < auto_batch_size(ours, budget).batch  # vLLM's share is gone


def test_the_plans_chunk_constants_are_the_codes():
    assert (memory.FEATURE_ELEMENTS, memory.LOGIT_ELEMENTS) == (greedy.FEATURE_ELEMENTS,
                                                                vllm_continuation.LOGIT_ELEMENTS)


def test_vllms_max_model_len_covers_the_start_up_profile():
    assert model_len_needed(100, 128) == 100 + 128 + 64
    # a profile at context 1,024 decoding 32 tokens needs more than the prompts do
    assert model_len_needed(100, 128, [64, 1024], 32) == 1024 + 32 + 64
