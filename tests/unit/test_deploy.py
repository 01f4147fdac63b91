"""blockpilot deploy (pipeline/evaluation/deploy.py): the serving settings a run folder's trained artefacts give.

The run folder is made by the real writers (label shards, train's problem and export, the resolved config), no
Ray; the step rule is tune's file format written directly (its chooser lives in the Ray stage). The snippets'
keys are checked against the names each engine documents, recorded below with where they were read.
"""

import json
import shlex

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline import ASSETS
from pipeline.evaluation import deploy
from pipeline.io.layout import COST_PROFILE, RunLayout
from pipeline.io.shards import encode_metadata, shard_name, write_json_atomic, write_parquet_atomic
from pipeline.policy.blocksize import BlockSizeMLP, BlockSizePolicy, split_of
from pipeline.policy.cost import CostProfile
from pipeline.runtime.config import load_config, write_resolved
from pipeline.training.data import LABEL_COLUMN
from pipeline.training.export import ExportInput, export_policy
from pipeline.training.problem import load_problem
from stages.cli import main

# vLLM --speculative-config keys, as vllm-project/vllm documents them: vllm/config/speculative.py (SpeculativeConfig:
# method, model, num_speculative_tokens, revision, enable_adaptive_verification,
# num_speculative_tokens_per_batch_size), docs/features/speculative_decoding/dflash.md (method "dflash"),
# adaptive_verification.md (enable_adaptive_verification with DFlash), dynamic_speculative_decoding.md.
VLLM_KEYS = {"method", "model", "num_speculative_tokens", "revision", "enable_adaptive_verification",
             "num_speculative_tokens_per_batch_size"}
VLLM_DFLASH_METHOD = "dflash"  # SpeculativeConfig's DFlashModelTypes = Literal["dflash"]
# SGLang launch_server flags: docs.sglang.io docs/advanced_features/speculative_decoding.md ("DFLASH Decoding",
# "Full Parameter Reference"), with the algorithm's name DFLASH.
SGLANG_FLAGS = {"--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-draft-tokens",
                "--speculative-dflash-block-size", "--speculative-dflash-draft-window-size",
                "--speculative-draft-model-revision", "--model-path", "--trust-remote-code"}
SGLANG_DFLASH_ALGORITHM = "DFLASH"
# Named by the issue, not confirmed in either engine's docs: never emitted.
UNCONFIRMED = ("adaptive_verification_ema_alpha", "DFLASH_CONFIDENCE")

CANDS, V = [6, 8, 10], 5
LABELLING = {6: 1.0, 8: 2.0, 10: 4.0}  # tau ~ (2, 3, 3.5): b=6 is fastest here
SERVING = {6: 1.0, 8: 1.0, 10: 1.0}  # a machine where the wider verify is free: b=10 is


def _run_folder(root, rule="threshold:0.05", objective="speed", profile=None):
    """labels/ (two shards and the labelling profile), train/ (the exported policy and its resolved config) and
    tune/step_rule.json, as the stages write them."""
    rng = np.random.default_rng(0)
    run = RunLayout(root)
    run.labels.mkdir(parents=True)
    meta = encode_metadata({"candidates": CANDS, "vocab_size": V, "trained_block_size": 8})
    for i, rows in enumerate(np.array_split(np.arange(80), 2)):
        tau = np.array([2.0, 3.0, 3.5]) + rng.uniform(-0.2, 0.2, (len(rows), 3))
        table = pa.table({"prompt_id": [f"p{r}" for r in rows], "prompt_tokens": pa.array(rows * 7 + 10, pa.int32()),
                          "logits": rng.normal(0, 1, (len(rows), V)).tolist(),
                          "tau": tau.tolist(), LABEL_COLUMN: [CANDS[j] for j in tau.argmax(axis=1)]})
        write_parquet_atomic(table.replace_schema_metadata(meta), run.labels / shard_name(i))
    (profile or CostProfile(dict(LABELLING))).save(run.labels / COST_PROFILE)
    cfg = load_config([f"output_dir={root}", f"train.objective={objective}", "train.model=mlp",
                       "train.val_fraction=0.25", "train.calibration_fraction=0.2", "train.hidden=8", "train.n_layers=2",
                       "train.dropout=0.0"])
    write_resolved(cfg, run.train)
    problem = load_problem(cfg.train, run.labels)
    model = BlockSizeMLP(V, len(CANDS), hidden=8, n_layers=2, dropout=0.0)
    history = [{"epoch": 0, "train_loss": 1.0}]
    export_policy(ExportInput(problem, cfg.train, {"model": model.state_dict(), "epoch": 0}, history, "sha"),
                  run.policy)
    run.tune.mkdir()
    write_json_atomic({"rule": rule, "max_block_size": 12, "gain": 0.0308, "baseline_b": 6,
                       "chosen_on": "held-out (val split) label prompts", "prompts": 8, "table": []}, run.step_rule)
    return run


