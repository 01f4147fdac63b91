"""The per-step trace (pipeline/labelling/trace.py, label schema v3) and the rule simulator (pipeline/policy/simulate.py):
every rule simulated from a recorded trace verifies and commits, step by step, exactly what Engine.decode with that
rule does at T = 0, on random pairs (DFlash2 included) and on the bundled tiny pair, with stop tokens and the
max_new_tokens cut; batched traces equal batch-1 traces. CPU, fp32, 1 thread."""

import pytest
import torch

from pipeline.decoding.engine import Engine
from pipeline.labelling import trace as trace_mod
from pipeline.labelling.batched import batched_replay_label_prompts
from pipeline.labelling.labels import label_prompt, replay_label_prompt
from pipeline.policy.simulate import Trace, pack_traces, simulate, simulate_many
from pipeline.policy.step_rules import ConfidenceThreshold, Full, RunningAcceptance
from random_pair import EOS_ID, learned_rule, make_pair, prompt

B_MAX = 6
RULES = [Full(), ConfidenceThreshold(0.9), ConfidenceThreshold(0.3), ConfidenceThreshold(0.05),
         ConfidenceThreshold(1.0), ConfidenceThreshold(0.3, min_tokens=2), RunningAcceptance(0.5, 0.0),
         RunningAcceptance(0.3, 2.0), RunningAcceptance(1.0, 1.0), learned_rule(B_MAX),
         learned_rule(B_MAX, slope=0.05, w_prev=-0.3),
         learned_rule(B_MAX, rate=2.5), learned_rule(B_MAX, slope=0.05, rate=4.0)]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _assert_simulated_equals_decoded(engine, ids, trace, max_new, rules, stats):
    """Every rule: simulate(trace) == the engine's own decode with the rule, verified AND committed lists; and
    simulate_many over copies of the trace agrees with simulate."""
    state = engine.prefill(ids)
    for rule in rules:
        res = engine.decode(state, block_size=trace.block_size, max_new_tokens=max_new, step_rule=rule)
        assert trace.new_tokens == res.new_tokens and trace.stopped == res.stopped
        got = simulate(trace, rule, max_new)
        assert got == (res.verified, res.committed), f"{rule.describe()}: simulated != decoded"
        many = simulate_many([trace, trace], rule, max_new)
        assert many.verified == [res.verified] * 2 and many.committed == [res.committed] * 2
        cut = any(1 < v < trace.block_size - 1 for v in res.verified)
        stats["cut"] += cut
        stats[f"cut:{rule.name}"] = stats.get(f"cut:{rule.name}", 0) + cut
        stats["steps"] += res.steps
    stats["stopped" if trace.stopped else "max_new"] += 1


def _assert_same_trace(a: Trace, b: Trace):
    assert (a.block_size, a.match, a.stopped) == (b.block_size, b.match, b.stopped)
    assert [len(c) for c in a.confidence] == [len(c) for c in b.confidence]
    for x, y in zip(a.confidence, b.confidence):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-5)


