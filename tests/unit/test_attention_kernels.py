"""The packed attention (pipeline.decoding.packed.attend): key/value heads broadcast (CPU) and repeated (CUDA with
a mask, so that the memory-efficient kernel can run) give the same output; and on this CPU every call the batched
engine makes through ``attend`` (the target's ragged rows and the draft's blocks) runs on the CPU flash kernel, not
the math one, with the model's key/value heads as they are (GQA without copies). The engine decodes with every other
SDPA backend switched off, so a call the fused kernel cannot take raises; a call never made raises nothing, so the
test counts the fused kernel's calls as well. Which kernels take each call shape at Qwen3-8B's sizes:
benchmarks/sdpa_kernels.py."""

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.nn.attention import SDPBackend, sdpa_kernel

import pipeline.decoding.batched as batched_module
import pipeline.decoding.packed as packed_module
from pipeline.decoding.batched import BatchedEngine
from pipeline.decoding.engine import Engine
from pipeline.decoding.packed import attend
from random_pair import EOS_ID, make_pair, prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_broadcast_and_repeated_heads_agree_with_a_row_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 5, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    mask = torch.rand(3, 1, 5, 40) > 0.3
    mask[..., 0] = True  # every query sees a key
    a = attend(q, k, v, mask, 0.25, broadcast_gqa=True)
    b = attend(q, k, v, mask, 0.25, broadcast_gqa=False)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert attend(q, k, v, mask, 0.25).shape == (3, 8, 5, 16)  # CPU default: broadcast


FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"  # the fused kernel's op, as the profiler names it


def test_every_engine_call_runs_on_a_fused_kernel_on_this_cpu(monkeypatch):
    """Each ``attend`` call of a batched run makes one SDPA call, with the key/value heads the model has (not
    repeated: ``enable_gqa``), and the profiler sees one CPU flash kernel per call, under the flash-only restriction.
    Why counted: ``sdpa_kernel`` restricts only the calls that happen, so an ``attend`` written out by hand (heads
    repeated with repeat_interleave, scores, softmax: the math path, copies included) decodes the same tokens and
    passed the restriction alone."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_calls = []  # (query heads, key heads, value heads, enable_gqa) of every SDPA call, in or out of attend

    def counted_sdpa(q, k, v, *args, **kwargs):
        sdpa_calls.append((q.shape[1], k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, *args, **kwargs)

    calls = []  # per attend call: (query heads / key heads, masked, the SDPA calls it made)

    def counted(q, k, v, mask, scaling, broadcast_gqa=None):
        before = len(sdpa_calls)
        out = attend(q, k, v, mask, scaling, broadcast_gqa)
        calls.append((q.shape[1] // k.shape[1], mask is not None, sdpa_calls[before:]))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
    monkeypatch.setattr(packed_module, "attend", counted)
    monkeypatch.setattr(batched_module, "attend", counted)
    target, draft = make_pair(0)  # 2 query heads per key/value head: grouped, as Qwen3's
    heads = {(m.config.num_attention_heads, m.config.num_key_value_heads) for m in (target, draft)}
    assert heads == {(2, 1)}, heads
    (q_heads, kv_heads), = heads
    engine = Engine(target, draft, [EOS_ID])
    prompts = [prompt(i, length=3 + 5 * i).tolist()[0] for i in range(6)]
    choose = lambda i, logits, hidden: ((1, 3, 4)[i % 3], None)  # noqa: E731 - AR rows beside speculating ones
    reference = BatchedEngine(engine).run(prompts, 4, 10, choose)
    calls.clear()
    sdpa_calls.clear()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), profile(activities=[ProfilerActivity.CPU]) as prof:
        fused = BatchedEngine(engine).run(prompts, 4, 10, choose)
    assert calls and all(groups == q_heads // kv_heads and masked for groups, masked, _ in calls), calls[:4]
    # one SDPA call per attend call, none elsewhere; the key/value heads as the model has them, broadcast by SDPA
    assert all(made == [(q_heads, kv_heads, kv_heads, True)] for _, _, made in calls), \
        [made for _, _, made in calls[:4]]
    assert len(sdpa_calls) == len(calls)
    kernels = Counter(e.name for e in prof.events() if "scaled_dot_product" in e.name)
    assert kernels[FLASH_CPU] == len(calls), kernels  # each ran on the CPU flash kernel (math is switched off)
    assert [r.decode.new_ids.tolist() for r in fused.requests] == \
        [r.decode.new_ids.tolist() for r in reference.requests]