def _fastest_on_train(run, costs):
    """The least mean cost / tau over the train split's rows, computed here from the shards."""
    t = pa.concat_tables([pq.read_table(p) for p in sorted(run.labels.glob("part-*.parquet"))])
    train = [split_of(i, 0.25, 0.2) == "train" for i in t.column("prompt_id").to_pylist()]
    tau = np.array(t.column("tau").to_pylist())[train]
    return CANDS[int(np.argmin([(costs[b] / tau[:, j]).mean() for j, b in enumerate(CANDS)]))]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.manual_seed(0)
    return _run_folder(tmp_path_factory.mktemp("deploy") / "run")


def test_the_snippets_use_only_the_engines_documented_keys_with_this_runs_values(run):
    d = deploy.load_deploy(run.root)
    assert d.block_size == d.train_b == _fastest_on_train(run, LABELLING) == 6
    spec = deploy.vllm_speculative_config(d)
    assert set(spec) <= VLLM_KEYS and spec["method"] == VLLM_DFLASH_METHOD
    assert spec["num_speculative_tokens"] == 5  # a block of b = 6: the known token and 5 drafted
    args = deploy.sglang_args(d)
    assert {a for a in args if a.startswith("--")} <= SGLANG_FLAGS
    assert args[args.index("--speculative-algorithm") + 1] == SGLANG_DFLASH_ALGORITHM
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "6"
    # The default config's draft is bundled: a folder inside the package, given to both engines by path.
    assert spec["model"] == args[args.index("--speculative-draft-model-path") + 1] == str(ASSETS / "tiny-draft")
    assert "local folder" in d.draft_note
    adaptive = deploy.vllm_speculative_config(d, d.b_max, adaptive=True)
    assert set(adaptive) <= VLLM_KEYS and adaptive["enable_adaptive_verification"] is True
    assert adaptive["num_speculative_tokens"] == 11
    # What is printed is the same: the JSON after --speculative-config, the flags after launch_server.
    text = deploy.render(d)
    vllm_line = next(x for x in text.splitlines() if x.startswith("vllm serve "))
    words = shlex.split(vllm_line)
    assert json.loads(words[words.index("--speculative-config") + 1]) == spec
    sglang_line = next(x for x in text.splitlines() if x.startswith("python -m sglang.launch_server"))
    words = shlex.split(sglang_line)
    assert {w for w in words if w.startswith("--")} <= SGLANG_FLAGS and words[-len(args):] == args
    emitted = {*spec, *adaptive, *args}
    assert not any(u in emitted for u in UNCONFIRMED) and all(u in text for u in UNCONFIRMED)  # said, never set


def test_a_serving_machines_cost_profile_rechooses_the_fixed_b(run, tmp_path):
    profile = tmp_path / "serving" / COST_PROFILE
    profile.parent.mkdir()
    CostProfile(dict(SERVING)).save(profile)
    d = deploy.load_deploy(run.root, cost_profile=str(profile))
    assert d.block_size == _fastest_on_train(run, SERVING) == 10 and d.train_b == 6
    assert str(profile) in d.chosen_on and "train chose b=6" in d.chosen_on
    assert deploy.vllm_speculative_config(d)["num_speculative_tokens"] == 9
    assert deploy.sglang_args(d)[-1] == "10"