VARIANTS = {"full": {}, "dflash2": dict(dflash2=True),
            "sliding_window": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_simulated_equals_decoded_on_random_pairs(variant):
    """Batch-1 replay's trace and batched replay's trace, each against the engine, for every rule; a stop token
    reached mid-way, and short budgets (the max_new_tokens cut, blocks narrower than b_max near it). One random pair
    per variant: each met every case many times over (65-74 cut steps, 6-12 stopped and 6-12 budget-cut decodes,
    38-40 cuts by the learned rules, 2026-12-06); a second seed doubled the test's 35 s in the unit layer."""
    stats = {"cut": 0, "steps": 0, "stopped": 0, "max_new": 0}
    for seed in (0,):
        target, draft = make_pair(seed, block_size=B_MAX, **VARIANTS[variant])
        prompts = [prompt(seed * 10 + p, length=n) for p, n in enumerate((5, 9, 3))]
        free = Engine(target, draft)
        mid_way = free.decode(free.prefill(prompts[0]), block_size=B_MAX, max_new_tokens=24).new_ids[9].item()
        for stops, max_new in (([EOS_ID], 24), ([EOS_ID, mid_way], 24), ([EOS_ID], 7)):
            engine = Engine(target, draft, stops)
            batched = batched_replay_label_prompts(engine, prompts, [3, B_MAX], max_new, trace_block_size=B_MAX)
            for ids, got in zip(prompts, batched):
                one = replay_label_prompt(engine, ids, [B_MAX], max_new, trace_block_size=B_MAX)
                _assert_same_trace(got.trace, one.trace)
                _assert_simulated_equals_decoded(engine, ids, one.trace, max_new, RULES, stats)
                _assert_simulated_equals_decoded(engine, ids, got.trace, max_new, RULES[:3] + RULES[-1:], stats)
    assert stats["cut"] >= 10 and stats["stopped"] >= 2 and stats["max_new"] >= 4, stats
    assert stats["cut:learned"] >= 4 and stats["cut:threshold"] >= 4, stats


@pytest.mark.integration  # the integration layer: a sweep of hundreds of decodes (tests/conftest.py)
def test_simulated_equals_decoded_on_the_tiny_pair():
    """The shipped pair at b_max = 2B = 16 on real prompts: with a newline stop token some stop early, a short
    budget cuts the others; the batched trace (what the label stage records) is simulated against the engine. One
    prompt of each kind (5): 69 cut steps, 3 stopped and 7 budget-cut decodes, 20 cuts by the learned rules
    (2026-12-06; two of each took 15 s of the unit layer)."""
    from pipeline.data.sources import build_prompts
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import ModelConfig, load_config

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    rows, _, _ = build_prompts(load_config().prepare.sources, m.tokenizer, 1024, limit=1)
    prompts = [torch.tensor(r["input_ids"])[None] for r in rows]
    newline = m.tokenizer("\n", add_special_tokens=False)["input_ids"][-1:]
    rules = [Full(), ConfidenceThreshold(0.01), ConfidenceThreshold(0.05), ConfidenceThreshold(0.3),
             RunningAcceptance(0.5, 1.0), learned_rule(16, slope=0.05), learned_rule(16, slope=0.3)]
    stats = {"cut": 0, "steps": 0, "stopped": 0, "max_new": 0}
    for stops, max_new in ((m.stop_token_ids + newline, 40), (m.stop_token_ids, 20)):
        engine = Engine(m.target, m.draft, stops)
        batched = batched_replay_label_prompts(engine, prompts, [8], max_new, trace_block_size=16)
        for ids, got in zip(prompts, batched):
            assert got.trace.block_size == 16 and got.trace_seconds > 0
            _assert_simulated_equals_decoded(engine, ids, got.trace, max_new, rules, stats)
        one = replay_label_prompt(engine, prompts[0], [8], max_new, trace_block_size=16)
        _assert_same_trace(batched[0].trace, one.trace)
    assert stats["cut"] >= 4 and stats["stopped"] >= 1 and stats["max_new"] >= 1, stats
    assert stats["cut:learned"] >= 2, stats


@pytest.mark.parametrize("variant", ["full", "causal", "dflash2"])
def test_batched_traces_equal_batch1_traces_in_small_chunks(variant, monkeypatch):
    """Forwards of at most 12 query rows: waves of one start per prompt, two prompts per forward; prompts of
    different lengths (padding) and one that stops at once (no start at all)."""
    monkeypatch.setattr(trace_mod, "TRACE_MAX_ROWS", 12)
    kw = {"full": {}, "causal": dict(is_causal=True), "dflash2": dict(dflash2=True)}[variant]
    target, draft = make_pair(2, block_size=4, **kw)
    prompts = [prompt(20 + p, length=n) for p, n in enumerate((4, 11, 1, 7))]
    first = Engine(target, draft).decode(Engine(target, draft).prefill(prompts[2]), block_size=4,
                                         max_new_tokens=1).new_ids[0].item()
    engine = Engine(target, draft, [EOS_ID, first])
    batched = batched_replay_label_prompts(engine, prompts, [2, 4], 16, trace_block_size=5)
    assert batched[2].trace.match == [] and batched[2].trace.stopped
    for ids, got in zip(prompts, batched):
        _assert_same_trace(got.trace, replay_label_prompt(engine, ids, [4], 16, trace_block_size=5).trace)


def test_exhaustive_mode_records_the_same_trace_at_t0_and_none_when_sampling():
    target, draft = make_pair(3, block_size=4)
    engine = Engine(target, draft, [EOS_ID])
    ids = prompt(3, length=6)
    ref = replay_label_prompt(engine, ids, [3, 4, 5], 16, trace_block_size=B_MAX).trace
    _assert_same_trace(label_prompt(engine, ids, [3, 4, 5], 16, trace_block_size=B_MAX).trace, ref)
    sampled = label_prompt(engine, ids, [3, 4, 5], 16, temperature=0.8, trace_block_size=B_MAX)
    assert sampled.trace is None and sampled.trace_seconds is None
    assert label_prompt(engine, ids, [3, 4], 16).trace is None  # not asked for


def test_a_block_the_engine_cannot_draft_fails_in_the_simulator_too():
    """DFlash2 with a kernel of 4 cannot draft a 2-token block: the trace leaves that start empty, and a rule that
    reaches it fails in the simulator exactly where the engine fails."""
    from pipeline.labelling.greedy import greedy_continuations
    from pipeline.labelling.runner import DraftRunner

    target, draft = make_pair(0, block_size=4, dflash2=True, conv_kernel_size=4)
    engine = Engine(target, draft)
    outcomes = set()
    for p, max_new in ((0, 16), (0, 13), (1, 15), (1, 14), (2, 12)):
        ids = prompt(p, length=6)
        # g and its features from the target alone: a reference decode could itself reach the block it cannot draft.
        news, context, _, _ = greedy_continuations(target, ids.tolist(), max_new, None,
                                                   layer_ids=draft.target_layer_ids)
        runner = DraftRunner(draft, target, [ids[0].tolist() + news[0]], context, fast=False)
        trace = trace_mod.record_traces(runner, [6], max_new, 4, None)[0]
        assert trace.confidence[-1] == [] and all(len(c) for c in trace.confidence[:-1])
        state = engine.prefill(ids)
        for rule in RULES:
            try:
                res = engine.decode(state, block_size=4, max_new_tokens=max_new, step_rule=rule)
            except RuntimeError:
                with pytest.raises(RuntimeError, match="convolution"):
                    simulate(trace, rule, max_new)
                with pytest.raises(RuntimeError, match="convolution"):
                    simulate_many([trace], rule, max_new)
                outcomes.add("fails")
            else:
                assert simulate(trace, rule, max_new) == (res.verified, res.committed)
                outcomes.add("decodes")
    assert outcomes == {"fails", "decodes"}


# ---- the simulator's own arithmetic, on hand-made traces ---------------------------------------------------------

def _trace(match, widths, stopped=False, b=4):
    return Trace(b, list(match), [[0.5] * w for w in widths], stopped)


def test_the_walk_the_cut_and_the_check():
    # 6 new tokens, no stop, max_new 6, b_max 4: widths min(4, 6 - i) - 1.
    t = _trace([3, 0, 1, 2, 1], [3, 3, 3, 2, 1])
    assert simulate(t, Full(), 6) == ([3, 1], [4, 1])  # offset 0: 3 accepted + bonus; offset 4: clipped at the end
    assert simulate(t, ConfidenceThreshold(0.3), 6) == ([1, 1, 1], [2, 2, 1])  # 0.5 | 0.25: one token a step
    assert simulate(t, RunningAcceptance(1.0, 0.0), 6) == ([3, 1], [4, 1])
    stopped = _trace([2, 2], [3, 3], stopped=True)  # 3 new tokens, the last a stop token, max_new 10
    assert simulate(stopped, Full(), 10) == ([3], [2])  # the step is cut at the stop
    assert simulate(_trace([], [], stopped=True), Full(), 10) == ([], [])  # the first token stops
    for bad in (_trace([3, 0], [3, 3]), _trace([4], [3]), _trace([1], [3], b=1)):
        with pytest.raises(ValueError):
            simulate(bad, Full(), 6)
    with pytest.raises(ValueError, match="confidence outside"):
        simulate(Trace(4, [0], [[float("nan"), 0.5, 0.5]], True), Full(), 6)


def test_simulate_many_equals_simulate_for_every_rule_and_any_rule_object():
    gen = torch.Generator().manual_seed(0)
    traces = []
    for p in range(12):
        new = int(torch.randint(1, 30, (1,), generator=gen))
        widths = [min(6, 29 - i) - 1 for i in range(new - 1)]
        conf = [torch.rand(w, generator=gen).tolist() for w in widths]
        match = [int(torch.randint(0, w + 1, (1,), generator=gen)) for w in widths]
        traces.append(Trace(6, match, conf, new < 29 or p % 2 == 0))  # at the cap: stopped there, or not

    class Greedy:  # a rule simulate_many has no numpy path for
        def verify_length(self, confidence, committed):
            return int(min(confidence.numel(), 1 + len(committed) % 3))

        def describe(self):
            return {"rule": "greedy"}

    packed = pack_traces(traces, 29)
    for rule in RULES + [learned_rule(6, slope=0.05), Greedy()]:
        many = simulate_many(traces, rule, 29)
        one = [simulate(t, rule, 29) for t in traces]
        assert many.verified == [v for v, _ in one] and many.committed == [c for _, c in one], rule.describe()
        assert simulate_many(packed, rule) == many
        assert many.steps.tolist() == [len(c) for _, c in one]
        assert [sum(c) for c in many.committed] == [t.new_tokens - 1 for t in traces]
