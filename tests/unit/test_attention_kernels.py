"""The packed attention (pipeline.decoding.packed.attend): key/value heads broadcast (CPU) and repeated (CUDA with
a mask, so that the memory-efficient kernel can run) give the same output; and on this CPU every call the batched
engine makes through ``attend`` (the target's ragged rows and the draft's blocks) runs on the CPU flash kernel, not
the math one: the engine decodes with every other SDPA backend switched off, so a call the fused kernel cannot take
raises. Which kernels take each call shape at Qwen3-8B's sizes: benchmarks/sdpa_kernels.py."""

import pytest
import torch
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


def test_every_engine_call_runs_on_a_fused_kernel_on_this_cpu(monkeypatch):
    calls = []

    def counted(q, k, v, mask, scaling, broadcast_gqa=None):
        calls.append((q.shape[1] // k.shape[1], mask is not None))
        return attend(q, k, v, mask, scaling, broadcast_gqa)

    monkeypatch.setattr(packed_module, "attend", counted)
    monkeypatch.setattr(batched_module, "attend", counted)
    target, draft = make_pair(0)  # 2 query heads per key/value head: grouped, as Qwen3's
    engine = Engine(target, draft, [EOS_ID])
    prompts = [prompt(i, length=3 + 5 * i).tolist()[0] for i in range(6)]
    choose = lambda i, logits, hidden: ((1, 3, 4)[i % 3], None)  # noqa: E731 - AR rows beside speculating ones
    reference = BatchedEngine(engine).run(prompts, 4, 10, choose)
    calls.clear()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        fused = BatchedEngine(engine).run(prompts, 4, 10, choose)
    assert calls and all(groups == 2 and masked for groups, masked in calls), calls[:4]
    assert [r.decode.new_ids.tolist() for r in fused.requests] == \
        [r.decode.new_ids.tolist() for r in reference.requests]
