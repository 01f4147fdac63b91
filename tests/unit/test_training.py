"""pipeline/training without Ray: the label set -> arrays and splits, the baselines, the epoch loop's reports, the
checkpoint folder, the metrics log, the held-out analyses, and the export read back through BlockSizePolicy."""

import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.io.layout import COST_PROFILE, METRICS, POLICY, POLICY_META
from pipeline.io.shards import encode_metadata, shard_name, write_parquet_atomic
from pipeline.policy.blocksize import SPEED_SCORE, BlockSizeMLP, BlockSizePolicy, split_of, train_chosen_block_size
from pipeline.policy.cost import CostProfile
from pipeline.runtime.config import TrainConfig
from pipeline.training import analysis, checkpoint
from pipeline.training.data import LABEL_COLUMN, InMemoryShard, SplitData, in_split, to_arrays
from pipeline.training.export import ExportInput, export_policy
from pipeline.training.loop import fit, reports_at
from pipeline.training.problem import load_problem, train_chosen_index
from pipeline.training.progress import EpochLog, epoch_metrics, write_history
from pipeline.training.summary import summary_lines, train_summary

CANDS = [2, 4, 8]
COSTS = {2: 1.0, 4: 2.0, 8: 4.0}
V = 6


def test_the_speed_label_of_a_batch_is_argmax_tau_over_cost_ties_to_the_smaller_b():
    tau = [[1.5, 4.0, 4.5],  # tau / cost = 1.5, 2.0, 1.125 -> b=4 (argmax tau would say b=8)
           [2.0, 4.0, 8.0],  # 2, 2, 2: a three-way tie -> the smallest b
           [3.0, 2.0, 4.0]]  # 3, 1, 1 -> b=2
    batch = {"logits": [np.zeros(V)] * 3, "tau": [np.array(r) for r in tau], LABEL_COLUMN: np.array([8, 8, 8])}
    x, y, t = to_arrays(batch, CANDS, LABEL_COLUMN, [COSTS[b] for b in CANDS])
    assert y.tolist() == [1, 0, 0] and y.dtype == np.int64
    assert x.shape == (3, V) and x.dtype == t.dtype == np.float32
    _, y_stored, _ = to_arrays(batch, CANDS, LABEL_COLUMN)  # without costs: the stored label, as an index
    assert y_stored.tolist() == [2, 2, 2]


def test_the_train_chosen_fixed_b_is_the_least_mean_time_per_token():
    tau = np.array([[1.0, 3.0, 4.0], [1.0, 1.0, 8.0]])
    # cost / tau: b=2 (1, 1) -> 1; b=4 (2/3, 2) -> 1.333; b=8 (1, 0.5) -> 0.75
    assert train_chosen_index(tau, [COSTS[b] for b in CANDS]) == 2
    assert train_chosen_index(tau, None) == 2  # mean tau 1, 2, 6
    assert train_chosen_index(np.array([[1.0, 2.0, 4.0]]), [1.0, 2.0, 4.0]) == 0  # a tie: the smaller b


