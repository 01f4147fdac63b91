"""Batched replay labelling (pipeline/labelling/batched.py) against batch-1 replay, prompt by prompt (CPU, fp32, 1 thread).

Real tiny transformers models throughout: random-weight pairs (tests/random_pair.py) for the draft variants, stop
tokens and budgets, the bundled tiny pair for real text, and a random pair at Qwen3's vocabulary (V = 151,936)
through prepare -> label -> validate -> the dataset readers.
"""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.labelling.batched import ShardBatches, batched_replay_label_prompts, length_sorted_chunks
from pipeline.labelling.greedy import greedy_continuations
from pipeline.decoding.engine import Engine, greedy_reference
from pipeline.labelling.labels import candidate_block_sizes, replay_label_prompt
from random_pair import EOS_ID, QWEN3_VOCAB, make_pair, prompt, save_wide_pair
from conftest import ONE_SOURCE

MAX_NEW = 20
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _key(labels):
    return labels.tau, labels.steps, labels.new_tokens, labels.label_index


def _assert_batched_equals_batch1(engine, prompts, candidates, max_new):
    batched = batched_replay_label_prompts(engine, prompts, candidates, max_new)
    assert len(batched) == len(prompts)
    for ids, got in zip(prompts, batched):
        ref = replay_label_prompt(engine, ids, candidates, max_new)
        assert _key(got) == _key(ref)
        assert got.candidates == ref.candidates and got.label_block_size == ref.label_block_size
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)  # the policy's feature
    return batched


VARIANTS = {
    "full": {},
    "sliding_window": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3),
    "causal": dict(is_causal=True),
    "dflash2": dict(dflash2=True),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_equals_batch1_replay_on_random_pairs(variant):
    """Prompts of different lengths in one batch (left padding), a stop token reached mid-way by some prompts,
    the max_new_tokens cut for the others, every candidate including b = 1 and b > B."""
    stats = {"stopped": 0, "max_new": 0, "accepting": 0}
    for seed in (0, 1):
        target, draft = make_pair(seed, block_size=4, **VARIANTS[variant])
        prompts = [prompt(seed * 10 + p, length=length) for p, length in enumerate((3, 12, 7, 1, 9))]
        free = Engine(target, draft)
        mid_way = free.decode(free.prefill(prompts[1]), block_size=4, max_new_tokens=MAX_NEW).new_ids[6].item()
        engine = Engine(target, draft, [EOS_ID, mid_way] if seed else [EOS_ID])  # seed 0: the budget cuts
        out = _assert_batched_equals_batch1(engine, prompts, [1, 2, 3, 4, 5, 6], MAX_NEW)
        stats["stopped"] += sum(o.new_tokens[0] < MAX_NEW for o in out)
        stats["max_new"] += sum(o.new_tokens[0] == MAX_NEW for o in out)
        stats["accepting"] += sum(max(o.tau) > 1 for o in out)
    assert stats["stopped"] >= 2 and stats["max_new"] >= 1 and stats["accepting"] >= 2, stats


@pytest.mark.integration  # the integration layer: a sweep of hundreds of decodes (tests/conftest.py)
def test_batched_equals_batch1_replay_on_the_tiny_pair():
    """The shipped pair on real prompts (64-256 tokens, so real padding): with a newline stop token most prompts
    stop early, without it they run to max_new_tokens."""
    from pipeline.runtime.config import ModelConfig, load_config
    from pipeline.decoding.models import load_models
    from pipeline.data.sources import build_prompts

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    rows, _, _ = build_prompts(load_config().prepare.sources, m.tokenizer, 1024, limit=6)
    prompts = [torch.tensor(r["input_ids"])[None] for r in rows]
    assert len({p.shape[1] for p in prompts}) > 1
    newline = m.tokenizer("\n", add_special_tokens=False)["input_ids"][-1:]
    cands = candidate_block_sizes(8, 2)
    early = _assert_batched_equals_batch1(Engine(m.target, m.draft, m.stop_token_ids + newline), prompts, cands, 24)
    full = _assert_batched_equals_batch1(Engine(m.target, m.draft, m.stop_token_ids), prompts, cands, 24)
    assert any(o.new_tokens[0] < 24 for o in early) and any(o.new_tokens[0] == 24 for o in full)
    assert len({o.label_block_size for o in early + full}) >= 2