@pytest.mark.parametrize("rule, says", [
    ("full", "no per-step setting is needed"),
    ("threshold:0.05", "cumulative draft top-1 probability stays >= T"),
    ("ema:0.5:1", "EAGLE-only"),
    ("learned:w=3f2a", "`learned:w=3f2a` has no engine counterpart"),  # a form this module does not know
])
def test_every_step_rule_form_gets_the_nearest_engine_setting(run, rule, says):
    d = deploy.load_deploy(run.root)
    d.step_rule = {**d.step_rule, "rule": rule}
    lines = deploy.per_step_lines(d)
    assert f"`{rule}` at b_max=12" in lines[0] and any(says in x for x in lines)
    if rule != "full":  # the key never without vLLM's own conditions beside it
        assert any('"enable_adaptive_verification": true' in x and "only supported for method='dspark'" in x
                   and "full CUDA graphs, no LoRA, no pipeline parallelism" in x for x in lines)


def test_the_cli_prints_it_and_the_report_has_a_short_form(run, capsys, tmp_path):
    from stages.report import deploy_section  # the report stage's own section, as report.md holds it

    assert main(["deploy", str(run.root)]) == 0
    out = capsys.readouterr().out
    d = deploy.load_deploy(run.root)
    assert deploy.vllm_command(d) in out and deploy.sglang_command(d) in out
    assert "#52258" in out and "Per-request block size" in out
    assert "no calibrated margin" in out  # this policy answers its fallback everywhere: said so
    section = "\n".join(deploy_section(run.root))
    assert section.startswith("## Deploy") and deploy.vllm_command(d) in section
    assert "#52258" not in section and len(section.splitlines()) < 20
    assert main(["deploy", str(tmp_path / "nothing")]) == 1
    assert "policy.json is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # argparse's --help: the text, then exit 0
        main(["deploy", "--help"])
    help_text = capsys.readouterr().out
    assert exit_.value.code == 0, help_text
    assert "--cost-profile" in help_text and "vLLM" in help_text and "SGLang" in help_text


# A version-3 profile: the labelling machine's c = 1 seconds, and two loads where the verify's cost per token
# changes the fastest b: at c = 4 b=8 (cost 4, 5, 6: time per token 2, 1.67, 1.71), at c = 16 every b costs the same
# step, so the longest block (tau 3.5) wins.
LOAD = {"4": {"fit": {"draft": {"intercept": 0.0, "slope": 0.0}, "verify": {"intercept": 1.0, "slope": 0.5}},
              "seconds": {"1": 0.5, "6": 4.0, "8": 5.0, "10": 6.0}},
        "16": {"fit": {"draft": {"intercept": 0.0, "slope": 0.0}, "verify": {"intercept": 10.0, "slope": 0.0}},
               "seconds": {"1": 2.0, "6": 10.0, "8": 10.0, "10": 10.0}}}


def _run_at_load(tmp_path):
    """A run folder whose labelling profile has the load grid LOAD (c = 4, 16)."""
    torch.manual_seed(0)
    profile = CostProfile(dict(LABELLING))
    profile.meta.update(concurrency=[1, 4, 16], load=LOAD)
    profile.version = 3
    return _run_folder(tmp_path / "run", profile=profile)


def test_deploy_prints_vllms_batch_size_schedule_in_its_documented_form(tmp_path):
    """vLLM's dynamic_speculative_decoding.md: `num_speculative_tokens_per_batch_size` is a list of [start_bs,
    end_bs, optimal_K], every K <= num_speculative_tokens (the maximum window). The schedule's b at each grid c is
    the train split's fastest b under that c's seconds, computed here from the shards."""
    run = _run_at_load(tmp_path)
    d = deploy.load_deploy(run.root)
    loads = {4: {6: 4.0, 8: 5.0, 10: 6.0}, 16: {6: 10.0, 8: 10.0, 10: 10.0}}
    expected = {1: _fastest_on_train(run, LABELLING), **{c: _fastest_on_train(run, s) for c, s in loads.items()}}
    assert expected == {1: 6, 4: 8, 16: 10} and d.schedule == expected
    spec = deploy.vllm_schedule_config(d)
    assert set(spec) <= VLLM_KEYS and spec["method"] == VLLM_DFLASH_METHOD
    table = spec["num_speculative_tokens_per_batch_size"]
    assert table == [[1, 3, 5], [4, 15, 7], [16, 1024, 9]]
    assert all(len(e) == 3 and e[0] <= e[1] and 0 <= e[2] <= spec["num_speculative_tokens"] for e in table)
    assert all(a[1] + 1 == b[0] for a, b in zip(table, table[1:])) and table[0][0] == 1
    assert spec["num_speculative_tokens"] == 9
    text = deploy.render(d)
    line = next(x for x in text.splitlines() if "num_speculative_tokens_per_batch_size" in x)
    printed = line.split("--speculative-config ", 1)[1].split("`", 1)[0]
    assert json.loads(shlex.split(printed)[0]) == spec
    assert "SGLang: `--speculative-adaptive-config` takes EAGLE/EAGLE3 with topk 1 only, not DFLASH" in text
    # the same schedule as a whole command in a code block, to paste as it stands
    lines = text.splitlines()
    at = lines.index("vLLM, the schedule by load (one server whose concurrency varies):")
    assert lines[at + 2] == "```bash" and lines[at + 4] == "```"
    argv = shlex.split(lines[at + 3])
    assert argv[:3] == ["vllm", "serve", d.target] and argv[3] == "--speculative-config" and len(argv) == 5
    assert json.loads(argv[4]) == spec
    assert "With data parallelism (--data-parallel-size > 1) vLLM drops the schedule" in lines[at + 6]