def _label_set(folder, n=120, seed=0):
    """Two label shards of n rows in all (random logits and tau), and a cost profile beside them."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    meta = encode_metadata({"candidates": CANDS, "vocab_size": V, "trained_block_size": 4})
    for i, rows in enumerate(np.array_split(np.arange(n), 2)):
        tau = rng.uniform(1.0, 6.0, (len(rows), len(CANDS)))
        table = pa.table({"prompt_id": [f"p{r}" for r in rows],
                          "logits": [rng.normal(0, 1, V).tolist() for _ in rows],
                          "tau": tau.tolist(), LABEL_COLUMN: [CANDS[j] for j in tau.argmax(axis=1)]})
        write_parquet_atomic(table.replace_schema_metadata(meta), folder / shard_name(i))
    CostProfile(dict(COSTS)).save(folder / COST_PROFILE)
    return folder


def test_the_splits_are_disjoint_cover_every_row_and_follow_the_prompt_id(tmp_path):
    train = replace(TrainConfig(), val_fraction=0.25, calibration_fraction=0.2, objective="speed")
    p = load_problem(train, _label_set(tmp_path / "labels"))
    s = p.splits
    masks = np.stack([s.train, s.calib, s.val])
    assert (masks.sum(axis=0) == 1).all() and masks.sum(axis=1).min() > 0  # each row in exactly one, none empty
    ids = [f"p{r}" for r in range(120)]
    assert s.split.tolist() == [split_of(i, 0.25, 0.2) for i in ids]
    for name, mask in (("train", s.train), ("calib", s.calib), ("val", s.val)):  # the workers' filter agrees
        assert (in_split(ids, name, 0.25, 0.2) == mask).all()
    costs = np.array([COSTS[b] for b in CANDS])
    assert (s.y == (s.tau / costs).argmax(axis=1)).all()  # speed: the speed label
    assert p.costs == [1.0, 2.0, 4.0] and p.speed["fallback_index"] == p.fixed_index
    paper = load_problem(replace(train, objective="paper"), tmp_path / "labels")
    assert not paper.splits.calib.any() and (paper.splits.y == paper.splits.y_tau).all()


def test_a_small_split_in_memory_is_divided_among_the_workers_and_shuffled_by_seed():
    """pipeline.training.data.InMemoryShard, what a small label set's workers read instead of a Ray Data shard:
    the workers' parts are disjoint, cover every row and differ by at most one row; a seed gives one permutation."""
    rows = {"prompt_id": np.array([f"p{i}" for i in range(11)]), "tau": np.arange(22.0).reshape(11, 2)}
    whole = InMemoryShard(rows)
    parts = [whole.part(r, 3) for r in range(3)]
    seen = [list(b["prompt_id"]) for p in parts for b in p.iter_batches(batch_size=2)]
    flat = [i for b in seen for i in b]
    assert sorted(flat) == sorted(rows["prompt_id"]) and len(flat) == 11
    assert sorted(p.rows for p in parts) == [3, 4, 4] and max(len(b) for b in seen) == 2
    for b in whole.iter_batches(batch_size=4):  # each batch's columns stay row-aligned
        assert [int(i[1:]) * 2 for i in b["prompt_id"]] == b["tau"][:, 0].astype(int).tolist()
    order = [list(b["prompt_id"]) for b in whole.iter_batches(batch_size=11, local_shuffle_seed=5)]
    again = [list(b["prompt_id"]) for b in whole.iter_batches(batch_size=11, local_shuffle_seed=5)]
    other = [list(b["prompt_id"]) for b in whole.iter_batches(batch_size=11, local_shuffle_seed=6)]
    assert order == again and order != other and sorted(order[0]) == sorted(rows["prompt_id"])
    assert [list(b["prompt_id"]) for b in whole.iter_batches(batch_size=11)] == [list(rows["prompt_id"])]


def _loop_config(epochs, every, objective="paper"):
    t = {"input_transform": "none", "objective": objective, "batch_size": 4, "seed": 0, "epochs": epochs,
         "checkpoint_every": every}
    return {"train": t, "candidates": CANDS, "label_column": LABEL_COLUMN, "cache_in_memory": True,
            "costs": [COSTS[b] for b in CANDS], "fixed_index": 1, "trained_index": 1}


def _rows(n=10, seed=0):
    rng = np.random.default_rng(seed)
    tau = rng.uniform(1.0, 6.0, (n, 3))
    return {"logits": rng.normal(0, 1, (n, V)), "tau": tau, LABEL_COLUMN: np.array([CANDS[j] for j in
                                                                                    tau.argmax(axis=1)])}


