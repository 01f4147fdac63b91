"""engine.compile (pipeline/decoding/compiled.py): at T = 0 the compiled forwards decode token for token what eager
decodes, and what plain greedy decoding gives, at batch 1 and batched, on 64 prompts with mixed b (CPU, fp32).

The reference is the target's own greedy decode (greedy_reference, no engine, no cache reuse): a cache one position
off in either engine changes the tokens and fails here, as a mismatch between the two engines would."""

from types import SimpleNamespace

import pytest
import torch

from pipeline.decoding.batched import BatchedEngine
from pipeline.decoding.compiled import apply_compile, wants_compile
from pipeline.decoding.engine import Engine, greedy_reference
from random_pair import EOS_ID, make_pair, prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
NEW = 12
SIZES = (1, 2, 3, 5, 8)


def _decode_all(engine, prompts):
    batch1 = []
    for i, p in enumerate(prompts):
        state = engine.prefill(torch.tensor([p]))
        batch1.append(engine.decode(state, SIZES[i % len(SIZES)], NEW).new_ids.tolist())
    run = BatchedEngine(engine).run(prompts, 16, NEW, lambda i, logits, hidden: (SIZES[(i + 1) % len(SIZES)], None))
    return batch1, [r.decode.new_ids.tolist() for r in run.requests]


def test_compiled_decodes_equal_eager_and_greedy_at_batch_1_and_batched():
    target, draft = make_pair(3)
    prompts = [prompt(i, length=1 + (7 * i) % 29).tolist()[0] for i in range(64)]
    truth = [greedy_reference(target, torch.tensor([p]), NEW, [EOS_ID])[0, len(p):].tolist() for p in prompts]
    engine = Engine(target, draft, [EOS_ID])
    eager = _decode_all(engine, prompts)
    assert apply_compile(SimpleNamespace(target=target, draft=draft), "on")
    assert getattr(target.model.forward, "blockpilot_compiled", False)
    torch._dynamo.reset()
    compiled = _decode_all(engine, prompts)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # both models really ran compiled
    assert compiled == eager
    assert compiled[0] == truth and compiled[1] == truth
    assert any(len(t) < NEW for t in truth) and any(len(t) == NEW for t in truth)  # stops and budgets both seen


def test_auto_is_eager_on_cpu_and_bad_modes_are_refused():
    assert not wants_compile("auto", "cpu") and wants_compile("auto", "cuda") and wants_compile("on", "cpu")
    assert not wants_compile("off", "cuda")
    with pytest.raises(ValueError, match="engine.compile"):
        wants_compile("yes", "cpu")
