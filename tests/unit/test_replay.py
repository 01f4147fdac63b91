"""Exact greedy replay (label.mode=replay) against exhaustive labelling, prompt by prompt (CPU, fp32)."""

import pytest
import torch
from dflash.model import DFlashDraftModel
from transformers import Qwen3Config

from pipeline.labelling import replay
from pipeline.decoding.engine import Engine
from pipeline.labelling.labels import candidate_block_sizes, label_prompt, replay_label_prompt
from pipeline.labelling.replay import PROPOSERS, replay_candidates, replay_unsupported, replay_unsupported_config
from pipeline.labelling.walks import walk
from random_pair import EOS_ID, make_pair, prompt

MAX_NEW = 24


def _compare(engine, ids, candidates, max_new, stats):
    ref = label_prompt(engine, ids, candidates, max_new)
    for proposer in PROPOSERS:
        rep = replay_label_prompt(engine, ids, candidates, max_new, proposer=proposer)
        assert rep.tau == ref.tau, f"tau differs ({proposer})"
        assert rep.steps == ref.steps and rep.new_tokens == ref.new_tokens
        assert rep.label_index == ref.label_index and rep.label_block_size == ref.label_block_size
    stats["prompts"] += 1
    stats["accepting"] += any(t > 1 for t in ref.tau)
    stats["max_new"] += ref.new_tokens[0] == max_new
    stats["stopped"] += ref.new_tokens[0] < max_new
    stats["distinct_labels"].add(ref.label_block_size)


@pytest.mark.integration  # the integration layer: a sweep of hundreds of decodes (tests/conftest.py)
def test_replay_equals_exhaustive_on_random_pairs():
    stats = {"prompts": 0, "accepting": 0, "max_new": 0, "stopped": 0, "distinct_labels": set()}
    for seed in range(4):
        for B in (4, 6):
            target, draft = make_pair(seed, block_size=B)
            cands = candidate_block_sizes(B, 2 if B > 3 else 1)
            free = Engine(target, draft)
            for p in range(3):
                ids = prompt(seed * 10 + p, length=8 + p)
                # A stop token that the greedy continuation reaches mid-way: both modes must cut there.
                g = free.decode(free.prefill(ids), block_size=B, max_new_tokens=MAX_NEW).new_ids.tolist()
                stop = g[min(len(g) - 1, 9 + p)]
                for stops in ([EOS_ID], [stop]):
                    _compare(Engine(target, draft, stops), ids, cands, MAX_NEW, stats)
    assert stats["prompts"] == 48
    # The comparison must have covered the interesting cases, not only trivial ones.
    assert stats["accepting"] > 10 and stats["max_new"] > 5 and stats["stopped"] > 5
    assert len(stats["distinct_labels"]) >= 2


def test_walk_clips_like_the_engine():
    g = [0, 0, 5, 6, 7, 8, 9]  # prompt of 2, then 5 new tokens
    always_right = lambda s, vs: g[s + 1:s + vs]  # noqa: E731
    assert walk(g, 2, 7, 4, always_right, []) == [4]  # 3 accepted + bonus: the 4 tokens after the first
    assert walk(g, 2, 7, 3, always_right, []) == [3, 1]  # the last step is clipped at max_length
    assert walk(g, 2, 7, 4, always_right, [7]) == [2]  # the stop token ends the step at itself
    assert walk(g, 2, 7, 1, always_right, []) == [1, 1, 1, 1]
    never = lambda s, vs: [-1] * (vs - 1)  # noqa: E731
    assert walk(g, 2, 7, 4, never, []) == [1, 1, 1, 1]
    assert walk([0, 0, 9], 2, 7, 4, never, [9]) == []  # first token is a stop token: no step


def test_replay_refuses_sampling():
    target, draft = make_pair(0)
    with pytest.raises(ValueError, match="temperature 0"):
        replay_label_prompt(Engine(target, draft), prompt(0), [3, 4, 5], 10, temperature=0.8)


@pytest.mark.integration  # the integration layer: a sweep of hundreds of decodes (tests/conftest.py)
def test_replay_equals_exhaustive_on_the_tiny_pair():
    """The shipped pair (fp32, CPU) on 2 held-out prompts of each kind of the default's label sources (10): half
    stop at a newline token (stop-token clipping), half run to max_new_tokens. (At 4 of each kind it took 18 s of the
    unit layer's 3 minutes; 10 cover each case several times: 10 accepting, 4 stopped, 6 run to the budget, 4
    distinct labels, 2026-12-06.)"""
    from pipeline.runtime.config import KINDS, ModelConfig, load_config
    from pipeline.decoding.models import load_models
    from pipeline.data.sources import build_prompts

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    rows, _, _ = build_prompts(load_config().prepare.sources, m.tokenizer, 1024, limit=2)
    newline = m.tokenizer("\n", add_special_tokens=False)["input_ids"]
    stats = {"prompts": 0, "accepting": 0, "max_new": 0, "stopped": 0, "distinct_labels": set()}
    for i, row in enumerate(rows):
        stops = m.stop_token_ids if i % 2 else m.stop_token_ids + newline[-1:]
        ids = torch.tensor(row["input_ids"])[None]
        _compare(Engine(m.target, m.draft, stops), ids, candidate_block_sizes(8, 2), 32, stats)
    assert stats["prompts"] == 2 * len(KINDS) and stats["accepting"] >= 3
    assert stats["max_new"] >= 2 and stats["stopped"] >= 2
    assert len(stats["distinct_labels"]) >= 2