def test_padding_does_not_change_g():
    """g of a prompt alone, and batched beside much longer and shorter prompts (left padding up to 30 tokens), is
    the target's own greedy continuation (greedy_reference), with and without stop tokens."""
    target, _ = make_pair(2)
    prompts = [prompt(i, length=length).tolist()[0] for i, length in enumerate((1, 31, 5, 18))]
    for stops in ([EOS_ID], [EOS_ID, 3], None):
        together = greedy_continuations(target, prompts, MAX_NEW, stops)
        for p, g in zip(prompts, together):
            ref = greedy_reference(target, torch.tensor([p]), MAX_NEW, stops)[0, len(p):].tolist()
            assert g == ref == greedy_continuations(target, [p], MAX_NEW, stops)[0]
    # Stop tokens do cut some continuations, and without stop tokens none is cut (the model's own eos in its
    # generation config is not a stop token here).
    target.generation_config.eos_token_id = 3
    assert any(len(g) < MAX_NEW for g in greedy_continuations(target, prompts, MAX_NEW, [3]))
    assert all(len(g) == MAX_NEW for g in greedy_continuations(target, prompts, MAX_NEW, None))


def test_first_token_stop_and_budget_of_one():
    """No verify step at all: the first token is a stop token, or max_new_tokens = 1 (tau 1, steps 0)."""
    target, draft = make_pair(0, block_size=4)
    prompts = [prompt(i, length=4 + i) for i in range(3)]
    first = greedy_continuations(target, [p.tolist()[0] for p in prompts], 1, None)
    engine = Engine(target, draft, [first[1][0]])
    out = _assert_batched_equals_batch1(engine, prompts, [2, 3, 4], 8)
    assert out[1].steps == [0, 0, 0] and out[1].tau == [1.0, 1.0, 1.0]
    out = _assert_batched_equals_batch1(Engine(target, draft), prompts, [2, 3, 4], 1)
    assert all(o.steps == [0, 0, 0] for o in out)


def test_batched_refuses_sampling_and_unmodelled_drafts():
    from dflash.model import DFlashDraftModel

    target, draft = make_pair(0)
    with pytest.raises(ValueError, match="temperature 0"):
        batched_replay_label_prompts(Engine(target, draft), [prompt(0)], [3, 4, 5], 8, temperature=0.7)

    class MyDraft(DFlashDraftModel):
        pass

    with pytest.raises(ValueError, match="MyDraft"):
        batched_replay_label_prompts(Engine(target, MyDraft(draft.config).eval()), [prompt(0)], [3, 4, 5], 8)


def test_length_sorted_chunks():
    assert length_sorted_chunks([5, 1, 3, 1, 9], 2) == [[1, 3], [2, 0], [4]]
    assert length_sorted_chunks([], 4) == []


def test_shard_batches_retry_a_failing_batch_prompt_by_prompt():
    """A batch that fails is retried prompt by prompt: the bad prompt gets its own error (a decode_error reject
    in the stage), its batch-mates their labels, and rows come back in the shard's order."""
    target, draft = make_pair(0, block_size=4)
    engine = Engine(target, draft, [EOS_ID])
    ids = [prompt(i, length=3 + i).tolist()[0] for i in range(5)]
    calls = []

    def label_batch(batch):
        calls.append(len(batch))
        if any(len(x) == 5 for x in batch):  # prompt 2 "fails", alone or in a batch
            raise RuntimeError("boom")
        return batched_replay_label_prompts(engine, batch, [3, 4], 8)

    recs = [{"prompt_id": f"p{i}"} for i in range(5)]
    batches = ShardBatches([r["prompt_id"] for r in recs], ids, 3, label_batch)
    results = []
    for rec in recs:
        try:
            results.append(_key(batches(rec)))
        except RuntimeError as err:
            results.append(str(err))
    assert results[2] == "boom"
    for i in (0, 1, 3, 4):
        assert results[i] == _key(replay_label_prompt(engine, torch.tensor([ids[i]]), [3, 4], 8))
    assert calls == [3, 1, 1, 1, 2]  # batch {0,1,2} fails -> 3 retries alone; batch {3,4} fine
    with pytest.raises(RuntimeError, match="order"):
        ShardBatches(["a", "b"], [[1], [2]], 2, label_batch)({"prompt_id": "b"})