def test_where_not_speculating_is_fastest_the_schedule_says_k0(tmp_path):
    """b = 1 (tau 1 on every row) is one of the schedule's options wherever the profile timed it: at c = 16 a step
    of b = 1 costs 2 s against 10 s at every b >= 2 (tau <= ~3.7), so no b pays there; at c = 4 b = 1 costs 3 s
    against 5 s for b = 8 at tau ~3, so b = 8 does. The schedule, the ranges and the words follow."""
    torch.manual_seed(0)
    profile = CostProfile({1: 0.6, **LABELLING}, meta={"concurrency": [1, 4, 16],
                                                       "load": {**LOAD, "4": {**LOAD["4"], "seconds": {
                                                           **LOAD["4"]["seconds"], "1": 3.0}}}}, version=3)
    run = _run_folder(tmp_path / "run", profile=profile)
    d = deploy.load_deploy(run.root)
    costs_16 = {1: 2.0, 6: 10.0, 8: 10.0, 10: 10.0}
    t = pa.concat_tables([pq.read_table(p) for p in sorted(run.labels.glob("part-*.parquet"))])
    train = [split_of(i, 0.25, 0.2) == "train" for i in t.column("prompt_id").to_pylist()]
    tau = np.array(t.column("tau").to_pylist())[train]
    assert 2.0 < min((costs_16[b] / tau[:, j]).mean() for j, b in enumerate(CANDS))  # AR's 2.0 / 1 beats each b
    assert d.schedule == {1: 6, 4: 8, 16: 1}
    spec = deploy.vllm_schedule_config(d)
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 3, 5], [4, 15, 7], [16, 1024, 0]]
    assert spec["num_speculative_tokens"] == 7
    text = deploy.render(d)
    assert "c=16: no speculation" in text and "K = 0 at c in [16]" in text and "from c = 16 on" in text
    policy = BlockSizePolicy.from_pretrained(run.policy)
    at16 = policy.at_load(16)
    assert at16.answers_ar and at16.choose_batch(np.zeros((3, V), np.float32)) == [1, 1, 1]
    assert not policy.at_load(4).answers_ar
    # the context-length tables weigh the same options on the same rows at the same widths (the padded width of
    # each c, pipeline.policy.load_cost.schedule's): their best b over all rows is the schedule's b*(c), and each
    # bucket is compared with the b the 3-item form serves there
    assert {c: t.best_all for c, t in d.context.items()} == d.schedule
    assert {c: t.overall_b for c, t in d.context.items()} == d.schedule
    assert "By prompt length:" in text and "| prompt tokens | rows | tau b=1 |" in text


def test_a_schedule_that_keeps_one_b_merges_its_ranges():
    from pipeline.policy.load_cost import vllm_ranges

    assert vllm_ranges({1: 8, 4: 8, 16: 6, 64: 6}) == [[1, 15, 7], [16, 1024, 5]]
    assert vllm_ranges({1: 5}, top=256) == [[1, 256, 4]]