# ---- per step, against the engine, for every draft variant replay models -----------------------------------------

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)  # causal (dflash's default)
VARIANTS = {
    "full": {},
    "sliding_window": SLIDING,
    # A non-causal sliding layer: the window also cuts forward inside a block (b > 3).
    "sliding_window_bidirectional": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=3,
                                         is_causal=False),
    "causal": dict(is_causal=True),
    "dflash2": dict(dflash2=True),
}
ALL_B = [1, 2, 3, 4, 5, 6]  # b = 1 included; b = 6 > B


def _engine_steps(engine, state, candidates, max_new):
    return {b: engine.decode(state, block_size=b, max_new_tokens=max_new).committed for b in candidates}


def _assert_steps_equal(engine, state, candidates, max_new, **kw):
    """Every proposer's per-step committed counts == the engine's own decode at every candidate."""
    ref = _engine_steps(engine, state, candidates, max_new)
    for proposer in PROPOSERS:
        rep = replay_candidates(engine, state, candidates, max_new, proposer=proposer, **kw)
        assert {b: rep[b]["committed"] for b in candidates} == ref, f"{proposer}: per-step counts differ"
    return ref


@pytest.mark.parametrize("variant", VARIANTS)
def test_replay_steps_equal_the_engine_per_draft_variant(variant):
    max_new, stats = 16, {"accepting": 0, "stopped": 0, "max_new": 0}
    for seed in (0, 1):
        target, draft = make_pair(seed, block_size=4, **VARIANTS[variant])
        assert replay_unsupported(draft) is None
        free = Engine(target, draft)
        for p in (0, 1):
            ids = prompt(seed * 10 + p, length=6 + p)  # longer than the window: it cuts the context
            mid_way = free.decode(free.prefill(ids), block_size=4, max_new_tokens=max_new).new_ids[7].item()
            for stops in ([EOS_ID], [mid_way]):  # the second: a stop token the continuation reaches mid-way
                engine = Engine(target, draft, stops)
                ref = _assert_steps_equal(engine, engine.prefill(ids), ALL_B, max_new)
                stats["accepting"] += sum(max(steps, default=1) > 1 for steps in ref.values())
                stats["stopped" if sum(ref[1]) + 1 < max_new else "max_new"] += 1
    assert stats["accepting"] >= 4 and stats["stopped"] >= 2 and stats["max_new"] >= 2, stats


@pytest.mark.parametrize("variant", VARIANTS)
def test_blocks_side_by_side_equal_blocks_drafted_alone(variant):
    """The lockstep / all_starts layout (several blocks in one draft forward: our per-layer masks, DFlash2's
    convolutions cut at block edges) gives each block the hidden states it gets alone, where dflash builds the
    masks itself from a contiguous key sequence, as in the engine. Float-level, so any mask slip shows."""
    target, draft = make_pair(0, block_size=4, **VARIANTS[variant])
    engine = Engine(target, draft)
    ref = engine.decode(engine.prefill(prompt(0, length=6)), block_size=4, max_new_tokens=16, keep_context=True)
    runner = replay.DraftReplay(draft, target, ref.output_ids[0], ref.context)
    n_ctx = ref.context.shape[1]
    blocks = [(b, s, b) for b, s in zip([6, 2, 5, 3, 4, 6], range(6, n_ctx + 1, 2))]
    together = runner.block_hidden(blocks)
    for block, h in zip(blocks, together):
        torch.testing.assert_close(h, runner.block_hidden([block])[0], rtol=1e-5, atol=1e-5, msg=f"block {block}")


def test_replay_edge_cases_equal_the_engine():
    target, draft = make_pair(0, block_size=4)
    engine = Engine(target, draft, [EOS_ID])
    _assert_steps_equal(engine, engine.prefill(prompt(1, length=1)), ALL_B, 12)  # a one-token prompt
    state = engine.prefill(prompt(0, length=8))
    ref = _assert_steps_equal(engine, state, candidate_block_sizes(4, 0), 12)  # k = 0: B alone
    assert list(ref) == [4] and max(ref[4]) > 1
    _assert_steps_equal(engine, state, [1, 2, 3], 12, reference_block_size=5)  # reference outside the candidates
    one = replay_label_prompt(engine, prompt(0, length=8), [4], 12)
    assert one.label_block_size == 4 and one.tau == label_prompt(engine, prompt(0, length=8), [4], 12).tau


