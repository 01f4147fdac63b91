"""Every refusal of train, tune, evaluate and report, and drift and ``force`` for each (issue #25, item 8), on real
stage objects and a real run folder, without Ray.

The run folder: the session's real label set (tests/conftest.py's ``real_labels``: prepare + label of 8 bundled
prompts on the tiny pair, with traces and the labelling cost profile) copied with its prompts, and a train folder
written by train's own driver-side code (the fingerprint, :class:`StageFolder`, ``load_problem``,
``export_policy``, ``train_summary``) around an untrained MLP: everything ``stages.train.run`` writes but the Ray
Train fit. Tune then runs for real through the stage driver with the in-process executor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from pipeline.executor.driver import run_stage
from pipeline.executor.folder import StageFolder
from pipeline.executor.local import LocalExecutor
from pipeline.executor.stage import Worker
from pipeline.io.layout import COST_PROFILE, POLICY, STEP_RULE, RunLayout
from pipeline.io.shards import file_sha256, is_complete
from pipeline.policy.blocksize import BlockSizeMLP, split_of
from pipeline.runtime.config import load_config
from conftest import ONE_SOURCE

# real_labels' settings, and a small policy
BASE = ["progress=false", "decode.max_new_tokens=16", "prepare.shard_size=4", "prepare.limit=8", "label.k=2",
        "train.model=mlp", "train.hidden=16", "train.n_layers=1", "train.dropout=0.0", "train.val_fraction=0.5",
        "train.calibration_fraction=0.2", "tune.limit=2", "tune.rules=[threshold:0.05,ema:0.5:2]", *ONE_SOURCE]


def cfg_for(out: Path, *extra: str):
    return load_config([f"output_dir={out}", *BASE, *extra])


def write_train(cfg) -> dict:
    """train/ as stages.train.run writes it, the fit replaced by an untrained model (no Ray)."""
    from stages import train as train_stage
    from pipeline.training.export import ExportInput, export_policy
    from pipeline.training.problem import load_problem
    from pipeline.training.summary import train_summary

    run = RunLayout(Path(cfg.output_dir))
    folder = StageFolder(run.train, "train", extra_outputs=(train_stage.RUN_NAME, POLICY, "metrics.jsonl",
                                                           "curves.png"))
    folder.ensure_writable()
    fp = train_stage.fingerprint(cfg, run.labels)
    folder.bind(fp, cfg.force)
    folder.start(cfg)
    problem = load_problem(cfg.train, run.labels)
    torch.manual_seed(0)
    t = cfg.train
    model = BlockSizeMLP(problem.vocab_size, len(problem.action_names), t.hidden, t.n_layers, t.dropout)
    inp = ExportInput(problem, t, {"model": model.state_dict(), "epoch": 0}, [{"epoch": 0, "train_loss": 1.0}],
                      fp["labels_manifest_sha256"])
    summary = train_summary(inp, export_policy(inp, run.policy))
    summary.update(status="done")
    folder.complete(summary)
    return summary


@pytest.fixture
def run_dir(real_labels, tmp_path) -> Path:
    """prompts/ and labels/ (real), train/ (written by train's own code), in a fresh folder."""
    out = tmp_path / "run"
    shutil.copytree(real_labels.parent / "prompts", out / "prompts")
    shutil.copytree(real_labels, out / "labels")
    write_train(cfg_for(out))
    assert is_complete(out / "train")
    return out


def ids(folder: Path):
    return [i for p in sorted(folder.glob("part-*.parquet")) for i in pq.read_table(p, columns=["prompt_id"])
            .column("prompt_id").to_pylist()]


# ---- train -------------------------------------------------------------------------------------------------------

def test_train_refuses_without_a_cost_profile(run_dir):
    from stages import train

    (run_dir / "labels" / COST_PROFILE).unlink()  # the train folder's fingerprint changes with it: force=true
    with pytest.raises(ValueError, match=r"config key 'train.cost_profile': no cost profile at .*labels/"
                                         r"cost_profile.json \(objective 'speed' needs one"):
        train.run(cfg_for(run_dir, "force=true"))
    # A named profile that is not there is refused whatever the objective.
    with pytest.raises(ValueError, match=r"no cost profile at .*/nowhere.json"):
        train.run(cfg_for(run_dir, "force=true", "train.objective=paper", f"train.cost_profile={run_dir}/nowhere.json"))


def test_train_refuses_fractions_that_leave_no_training_rows(real_labels, tmp_path):
    from stages import train

    out = tmp_path / "run"
    shutil.copytree(real_labels, out / "labels")
    val, calib = 0.6, 0.39  # accepted by the config (their sum < 1), yet on these 8 ids no row is left to train on
    rows = ids(out / "labels")
    assert len(rows) == 8 and all(split_of(i, val, calib) != "train" for i in rows)
    with pytest.raises(ValueError, match="leave no training rows"):
        train.run(cfg_for(out, f"train.val_fraction={val}", f"train.calibration_fraction={calib}"))
    assert not (out / "train" / POLICY).exists() and not is_complete(out / "train")


def test_train_rerun_is_skipped_drift_is_refused_and_force_discards(run_dir):
    from stages import train

    policy = run_dir / "train" / POLICY / "model.safetensors"
    before = file_sha256(policy)
    assert train.run(cfg_for(run_dir))["skipped"] is True  # the same config: complete, nothing redone
    with pytest.raises(FileExistsError, match=r"changed: train\b"):
        train.run(cfg_for(run_dir, "train.hidden=32"))
    assert is_complete(run_dir / "train") and file_sha256(policy) == before  # the refusal touched nothing
    # force=true discards the earlier output before any training; the forced run then stops on its own refusal
    # (no training rows), so what force did is seen without starting Ray.
    with pytest.raises(ValueError, match="leave no training rows"):
        train.run(cfg_for(run_dir, "force=true", "train.val_fraction=0.6", "train.calibration_fraction=0.39"))
    assert not policy.exists() and not is_complete(run_dir / "train")
    assert not (run_dir / "train" / "summary.json").exists()
    recorded = json.loads((run_dir / "train" / "fingerprint.json").read_text())
    assert (recorded["train"]["val_fraction"], recorded["train"]["calibration_fraction"]) == (0.6, 0.39)


# ---- tune --------------------------------------------------------------------------------------------------------

def tune_stage(cfg):
    from stages.tune import TuneStage

    return TuneStage(cfg)


def test_tune_check_refuses_without_the_policys_cost_profile(run_dir):
    (run_dir / "train" / POLICY / COST_PROFILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"policy/cost_profile.json is missing: the rules are scored by "
                                                r"modelled time"):
        tune_stage(cfg_for(run_dir)).check()


def test_tune_run_refuses_without_the_policys_cost_profile_with_its_message(run_dir):
    """The driver fingerprints the stage before its check(): the fingerprint must not fail first on the missing
    file (it did, with a bare ENOENT)."""
    (run_dir / "train" / POLICY / COST_PROFILE).unlink()
    with pytest.raises(FileNotFoundError, match="the rules are scored by modelled time"):
        run_stage(tune_stage(cfg_for(run_dir)), LocalExecutor())


def test_tune_refuses_a_temperature_above_zero_before_any_work(run_dir):
    with pytest.raises(ValueError, match=r"config key 'decode.temperature': tune scores rules at T = 0"):
        run_stage(tune_stage(cfg_for(run_dir, "decode.temperature=0.7")), LocalExecutor())
    assert not (run_dir / "tune").exists() or not any((run_dir / "tune").iterdir())


def test_tune_refuses_a_label_set_without_traced_val_rows(run_dir):
    """Labels without traces (as exhaustive mode at T > 0 writes them: every trace column null)."""
    import pyarrow as pa

    from pipeline.data.schemas import TRACE_COLUMNS

    for p in sorted((run_dir / "labels").glob("part-*.parquet")):
        t = pq.read_table(p)
        for name, _, _ in TRACE_COLUMNS:
            i = t.schema.get_field_index(name)
            t = t.set_column(i, t.schema.field(i), pa.nulls(t.num_rows, t.schema.field(i).type))
        pq.write_table(t, p)
    with pytest.raises(ValueError, match="tune: the label set has no val-split row with a trace"):
        run_stage(tune_stage(cfg_for(run_dir)), LocalExecutor())
    assert not is_complete(run_dir / "tune")


def test_tune_search_refuses_no_val_rows():
    from pipeline.evaluation.rule_search import search

    with pytest.raises(ValueError, match="no val-split row with a trace"):
        search({"train": [], "val": []}, ["threshold:0.05"], None, 8)


def test_tune_rerun_is_skipped_drift_is_refused_and_force_redoes(run_dir, one_thread):
    cfg = cfg_for(run_dir)
    first = run_stage(tune_stage(cfg), LocalExecutor())
    assert first["status"] == "done" and is_complete(run_dir / "tune")
    rule = (run_dir / "tune" / STEP_RULE).read_text()
    assert run_stage(tune_stage(cfg), LocalExecutor())["skipped"] is True
    with pytest.raises(FileExistsError, match=r"changed: tune\b"):
        run_stage(tune_stage(cfg_for(run_dir, "tune.limit=1")), LocalExecutor())
    assert is_complete(run_dir / "tune") and (run_dir / "tune" / STEP_RULE).read_text() == rule
    forced = run_stage(tune_stage(cfg_for(run_dir, "tune.limit=1", "force=true")), LocalExecutor())
    assert forced["status"] == "done" and forced.get("skipped") is not True
    decoded = ids(run_dir / "tune")
    assert len(set(decoded)) == 1  # one prompt decoded now, not the earlier two
    assert json.loads((run_dir / "tune" / "fingerprint.json").read_text())["tune"]["limit"] == 1


# ---- evaluate ----------------------------------------------------------------------------------------------------

def test_evaluate_refuses_a_policy_of_another_vocabulary(run_dir, tmp_path, one_thread):
    """A policy trained on V = 5 against the tiny target's V: refused in each worker's setup, before decoding."""
    from pipeline.policy.blocksize import BlockSizePolicy
    from stages.evaluate import EvaluateStage

    policy_dir = run_dir / "train" / POLICY
    real = BlockSizePolicy.from_pretrained(policy_dir)
    other = BlockSizePolicy(BlockSizeMLP(5, len(real.actions), 16, 1, 0.0), real.candidates, 5,
                            real.input_transform, dict(real.info))
    other.save_pretrained(policy_dir)
    with pytest.raises(ValueError, match=rf"policy {policy_dir} was trained on V=5, the target has "
                                         rf"V={real.vocab_size}"):
        EvaluateStage(cfg_for(run_dir)).setup(Worker("test"))


# ---- report ------------------------------------------------------------------------------------------------------

def test_report_refuses_when_there_is_nothing_to_report(tmp_path):
    from stages import report

    with pytest.raises(FileNotFoundError, match=r"nothing to report in .*: no complete labels, train or eval"):
        report.run(cfg_for(tmp_path / "empty"))
    assert not (tmp_path / "empty" / "report" / "report.md").exists()


def test_report_has_no_drift_it_is_remade_from_what_is_there(real_labels, tmp_path):
    """report records no fingerprint: a rerun with another config (with or without force) remakes it from the
    folders complete now."""
    from stages import report

    out = tmp_path / "run"
    shutil.copytree(real_labels, out / "labels")
    first = report.run(cfg_for(out))
    assert first["sections"] == ["labels"] and "## Label set" in (out / "report" / "report.md").read_text()
    write_train(cfg_for(out))  # train completes meanwhile
    again = report.run(cfg_for(out, "train.hidden=32"))  # another config: no refusal
    assert again["sections"] == ["labels", "train", "deploy"]
    assert "## Policy" in (out / "report" / "report.md").read_text()
    forced = report.run(cfg_for(out, "force=true"))
    assert forced["sections"] == again["sections"] and is_complete(out / "report")
