"""Every stage at a real model's shapes: a random-weight Qwen3 target at Qwen3's vocabulary (V = 151,936) and a draft
whose config.json has the z-lab DFlash-b16 layout (``block_size`` 16, ``dflash_config`` with ``mask_token_id`` and
``target_layer_ids``, ``num_target_layers``), built here (tests/random_pair.py ``save_real_shaped_pair``): narrow and
shallow, so that a CPU runs it, but every code path meets the real vocabulary and the real config keys.

``blockpilot run`` (prepare, label at B = 16's candidates 14..18, train with the paper's MLP and objective on the
V = 151,936 logits, evaluate at c = 1 and c = 4) then ``blockpilot deploy``, on a few prompts with short outputs,
through the CLI's entry point on the session's Ray (the Ray start-up and fresh interpreters a subprocess adds prove
nothing about the vocabulary; the README's first command's own local Ray is test_stages.py's and
test_sampled_run.py's). The MLP's head is narrow (64 wide, not the paper's 2,048): the vocabulary is what this
test is about, and at 2,048 the first layer alone (311M parameters, ~5 GB of checkpoints) took most of its six
minutes. Its parameter count is derived from V and the width, and read from the exported file.
"""

from __future__ import annotations

import json
import math
import shutil

import pyarrow.parquet as pq

from safetensors import safe_open

from conftest import ONE_SOURCE
from random_pair import QWEN3_VOCAB, ZLAB_MASK_ID, save_real_shaped_pair

from .conftest import blockpilot_here

HIDDEN, LAYERS, CLASSES = 64, 2, 5  # train.hidden, train.n_layers; the paper's objective: one class per candidate
SETTINGS = [
    *ONE_SOURCE, "model.tokenizer=bundled:tiny-target", "model.device=cpu", "progress=false",
    "prepare.limit=8", "prepare.shard_size=4", "decode.max_new_tokens=16", "label.k=2", "label.batch_size=4",
    "workers.cpus_per_worker=0.5", "label.num_workers=1", "evaluate.num_workers=1",  # one actor each (as FAST)
    # one short round of the start-up cost profile, c = 1 and 4, over b = 1..18 (the candidates' largest; the trace's
    # default b_max, B + B // 4 = 20, would add two more), 2 steps a point: every profiled step computes V = 151,936
    # logits per token (~20 ms here), and at 4 steps over b = 1..20 the profile took 36 of label's 49 s (2 steps,
    # b <= 18: 17 of 32 s; 2026-12-06, one run each)
    "profile.context_lengths=[32]", "profile.steps=2", "profile.min_repeats=1", "profile.max_repeats=1",
    "profile.concurrency=[1,4]", "label.trace_block_size=18",
    # the paper's MLP and objective, one epoch, a narrow head (HIDDEN)
    "train.model=mlp", "train.objective=paper", "train.hidden=64", "train.n_layers=2", "train.epochs=1",
    "train.checkpoint_every=1", "train.batch_size=8", "train.use_gpu=false",
    "evaluate.limit=2", "evaluate.concurrency=[1,4]", "evaluate.load_repeats=2", "evaluate.per_step=false",
]


# Over 120 s in the suite (96 s alone, 110-114 s in the suite on its session Ray, 2026-12-05; 126-138 s in the suite,
# 2026-12-06): every stage at V = 151,936, where each logits row is 600 KB and the label, train and evaluate stages
# move them for real; that vocabulary is what it proves.
def test_every_stage_meets_qwen3s_vocabulary_and_the_zlab_config_keys(tmp_path_factory, ray_session):
    work = tmp_path_factory.mktemp("real-shapes")
    try:
        target, draft = save_real_shaped_pair(work / "models")
        dcfg = json.loads((draft / "config.json").read_text())
        assert (dcfg["block_size"], dcfg["dflash_config"]["mask_token_id"], dcfg["vocab_size"]) == \
            (16, ZLAB_MASK_ID, QWEN3_VOCAB) and "num_target_layers" in dcfg
        out = work / "run"
        run = blockpilot_here("run", f"output_dir={out}", f"model.target={target}", f"model.draft={draft}", *SETTINGS)
        assert run.rc == 0, run.tail(80)
        print("[real shapes] " + next(x for x in run.lines if x.startswith("[run] done in ")))
        # one run says each thing once (#51): the table at c = 4 in the closing block alone; each decoding stage's
        # preflight in one line (identical workers; tune is off with evaluate.per_step=false)
        assert sum(x.startswith("c=4: method") or "] c=4: method" in x for x in run.lines) == 1, run.tail(80)
        preflights = [x for x in run.lines if " preflight: " in x]
        assert [x.split("]")[0] for x in preflights] == ["[label", "[evaluate"], preflights
        assert all("every worker cpu, float32, models ok, output rw" in x for x in preflights), preflights

        labels = out / "labels"
        shard = sorted(labels.glob("part-*.parquet"))[0]
        assert pq.read_schema(shard).field("logits").type.list_size == QWEN3_VOCAB
        rows = sum(pq.read_metadata(p).num_rows for p in labels.glob("part-*.parquet"))
        assert rows == 8 and json.loads((labels / "summary.json").read_text())["candidates"] == [14, 15, 16, 17, 18]
        fp = json.loads((labels / "fingerprint.json").read_text())
        assert (fp["dtype"], fp["device"]) == ("float32", "cpu"), fp
        v = blockpilot_here("validate", str(labels))
        assert v.rc == 0, v.output

        # Linear(V, h), (LAYERS - 1) x Linear(h, h), Linear(h, classes), biases included
        first = QWEN3_VOCAB * HIDDEN + HIDDEN
        params = first + (LAYERS - 1) * (HIDDEN * HIDDEN + HIDDEN) + HIDDEN * CLASSES + CLASSES
        with safe_open(str(out / "train" / "policy" / "model.safetensors"), "pt") as f:
            exported = {k: f.get_slice(k).get_shape() for k in f.keys()}
        assert sum(math.prod(shape) for shape in exported.values()) == params, exported
        assert [QWEN3_VOCAB] in [shape[1:] for shape in exported.values()], exported  # reads all V logits
        mlp = [x for x in run.lines if x.startswith("[train] the MLP: ")]
        assert mlp and mlp[0].startswith(f"[train] the MLP: {params / 1e6:.1f}M parameters (first layer "
                                         f"{QWEN3_VOCAB * HIDDEN / 1e6:.1f}M); each worker plans "), mlp
        print("[real shapes]", mlp[0])

        summary = json.loads((out / "eval" / "summary.json").read_text())
        assert summary["rows"] == 4 * len(summary["fixed_block_sizes"] + ["AR", "adaptive", "oracle"])
        load = json.loads((out / "eval" / "load.json").read_text())
        assert set(load["loads"]) == {"4"} and load["loads"]["4"]["methods"]["AR"]["throughput"] > 0

        deploy = blockpilot_here("deploy", str(out))
        assert deploy.rc == 0, deploy.output
        assert "num_speculative_tokens" in deploy.output and str(draft) in deploy.output, deploy.output
    finally:
        shutil.rmtree(work, ignore_errors=True)  # ~5 GB of checkpoints and policy