def test_all_starts_in_several_chunks_equals_the_engine(monkeypatch):
    made = []

    class Spy(replay.AllStartsTable):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(replay, "AllStartsTable", Spy)
    monkeypatch.setattr(replay, "ALL_STARTS_MAX_QUERIES", 7)  # a chunk closes at >= 7 query rows
    target, draft = make_pair(0, block_size=4, **SLIDING)
    engine = Engine(target, draft, [EOS_ID])
    state = engine.prefill(prompt(1, length=7))
    ref = _engine_steps(engine, state, ALL_B, 16)
    rep = replay_candidates(engine, state, ALL_B, 16, proposer="all_starts")
    assert {b: rep[b]["committed"] for b in ALL_B} == ref
    assert made[0].runner.forwards >= 5 and len(made[0].table) > 20


def test_dflash2_fails_where_the_engine_fails():
    """dflash's DFlash2 convolution cannot run on a block shorter than kernel_size - 1 tokens: the engine fails
    on such a step, so replay must fail too rather than invent a label."""
    target, draft = make_pair(0, block_size=4, dflash2=True, conv_kernel_size=4)
    free = Engine(target, draft)
    ids = prompt(0, length=6)
    g = free.decode(free.prefill(ids), block_size=1, max_new_tokens=16).new_ids  # b = 1 never drafts
    engine = Engine(target, draft, [g[3].item()])  # stops long before the budget's short last blocks
    state = engine.prefill(ids)
    assert engine.decode(state, block_size=4, max_new_tokens=16).stopped
    with pytest.raises(RuntimeError):
        engine.decode(state, block_size=2, max_new_tokens=16)
    for proposer in PROPOSERS:
        with pytest.raises(RuntimeError, match="convolution"):
            replay_candidates(engine, state, [2, 3, 4], 16, proposer=proposer)
        assert replay_candidates(engine, state, [3, 4], 16, proposer=proposer)[3]["committed"] == \
            engine.decode(state, block_size=3, max_new_tokens=16).committed


# ---- refusal ------------------------------------------------------------------------------------------------------

def test_replay_refuses_what_it_does_not_model_before_any_work(monkeypatch):
    target, draft = make_pair(0, block_size=4)

    class MyDraft(DFlashDraftModel):
        pass

    chunked = make_pair(0, block_size=4)[1]
    chunked.config.layer_types = ["chunked_attention"]
    for bad, name in ((MyDraft(draft.config).eval(), "MyDraft"), (chunked, "chunked_attention")):
        assert name in replay_unsupported(bad)
        engine = Engine(target, bad)
        state = engine.prefill(prompt(0))
        monkeypatch.setattr(engine, "decode", lambda *a, **k: pytest.fail("replay worked before refusing"))
        for proposer in PROPOSERS:
            with pytest.raises(ValueError, match=name):
                replay_candidates(engine, state, [3, 4, 5], 8, proposer=proposer)
    # From the config alone (what the label stage's driver has).
    assert replay_unsupported_config(make_pair(0, **SLIDING)[1].config) is None
    assert replay_unsupported_config(make_pair(0, dflash2=True)[1].config) is None
    assert "chunked_attention" in replay_unsupported_config(chunked.config)
    assert "EagleDraft" in replay_unsupported_config({**draft.config.to_dict(), "architectures": ["EagleDraft"]})
    no_window = Qwen3Config(num_hidden_layers=1, layer_types=["sliding_attention"])  # use_sliding_window unset
    assert "sliding_window" in replay_unsupported_config(no_window)


def test_label_mode_auto_falls_back_to_exhaustive_where_replay_is_unproven(tmp_path, caplog):
    import logging

    from pipeline.runtime.config import ConfigError, load_config
    from stages.label import resolve_mode

    caplog.set_level(logging.INFO, logger="blockpilot")

    def said():
        lines = [f"[{r.name.split('.', 1)[1]}] {r.getMessage()}" for r in caplog.records]
        caplog.clear()
        return lines

    def cfg_with(config, *overrides):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        config.save_pretrained(folder)
        return load_config([f"model.draft={folder}", *overrides])

    sliding = make_pair(0, **SLIDING)[1].config
    assert resolve_mode(cfg_with(sliding)) == "replay" and said() == []
    chunked = Qwen3Config.from_dict({**sliding.to_dict(), "layer_types": ["chunked_attention", "full_attention"]})
    assert resolve_mode(cfg_with(chunked)) == "exhaustive"
    out = said()
    assert len(out) == 1 and out[0].startswith("[label] mode auto: exhaustive, because replay does not model")
    assert "chunked_attention" in out[0]
    with pytest.raises(ConfigError, match="label.mode.*chunked_attention"):
        resolve_mode(cfg_with(chunked, "label.mode=replay"))
    other = Qwen3Config.from_dict({**sliding.to_dict(), "architectures": ["EagleDraft"]})
    assert resolve_mode(cfg_with(other)) == "exhaustive" and "EagleDraft" in " ".join(said())
    # Sampling never replays, whatever the draft; exhaustive never reads it.
    assert resolve_mode(load_config(["model.draft=/nonexistent", "decode.temperature=0.7"])) == "exhaustive"
    assert resolve_mode(load_config(["model.draft=/nonexistent", "label.mode=exhaustive"])) == "exhaustive"