def test_fit_reports_every_n_epochs_and_at_the_last_and_resumes():
    torch.manual_seed(0)
    config = _loop_config(epochs=5, every=2)
    model = BlockSizeMLP(V, 3, hidden=8, n_layers=1, dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = SplitData(InMemoryShard(_rows()), config, shuffle=True)
    reports = []
    history = fit(model, opt, data, SplitData(InMemoryShard(_rows(seed=1)), config, shuffle=False), config, 0, [],
                  lambda e, m, h: reports.append((e, m["epoch"], len(h))))
    assert reports == [(1, 1, 2), (3, 3, 4), (4, 4, 5)]
    assert [h["epoch"] for h in history] == [0, 1, 2, 3, 4]
    assert {"val_accuracy", "val_speed_gain_policy", "val_speed_gain_oracle"} <= set(history[-1])
    assert history[-1]["val_speed_gain_oracle"] >= history[-1]["val_speed_gain_policy"]
    resumed = fit(model, opt, data, data, config, 3, history[:3], lambda *a: reports.append(a[0]))
    assert reports[-2:] == [3, 4] and [h["epoch"] for h in resumed] == [0, 1, 2, 3, 4]
    assert [reports_at(e, 10, 3) for e in range(10)] == [e in (2, 5, 8, 9) for e in range(10)]


def test_a_checkpoint_folder_round_trips(tmp_path):
    torch.manual_seed(0)
    model = BlockSizeMLP(V, 3, hidden=8, n_layers=2, dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    checkpoint.save_state(tmp_path, model, opt, 6, [{"epoch": 6, "train_loss": 0.5}])
    other = BlockSizeMLP(V, 3, hidden=8, n_layers=2, dropout=0.0)
    start, history = checkpoint.restore(tmp_path, other, torch.optim.Adam(other.parameters(), lr=1e-2))
    assert start == 7 and history == [{"epoch": 6, "train_loss": 0.5}]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_the_epoch_log_shows_about_five_lines_and_the_last(tmp_path):
    write_history([{"epoch": e, "train_loss": 1.0 / (e + 1)} for e in range(27)], tmp_path)
    log = EpochLog(tmp_path / METRICS, epochs=27, enabled=False)  # every 27 // 5 = 5 epochs, and the last
    assert [line.split()[1] for line in log.lines()] == ["5/27", "10/27", "15/27", "20/27", "25/27", "27/27"]
    assert log.lines() == []  # each once
    assert (tmp_path / METRICS).read_text().count("\n") == 27


def test_an_epoch_line_shows_a_few_rounded_metrics_in_a_fixed_order(tmp_path):
    m = {"epoch": 0, "val_speed_gain_oracle": 0.0642, "val_regret": 0.5, "val_tau_oracle": 3.60041,
         "val_tau_best_fixed": 3.05, "val_top2_accuracy": 0.7, "val_tau_trained_b": 2.9, "val_accuracy": 0.41234,
         "val_tau_policy": 3.1234567, "val_speed_gain_policy": 0.01234, "train_loss": 0.432112345}
    write_history([m], tmp_path)
    (line,) = EpochLog(tmp_path / METRICS, epochs=1, enabled=False).lines()
    assert line == ("epoch 1/1  loss 0.4321  val acc 41.2%  tau policy 3.123  fixed b 3.050  oracle 3.600  "
                    "modelled gain +1.23%  oracle gain +6.42%")
    # Without val rows or a cost profile the line keeps its order and drops what was not computed.
    assert epoch_metrics({"epoch": 3, "train_loss": 1.0, "val_accuracy": 0.5}) == "loss 1.0000  val acc 50.0%"


def test_ridge_recovers_a_linear_target_and_the_fallback_keeps_the_fallback_b():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (200, 5))
    target = x @ rng.normal(0, 1, (5, 3)) + 0.5
    pred = analysis.ridge_predictions(x, target, np.ones(200, bool), components=5, alpha=1e-9)
    assert np.allclose(pred, target, atol=1e-6)
    assert not np.allclose(analysis.ridge_predictions(x, target, np.ones(200, bool), components=2, alpha=1e-9),
                           target, atol=1e-2)  # the components limit what it can fit
    tau = np.full((4, 3), 2.0)  # every b equally accepted: the cheapest (the fallback here) is fastest
    best, chosen, cal = analysis.with_fallback(np.array([[0.0, 1.0, 0.5]] * 4), np.ones(4, bool), tau,
                                               np.array([1.0, 2.0, 4.0]), 0)
    assert best.tolist() == [1] * 4 and chosen.tolist() == [0] * 4 and cal["margin"] is None


def _problem(tmp_path, objective):
    train = replace(TrainConfig(), model="mlp", val_fraction=0.25, calibration_fraction=0.2, objective=objective,
                    hidden=8, n_layers=2, dropout=0.0)
    labels = tmp_path / "labels"
    if not labels.exists():
        _label_set(labels)
    return train, load_problem(train, labels)


@pytest.mark.parametrize("objective", ["speed", "paper"])
def test_the_export_round_trips_through_the_policy_and_names_the_train_chosen_b(tmp_path, objective):
    train, p = _problem(tmp_path, objective)
    torch.manual_seed(0)
    model = BlockSizeMLP(V, 3, hidden=8, n_layers=2, dropout=0.0)
    history = [{"epoch": 0, "train_loss": 1.0, "val_accuracy": 0.5, "val_tau_policy": 3.0, "val_tau_best_fixed": 2.9,
                "val_tau_oracle": 4.0}]
    inp = ExportInput(p, train, {"model": model.state_dict(), "epoch": 0}, history, "sha")
    held = export_policy(inp, tmp_path / POLICY)
    policy = BlockSizePolicy.from_pretrained(tmp_path / POLICY)
    b = CANDS[p.fixed_index]
    assert train_chosen_block_size(policy.info) == policy.train_chosen_block_size == b
    assert policy.info["fallback_block_size"] == policy.info["best_fixed_block_size"] == b
    assert policy.candidates == CANDS and policy.info["epochs"] == 1
    assert policy.info["label_dataset_fingerprint"] == "sha"
    assert policy.info["cost_profile"]["seconds"] == {str(c): COSTS[c] for c in CANDS}
    assert CostProfile.load(tmp_path / POLICY / COST_PROFILE).seconds == COSTS
    x = torch.randn(5, V)
    assert torch.equal(policy.scores(x), model.eval()(x))
    if objective == "speed":
        assert policy.info["score"] == SPEED_SCORE and policy.fallback_block_size == b
        assert policy.margin == held["calibration"]["margin"] and set(held["val"]) >= {"policy_with_fallback", "oracle"}
        assert held["val_rows"] == int(p.splits.val.sum())
    else:  # a classifier names the train-chosen b but has no fallback
        assert policy.info["score"] == "class_logits" and policy.fallback_block_size is None and held == {}
    s = train_summary(inp, held)
    s["policy"] = "P"
    assert s["fallback_block_size"] == s["best_fixed_block_size"] == b
    assert s["train_rows"] + s["calibration_rows"] + s["val_rows"] == 120
    lines = summary_lines(s)
    assert f"train-chosen b={b}" in lines[1] and "best fixed" not in " ".join(lines)
    assert (len(lines) == 4) == (objective == "speed")
    hist = s["label_histograms"]
    costs = np.array([COSTS[c] for c in CANDS])
    assert hist["argmax_tau_over_cost"] == {c: int(((p.splits.tau / costs).argmax(1) == i).sum())
                                            for i, c in enumerate(CANDS)}
    assert json.loads((tmp_path / POLICY / POLICY_META).read_text())["objective"] == objective


def test_train_tau_column_reads_tau_expected_and_its_own_argmax_label(tmp_path):
    """train.tau_column=tau_expected: every reader sees that column as tau, and the argmax-tau label follows it
    (not the stored label, the argmax of the sampled tau); ties to the smaller b; empty batches pass."""
    from pipeline.training.data import as_tau, read_splits

    cands = [4, 5, 6]
    tau = [[1.5, 1.9, 1.7], [2.0, 1.0, 1.2], [1.4, 1.4, 1.1]]
    expected = [[1.8, 1.6, 1.7], [1.1, 1.3, 1.2], [1.2, 1.5, 1.5]]
    table = pa.table({"prompt_id": [f"p{i}" for i in range(3)], "tau": tau, "tau_expected": expected,
                      LABEL_COLUMN: [5, 4, 4]})
    path = tmp_path / shard_name(0)
    write_parquet_atomic(table, path)
    plain = read_splits([path], 0.0, cands)
    got = read_splits([path], 0.0, cands, tau_column="tau_expected")
    assert np.allclose(plain.tau, tau) and plain.y_tau.tolist() == [1, 0, 0]
    assert np.allclose(got.tau, expected) and got.y_tau.tolist() == [0, 1, 1]  # 1.5 = 1.5: the smaller b
    empty = as_tau({"prompt_id": np.array([]), "tau_expected": np.array([], dtype=object),
                    LABEL_COLUMN: np.array([])}, "tau_expected", cands)
    assert empty["tau"].shape == (0, 3) and "tau_expected" not in empty


def test_an_unknown_tau_column_is_refused_naming_the_key():
    from pipeline.runtime.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.tau_column"):
        load_config(["train.tau_column=tau_sampled"])