def test_a_load_where_the_check_measured_no_gain_gets_k0_and_says_why(tmp_path):
    """tune's load check (tune/load_check.json, its format written here as tune writes it) measured b*(16) = 10 no
    faster than AR: deploy's schedule, vLLM's ranges, the words and the policy at c = 16 all follow it; a check made
    for another schedule is ignored, and without one deploy says the schedule is the model's alone."""
    run = _run_at_load(tmp_path)
    d = deploy.load_deploy(run.root)
    assert d.schedule == {1: 6, 4: 8, 16: 10} and d.load_check is None
    assert "Not measured: the schedule is the cost model's alone" in deploy.render(d)
    why = "measured -3.10% [-5.00%, -1.20%] (98% per look) against AR over full steps in 5 repeats: upper end below " \
          "+0.00%"
    small = [{"b": 2, "verdict": "tie", "why": "measured +0.40% [-1.00%, +1.80%] ...: a tie"},
             {"b": 3, "verdict": "dropped", "why": "measured -2.00% [-3.00%, -1.00%] ...: upper end below +0.00%"}]
    check = {"model_schedule": {"1": 6, "4": 8, "16": 10}, "min_gain": 0.0,
             "loads": {"16": {"b": 10, "verdict": "dropped", "kept": False, "serve": 1, "why": why, "prompts": 64,
                              "repeats": 5, "timing": "in lockstep", "small_b": small}}}
    write_json_atomic(check, run.load_check)
    d = deploy.load_deploy(run.root)
    assert d.schedule == {1: 6, 4: 8, 16: 1} and d.no_speculation_from == 16
    spec = deploy.vllm_schedule_config(d)
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 3, 5], [4, 15, 7], [16, 1024, 0]]
    text = deploy.render(d)
    assert (f"Measured at c=16 (tune's load check, 64 val label prompts, 5 repeats in lockstep): b=10 dropped, {why}. "
            f"Then b=2: tie, {small[0]['why']}. Then b=3: dropped, {small[1]['why']}. Served: no speculation (K = 0) "
            "at this load.") in text
    assert "K = 0 at c in [16]: there a verify" not in text  # measured, not modelled: said once, as measured
    assert "Not measured" not in text
    # b = 2 kept where b*(16) lost: served there, K = 1
    kept2 = {**check, "loads": {"16": {**check["loads"]["16"], "serve": 2,
                                       "small_b": [{**small[0], "verdict": "kept"}]}}}
    write_json_atomic(kept2, run.load_check)
    d2 = deploy.load_deploy(run.root)
    assert d2.schedule == {1: 6, 4: 8, 16: 2} and d2.no_speculation_from is None
    assert deploy.vllm_schedule_config(d2)["num_speculative_tokens_per_batch_size"][-1] == [16, 1024, 1]
    assert "Served: b=2 (K = 1)." in deploy.render(d2)
    write_json_atomic(check, run.load_check)
    policy = BlockSizePolicy.from_pretrained(run.policy)
    assert policy.at_load(16, fallback=d.schedule[16]).answers_ar and not policy.at_load(16).answers_ar
    write_json_atomic({**check, "model_schedule": {"1": 6, "4": 8, "16": 8}}, run.load_check)  # another policy's
    assert deploy.load_deploy(run.root).schedule == {1: 6, 4: 8, 16: 10}


def test_the_context_tables_cost_each_load_at_the_width_the_schedule_does(tmp_path, monkeypatch):
    """The 5-item form's buckets and the 3-item schedule weigh b at the same width: at c > 1 the padded width of the
    train rows (pipeline.policy.load_cost.padded_width, what schedule() takes), not the profile's mean."""
    from pipeline.policy.load_cost import LoadCost, padded_width
    from pipeline.training.data import read_splits

    run = _run_at_load(tmp_path)
    for shard in sorted(run.labels.glob("part-*.parquet")):  # the shards record each row's new tokens, as label's do
        t = pq.read_table(shard)
        t = t.append_column("new_tokens", pa.array([[24 + i % 9] * len(CANDS) for i in range(t.num_rows)]))
        write_parquet_atomic(t.replace_schema_metadata(pq.read_schema(shard).metadata), shard)
    seen, cost = [], LoadCost.cost
    monkeypatch.setattr(LoadCost, "cost", lambda self, b, c, width=None: seen.append((c, width)) or
                        cost(self, b, c, width))
    d = deploy.load_deploy(run.root)
    widths = read_splits(sorted(run.labels.glob("part-*.parquet")), 0.25, CANDS, 0.2).train_widths
    assert widths is not None and d.context and len(d.context) > 1
    at = {c: {w for x, w in seen if x == c} for c in d.context}
    assert all(at[c] == {padded_width(widths, c)} for c in d.context if c > 1), at