# ---- a real vocabulary size: V = 151,936 through the label stage and the dataset code ------------------------

def test_qwen3_vocabulary_through_label_rows_and_the_dataset_code(tmp_path):
    from pipeline.runtime.config import load_config
    from pipeline.io.shards import decode_metadata
    from pipeline.executor.driver import run_stage
    from pipeline.executor.local import LocalExecutor
    from pipeline.data.validate import validate_dataset
    from stages.label import LabelStage
    from stages.prepare import PrepareStage

    target, draft = save_wide_pair(tmp_path)
    out = tmp_path / "run"
    base = [f"output_dir={out}", "progress=false", f"model.target={target}", f"model.draft={draft}",
            "model.tokenizer=bundled:tiny-target", "model.dtype=float32", "model.device=cpu",
            "decode.max_new_tokens=12", "prepare.shard_size=3", "prepare.limit=5", "label.k=1", *ONE_SOURCE,
            "profile.context_lengths=[8]", "profile.steps=2", "profile.min_repeats=1", "profile.max_repeats=1",
            "profile.max_block_size=5", "profile.concurrency=[1]", "evaluate.concurrency=[1]"]
    cfg = load_config(base + ["label.batch_size=4"])
    run_stage(PrepareStage(cfg), LocalExecutor())
    run_stage(LabelStage(cfg), LocalExecutor())
    labels = out / "labels"
    manifest = json.loads((labels / "manifest.json").read_text())
    assert sum(f["rows"] for f in manifest["files"]) == 5 and sum(f["rejects"] for f in manifest["files"]) == 0
    report = validate_dataset(str(labels))
    assert report.ok, report.render()
    shards = sorted(labels.glob("part-*.parquet"))
    meta = decode_metadata(pq.read_schema(shards[0]).metadata)
    assert meta["vocab_size"] == QWEN3_VOCAB and meta["label_batch_size"] == 4 and meta["label_mode"] == "replay"
    t = pq.read_table(shards[0])
    assert t.schema.field("logits").type.list_size == QWEN3_VOCAB
    logits = np.stack(t.column("logits").to_numpy(zero_copy_only=False))
    assert logits.shape == (3, QWEN3_VOCAB) and np.isfinite(logits).all()
    # The batched rows equal batch-1 replay's (label.batch_size=1) row for row.
    cfg1 = load_config([*base[1:], f"output_dir={tmp_path / 'run1'}", "label.batch_size=1"])
    import shutil

    shutil.copytree(out / "prompts", tmp_path / "run1" / "prompts")
    run_stage(LabelStage(cfg1), LocalExecutor())
    cols = ["prompt_id", "tau", "steps", "new_tokens", "label_block_size"]
    for shard in shards:
        assert pq.read_table(shard, columns=cols).to_pylist() == \
            pq.read_table(tmp_path / "run1" / "labels" / shard.name, columns=cols).to_pylist()


