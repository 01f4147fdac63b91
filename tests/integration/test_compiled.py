"""engine.compile (pipeline/decoding/compiled.py): at T = 0 the compiled forwards decode token for token what eager
decodes, and what plain greedy decoding gives, at batch 1 and batched, with every b, a stop and a budget end (CPU,
fp32). In the integration layer: the compiles are the test's cost, 8 graphs with a cold inductor cache (12 with
dynamo's duck shapes, which compile_forward turns off: benchmarks/compile_shapes.py); batch 1 and batched are both
what it proves. The whole test alone, cold cache: 99 user CPU-s (93 s) with a 2-layer target, 148 (140 s) with the
3 layers it had before (2026-12-06, one run each).

The reference is the target's own greedy decode (greedy_reference, no engine, no cache reuse): a cache one position
off in either engine changes the tokens and fails here, as a mismatch between the two engines would. That the
compiled decodes really ran compiled is checked, not assumed: after a silent fallback to eager "compiled equals
eager" would hold trivially. compile_forward counts the calls that went through the compiled function and those run
eager, and records a fallback; both counts must be exactly what the eager decode's forwards give (the first forward
given each cache, which creates its layers, eager; every other compiled), so that a fallback for all but a few
forwards fails too; dynamo's own silent fallback (at its recompile limit) is made an error for the test; and the
graphs are counted from a cleared counter (dynamo's counters are process-wide; ``torch._dynamo.reset()`` does not
clear them)."""

import gc
from types import SimpleNamespace

import pytest
import torch

from pipeline.decoding.batched import BatchedEngine
from pipeline.decoding.compiled import apply_compile, compile_state
from pipeline.decoding.engine import Engine, greedy_reference
from random_pair import EOS_ID, make_pair, prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
NEW = 12
SIZES = (1, 2, 3, 5, 8)
PROMPTS = 10  # each b twice at batch 1, and once more in the batched run


def workload():
    """The pair (a 2-layer target: each target layer is more graph for dynamo and inductor to trace, and one layer
    or three prove the same cache arithmetic) and the prompts (lengths 1..29; seed 71's greedy continuation stops at
    EOS within the budget, the others run to it, asserted in the test); benchmarks/compile_shapes.py times this same
    workload."""
    target, draft = make_pair(3, target_layers=2)
    return target, draft, [prompt(i, length=1 + (7 * i) % 29).tolist()[0] for i in [71, *range(PROMPTS - 1)]]


def decode_all(engine, prompts):
    batch1 = []
    for i, p in enumerate(prompts):
        state = engine.prefill(torch.tensor([p]))
        batch1.append(engine.decode(state, SIZES[i % len(SIZES)], NEW).new_ids.tolist())
    run = BatchedEngine(engine).run(prompts, 4, NEW, lambda i, logits, hidden: (SIZES[(i + 1) % len(SIZES)], None))
    return batch1, [r.decode.new_ids.tolist() for r in run.requests]


def count_forwards(module, firsts: list):
    """A hook appending, for each forward of ``module``, whether it is the first given its cache (past_key_values):
    the forwards compile_forward runs eager (they create the cache's layers), told by the cache's identity, not by
    compiled.py's own test of the layers. Returns the hook's handle."""
    caches = []  # held, so that no cache's id is reused by a later one

    def hook(_module, args, kwargs):
        cache = kwargs.get("past_key_values")
        first = cache is not None and not any(c is cache for c in caches)
        if first:
            caches.append(cache)
        firsts.append(first)

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def test_compiled_decodes_equal_eager_and_greedy_at_batch_1_and_batched():
    target, draft, prompts = workload()
    truth = [greedy_reference(target, torch.tensor([p]), NEW, [EOS_ID])[0, len(p):].tolist() for p in prompts]
    assert any(len(t) < NEW for t in truth) and any(len(t) == NEW for t in truth)  # stops and budgets both seen
    engine = Engine(target, draft, [EOS_ID])
    firsts = {"target": [], "draft": []}
    hooks = [count_forwards(target.model, firsts["target"]), count_forwards(draft, firsts["draft"])]
    eager = decode_all(engine, prompts)
    for hook in hooks:
        hook.remove()
    # what the compiled decode must count: the same forwards, as it decodes the same tokens
    expected = {name: {"compiled_calls": f.count(False), "eager_calls": f.count(True)} for name, f in firsts.items()}
    assert expected["target"]["eager_calls"] == PROMPTS  # a prefill a prompt at batch 1 (the batched one: no cache)
    assert apply_compile(SimpleNamespace(target=target, draft=draft), "on")
    torch._dynamo.reset()
    gc.collect()  # garbage of earlier tests dies here, not inside the compile's tracing (VllmEngine.shutdown says why)
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        compiled = decode_all(engine, prompts)
    for name, module in (("target", target.model), ("draft", draft)):
        state = compile_state(module)
        assert state == {**expected[name], "fallback": None}, (name, state)
    # both models' graphs, built in this test; at most 8, as compile_forward's shapes give (with duck shapes: 12)
    assert 2 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 8
    assert compiled == eager
    assert compiled[0] == truth and compiled[1] == truth
