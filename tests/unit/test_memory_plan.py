"""The memory plan (pipeline.decoding.memory): its arithmetic on configs small enough to check by hand, the batch it
picks for a budget, and its cache bytes against the tensors the code really allocates on a random pair. How close
its peaks come to measured ones: benchmarks/memory_plan.py (no wall clock or RSS here)."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from pipeline.decoding import memory
from pipeline.decoding.memory import LabelMemory, auto_batch_size, engine_plan, policy_plan, shape
from random_pair import make_pair, prompt

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)
WEIGHTS = {"target weights": 1000, "draft weights": 100}  # given, so that nothing is built


def small_pair():
    draft = Qwen3Config(**{**SMALL, "num_hidden_layers": 1}, num_target_layers=3)
    draft.dflash_config = {"block_size": 4, "mask_token_id": 63, "target_layer_ids": [0, 2]}
    return Qwen3Config(**SMALL), draft


def test_kv_and_feature_bytes_by_hand():
    target, draft = small_pair()
    plan = LabelMemory(target, draft, torch.float32, prompt_tokens=10, max_new_tokens=6, candidates=[2, 3, 4],
                       device="cpu", weights=WEIGHTS).at(5)
    # target KV per position: K and V x 3 layers x 1 kv head x head_dim 16 x 4 bytes = 384
    assert plan.phases["handoff"]["target KV (static cache)"] == 5 * (10 + 6) * 384
    assert plan.phases["handoff"]["prompt KV copy"] == 5 * 10 * 384
    # features: 2 target layers x hidden 32 x 4 bytes, positions 0 .. n + m - 2, three copies at the decode's end
    assert plan.phases["features"]["draft features x3 (list, cat, gather)"] == 3 * 5 * 15 * 256
    # the draft's KV: 2 x 1 layer x 1 kv head x 16 x 4 = 128 bytes, context positions + the throw-away block's
    assert plan.phases["walks"]["draft KV"] == 5 * 16 * 128
    assert plan.phases["handoff"]["prefill logits"] == 5 * 64 * 4
    assert plan.peak == sum(WEIGHTS.values()) + max(sum(p.values()) for p in plan.phases.values())
    bf16 = LabelMemory(target, draft, "bfloat16", 10, 6, [2, 3, 4], device="cpu", weights=WEIGHTS).at(5)
    assert bf16.phases["handoff"]["target KV (static cache)"] * 2 == plan.phases["handoff"]["target KV (static cache)"]


def test_dict_configs_read_as_config_objects():
    target, draft = small_pair()
    assert shape(SMALL) == shape(target)
    assert memory.feature_layers(draft.to_dict()) == memory.feature_layers(draft) == 2
    # no dflash_config: dflash's default layer choice (one draft layer reads the middle target layer)
    assert memory.feature_layers({**SMALL, "num_hidden_layers": 1, "num_target_layers": 3}) == 1


def test_chunk_constants_are_the_codes():
    from pipeline.labelling import greedy, runner, trace

    assert (memory.PREFILL_GROUP, memory.HEAD_ROWS, memory.TRACE_MAX_ROWS) == \
        (greedy.PREFILL_GROUP, runner.HEAD_ROWS, trace.TRACE_MAX_ROWS)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_the_models(tied):
    cfg = Qwen3Config(**SMALL, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg)
    assert memory.parameter_count(cfg) == sum(p.numel() for p in model.parameters())
    _, draft = make_pair(0)
    assert memory.parameter_count(draft.config, draft=True) == sum(p.numel() for p in draft.parameters())
    assert memory.parameter_count({**SMALL, "model_type": "qwen3", "tie_word_embeddings": tied}) == \
        memory.parameter_count(cfg)


def test_auto_batch_size_fits_and_grows_with_the_budget():
    target, draft = small_pair()
    mem = LabelMemory(target, draft, torch.float32, 100, 50, [2, 3, 4], 5, device="cpu", weights=WEIGHTS)
    batches = []
    for budget in [0, 10_000, 200_000, 1_000_000, 10_000_000, 10 ** 12]:
        fit = auto_batch_size(mem, budget, most=512)
        assert fit.batch >= 1 and int(fit) == fit.batch
        if fit.batch > 1 or fit.plan.peak <= budget:
            assert fit.plan.peak <= budget
        if fit.next_peak is not None:
            assert fit.next_peak > budget
        batches.append(fit.batch)
        assert f"batch {fit.batch}" in fit.describe()
    assert batches == sorted(batches) and batches[0] == 1 and batches[-1] == 512


def test_describe_names_every_part_of_the_peak():
    target, draft = small_pair()
    plan = LabelMemory(target, draft, torch.float32, 100, 50, [2, 3, 4], 5, device="cpu", weights=WEIGHTS).at(8)
    text = plan.describe()
    assert plan.peak_phase in text.splitlines()[0]
    assert all(name in text for name, b in plan.phases[plan.peak_phase].items() if b)


def test_policy_plan_counts_the_mlp():
    from pipeline.policy.blocksize import BlockSizeMLP

    plan = policy_plan(vocab=300, actions=9, hidden=16, n_layers=3, batch_size=4)
    params = sum(p.numel() for p in BlockSizeMLP(300, 9, hidden=16, n_layers=3).parameters())
    assert plan.weights["policy parameters"] == 4 * params
    assert plan.phases["step"]["Adam moments"] == 8 * params


@torch.inference_mode()
def test_planned_target_kv_is_what_greedy_and_the_engine_allocate(monkeypatch):
    """The real check: the bytes of the caches the code allocates for a random pair equal the plan's."""
    import transformers

    from pipeline.decoding.batched import BatchedEngine, fixed
    from pipeline.decoding.engine import Engine
    from pipeline.labelling.greedy import greedy_continuations
    from pipeline.labelling.runner import DraftRunner

    target, draft = make_pair(3, block_size=4)
    prompts = [prompt(i, n).tolist()[0] for i, n in enumerate([12, 9, 12])]
    n, m = 12, 7
    mem = LabelMemory(target.config, draft.config, torch.float32, n, m, [3, 4, 5], device="cpu", weights=WEIGHTS)
    plan = mem.at(len(prompts))

    made = []

    class Recording(transformers.StaticCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)
    monkeypatch.setattr(transformers, "StaticCache", Recording)
    news, context, logits, _ = greedy_continuations(target, prompts, m, None, layer_ids=draft.target_layer_ids)
    static = sum(layer.keys.nbytes + layer.values.nbytes for layer in made[0].layers)
    assert static == plan.phases["handoff"]["target KV (static cache)"]
    assert context.nbytes == plan.phases["walks"]["draft features (context)"]  # no stop: every prompt runs to m
    assert logits.nbytes == plan.phases["walks"]["prefill logits"]
    runner = DraftRunner(draft, target, [p + c for p, c in zip(prompts, news)], context)
    kv = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in runner.kv)
    assert kv == plan.phases["walks"]["draft KV"]

    be = BatchedEngine(Engine(target, draft, None))
    be.run(prompts, 2, m, fixed(4))
    eplan = engine_plan(target.config, draft.config, torch.float32, 2, n, m, 4, device="cpu", weights=WEIGHTS)
    for cache, part in ((be.tcache, "target KV (slot caches)"), (be.dcache, "draft KV (slot caches)")):
        assert sum(t.nbytes for t in cache.k + cache.v) == eplan.phases["step"][part]