@pytest.mark.parametrize("group", [8, 2])
def test_features_captured_during_generation_equal_a_teacher_forced_pass(group, monkeypatch):
    """The context features and prefill logits read from the greedy decode's own forwards equal one teacher-forced
    forward over prompt + g (pipeline.labelling.greedy.target_features), position by position (float tolerance); with
    prefill groups of 2, the prompts (not in length order) are prefilled in several groups whose keys, values and
    features are placed into the batch's rows: g is still each prompt's own greedy continuation."""
    import pipeline.labelling.greedy
    from pipeline.labelling.greedy import target_features

    monkeypatch.setattr(pipeline.labelling.greedy, "PREFILL_GROUP", group)
    target, draft = make_pair(3, block_size=4)
    prompts = [prompt(i, length=length).tolist()[0] for i, length in enumerate((2, 11, 6, 1, 17, 6, 9))]
    for p, g in zip(prompts, greedy_continuations(target, prompts, MAX_NEW, [EOS_ID])):
        assert g == greedy_reference(target, torch.tensor([p]), MAX_NEW, [EOS_ID])[0, len(p):].tolist()
    news, context, logits, _ = greedy_continuations(target, prompts, MAX_NEW, [EOS_ID],
                                                    layer_ids=draft.target_layer_ids)
    ref_context, ref_logits, lengths = target_features(target, draft.target_layer_ids, prompts, news)
    assert news == greedy_continuations(target, prompts, MAX_NEW, [EOS_ID])
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for i, n in enumerate(lengths):  # every position a block's context can reach: 0 .. len(prompt + g) - 2
        torch.testing.assert_close(context[i, :n - 1], ref_context[i, :n - 1], rtol=1e-5, atol=1e-5)


def test_label_stage_batched_rejects_a_failing_prompt_alone(tmp_path):
    """The label stage in batched mode (no Ray: the driver's in-process executor): a prompt that fails inside its
    batch (a token id outside the vocabulary) is a decode_error reject with its id, its batch-mates are labelled
    like batch-1 replay labels them, and the label set validates."""
    import pyarrow as pa

    from pipeline.runtime.config import load_config
    from pipeline.data.schemas import PROMPTS_SCHEMA
    from pipeline.executor.driver import run_stage
    from pipeline.executor.folder import mark_complete
    from pipeline.executor.local import LocalExecutor
    from pipeline.decoding.models import load_tokenizer
    from pipeline.data.sources import build_prompts
    from pipeline.data.validate import validate_dataset
    from stages.label import LabelStage

    def cfg_for(out, *extra):
        return load_config([f"output_dir={out}", "progress=false", "decode.max_new_tokens=16", "label.k=2",
                            "profile.context_lengths=[8]", "profile.steps=2", "profile.min_repeats=1",
                            "profile.max_repeats=1", "profile.max_block_size=10", "profile.concurrency=[1]",
                            "evaluate.concurrency=[1]", *ONE_SOURCE, *extra])

    cfg = cfg_for(tmp_path / "batched", "label.batch_size=4", "label.max_reject_fraction=0.5")  # 1 of 5 rejected
    rows, _, _ = build_prompts(cfg.prepare.sources, load_tokenizer(cfg.model), 1024, limit=5)
    rows[1] = dict(rows[1], input_ids=[10 ** 7] * 5, prompt_tokens=5)  # no such token: the embedding fails
    for out in ("batched", "single"):
        prompts = tmp_path / out / "prompts"
        prompts.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA), prompts / "part-00000.parquet")
        (prompts / "manifest.json").write_text(json.dumps({"rows": 5}))
        mark_complete(prompts)
    summary = run_stage(LabelStage(cfg), LocalExecutor())
    assert summary["rows"] == 4 and summary["rejects"] == 1
    rejects = [json.loads(x) for x in (tmp_path / "batched" / "labels" / "rejects.jsonl").read_text().splitlines()]
    assert rejects[0]["prompt_id"] == rows[1]["prompt_id"] and rejects[0]["reason"] == "decode_error"
    assert "index" in rejects[0]["detail"].lower()
    assert validate_dataset(str(tmp_path / "batched" / "labels")).ok
    run_stage(LabelStage(cfg_for(tmp_path / "single", "label.batch_size=1", "label.max_reject_fraction=0.5")),
              LocalExecutor())
    cols = ["prompt_id", "tau", "steps", "new_tokens", "label_block_size"]
    assert pq.read_table(tmp_path / "batched" / "labels" / "part-00000.parquet", columns=cols).to_pylist() == \
        pq.read_table(tmp_path / "single" / "labels" / "part-00000.parquet", columns=cols).to_pylist()


KINDS = [(False, None), (True, None), (False, 3), (True, 3)]


def _block_layout(blocks, ctx_len, kinds, device):
    """One prompt's blocks laid out alone (as batch-1 replay lays them): masks, positions, local indices."""
    from pipeline.labelling.draft import layout

    alone = layout([blocks], ctx_len, kinds, device)
    return alone.masks, alone.positions[0], alone.local[0]


def test_batched_layout_is_the_batch1_layout_per_prompt():
    """layout (one set of tensor operations for every prompt) puts in batch row r exactly what it gives for prompt
    r's blocks alone (batch-1 replay's layout), for every attention kind; its padding rows see only themselves;
    positions, local indices, block anchors and the real rows' flat indices line up."""
    from pipeline.labelling.draft import layout

    rows = [[(4, 10, 4), (6, 7, 6), (2, 12, 2)], [(5, 3, 5)], [(3, 15, 2), (7, 15, 7)]]
    ctx_len = max(s for blocks in rows for _, s, _ in blocks)
    lay = layout(rows, ctx_len, KINDS, torch.device("cpu"))
    q_len = max(sum(vs for _, _, vs in blocks) for blocks in rows)
    assert lay.q_len == q_len == 12
    anchors, real = [], []
    for r, blocks in enumerate(rows):
        ref, pos, loc = _block_layout(blocks, ctx_len, set(KINDS), torch.device("cpu"))
        q = pos.numel()
        for kind in KINDS:
            got = lay.masks[kind][r, 0]
            assert torch.equal(got[:q, :ctx_len + q], ref[kind][0, 0]), kind
            assert not got[:q, ctx_len + q:].any()  # a real row never sees another row's padding
            for i in range(q, q_len):  # a padding row: itself only
                assert got[i].nonzero().flatten().tolist() == [ctx_len + i]
        assert torch.equal(lay.positions[r, :q], pos) and torch.equal(lay.local[r, :q], loc)
        assert not lay.local[r, q:].any()
        at = 0
        for _, _, vs in blocks:
            anchors.append(r * q_len + at)
            at += vs
        real += [r * q_len + i for i in range(q)]
    assert lay.anchors.tolist() == anchors and lay.real.tolist() == real


class _Keys:
    """The plain KV stand-in the in-place buffers (draft.BlockKeys) must equal: context keys, then the block's."""

    def __init__(self, prefix):
        self.prefix = prefix

    def update(self, k, v, layer_idx, *args, **kwargs):
        pk, pv = self.prefix[layer_idx]
        return torch.cat([pk, k], dim=-2), torch.cat([pv, v], dim=-2)


def test_deferred_draft_rows_equal_the_full_forward_and_keys_are_restored():
    """draft_forward's deferred rows (with ``real``: each layer's MLP on real rows only, the last layer's output
    projection and MLP only on the rows read) equal the full forward's rows, and the in-place key buffers
    (draft.BlockKeys) hold the context again after every forward: a second forward of other blocks matches a fresh
    runner's."""
    from pipeline.labelling.draft import draft_forward, layout
    from pipeline.labelling.runner import DraftRunner
    from dflash.model import _raw_input_embeddings

    target, draft = make_pair(4, layer_types=["full_attention", "full_attention"])
    prompts = [prompt(40 + i, length=n).tolist()[0] for i, n in enumerate((9, 14, 5))]
    news, context, _, _ = greedy_continuations(target, prompts, MAX_NEW, None, layer_ids=draft.target_layer_ids)
    gs = [p + c for p, c in zip(prompts, news)]
    runner = DraftRunner(draft, target, gs, context)
    saved = [(k.clone(), v.clone()) for k, v in runner.kv]

    @torch.inference_mode()
    def forward(work):
        idx = list(work)
        ctx_len = max(s for blocks in work.values() for _, s, _ in blocks)
        lay = layout([work[p] for p in idx], ctx_len, runner.kinds, runner.device)
        tokens = torch.full((len(idx) * lay.q_len,), runner.mask_id)
        tokens[lay.anchors] = torch.tensor([gs[p][s] for p in idx for _, s, _ in work[p]])
        noise = _raw_input_embeddings(target, tokens.view(len(idx), lay.q_len), runner.scale)
        masks = [lay.masks[kind] for kind in runner.kinds]
        sel = torch.tensor(idx)
        full = draft_forward(draft, noise, runner.no_context[:len(idx)], lay.positions,
                             _Keys([(k[sel, :, :ctx_len], v[sel, :, :ctx_len]) for k, v in saved]), masks,
                             lay.local)(torch.arange(len(idx) * lay.q_len))
        with runner._keys_for(idx, ctx_len, lay.q_len) as keys:
            read = draft_forward(draft, noise, runner.no_context[:len(idx)], lay.positions, keys, masks, lay.local,
                                 lay.real)
        return full, read, lay

    for work in ({0: [(3, 9, 3), (5, 11, 5)], 1: [(4, 14, 4)], 2: [(2, 5, 2), (6, 6, 6)]},
                 {0: [(4, 12, 4)], 2: [(5, 8, 5)]}):  # fewer prompts: the buffers are rebuilt for them
        full, read, lay = forward(work)
        read = torch.inference_mode()(read)
        picked = lay.real[torch.randperm(lay.real.numel(), generator=torch.Generator().manual_seed(0))[:7]]
        torch.testing.assert_close(read(picked), full[picked], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(read(lay.real), full[lay.real], rtol=1e-5, atol=1e-5)
        rows = runner._keys.rows
        for (bk, bv), (k, v) in zip(runner._keys.buffers, saved):  # the context is back after the forward
            n = k.shape[2]
            assert torch.equal(bk[:, :, :n], k[rows]) and torch.equal(bv[:, :, :n], v[rows])
    # Unchanged weights: the deferred path did not leave dflash's output projection swapped out.
    assert all(isinstance(layer.self_attn.o_proj, torch.nn.Linear) for layer in draft.layers)


def test_draft_output_multiplier_and_softcap_are_applied():
    """Batched replay skips dflash's multiply by an output_multiplier of exactly 1.0; any other multiplier (here
    -1.0, which turns the draft's argmax into its argmin) or a softcap still goes through compute_logits, as in the
    engine: batched labels equal batch-1 replay's, and differ from the plain draft's."""
    prompts = [prompt(60 + i, length=n) for i, n in enumerate((6, 11, 3))]
    target, draft = make_pair(5)
    plain = batched_replay_label_prompts(Engine(target, draft, [EOS_ID]), prompts, [2, 3, 4], MAX_NEW)
    for extra in ({"output_multiplier": -1.0}, {"final_logit_softcapping": 0.05, "output_multiplier": -2.0}):
        target, draft = make_pair(5)
        draft.config.dflash_config.update(extra)
        got = _assert_batched_equals_batch1(Engine(target, draft, [EOS_ID]), prompts, [2, 3, 4], MAX_NEW)
        assert [_key(o) for o in got] != [_key(o) for o in plain]


def test_gpu_cost_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/gpu_label_costs.py (the GPU estimate's inputs) through its --smoke mode on CPU, so that the script
    a lent GPU runs cannot rot here: every figure it writes is measured (positive) and the estimate uses them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_label_costs.py"
    spec = importlib.util.spec_from_file_location("gpu_label_costs", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "costs.json"
    assert bench.main(["--smoke", "--prompt-tokens", "16", "--steps", "3", "--batches", "2", "--candidates", "3,4",
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())  # its --compile part: tests/integration/test_gpu_check_cpu.py
    assert res["prefill_s"] > 0 and all(v > 0 for v in res["step_s"].values())
    m = res["batched"]["2"]
    assert min(m["prefill_s"], m["decode_step_s"], m["propose_s"], m["read_row_s"]) > 0
    est = res["estimate"]
    assert est["paper_s_per_prompt"] > sum(res["step_s"].values())  # 5 candidates x (N / tau) steps each
