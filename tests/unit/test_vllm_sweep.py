"""A `vllm bench sweep serve` folder as a cost profile (pipeline.policy.vllm_sweep).

tests/data/vllm-sweep is a sweep in vLLM's layout (vllm/benchmarks/sweep/serve.py): serve params in the dict form
{"ar": {}, "k3": {"speculative_config": {..., "num_speculative_tokens": 3}}, "k7": ...}, bench params
[{"max_concurrency": 1}, {... 4}, {... 16}], --num-runs 1; each combination's summary.json is the list of its run
records (vllm/benchmarks/serve.py keys; the per-request lists, some percentiles and the run=<n>.json copies left out
to keep it small), and summary.csv is pandas' to_csv of all of them. Made-up numbers: step seconds at (b, c)
(ms) 10 / 11 / 12.5 at c = 1, 11 / 16 / 26 at c = 4, 14 / 45 / 85 at c = 16 for b = 1 / 4 / 8, TPOT = step / tau,
throughput = c / TPOT x (0.97, 0.94, 0.90 at c = 1, 4, 16), so K = 7 wins at c = 1, K = 3 at c = 4, K = 0 at c = 16.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from pipeline.policy.cost import CostProfile
from pipeline.policy.load_cost import LoadCost
from pipeline.policy.vllm_sweep import SWEEP_DOC, read_sweep, sweep_profile, vllm_tune_choice

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-sweep"


NAMES = {0: "ar", 3: "k3", 7: "k7"}  # the serve params' _benchmark_name


def comb(k, c):
    return f"SERVE--{NAMES[k]}-BENCH--max_concurrency={c}"


def summary(k, c):
    return DATA / comb(k, c) / "summary.json"


@pytest.fixture(scope="module")
def sweep():
    return read_sweep(DATA)


def lossless(sweep, tmp_path):
    d = sweep_profile(sweep.points, str(DATA), sweep.rejects)
    path = tmp_path / "cost_profile.json"
    path.write_text(json.dumps(d))
    return d, LoadCost.from_profile(CostProfile.load(path))


def test_read_sweep_finds_every_run_with_its_fields(sweep):
    points, rejects = sweep
    assert rejects == [] and len(points) == 9
    assert sorted((p.k, p.concurrency) for p in points) == [(k, c) for k in (0, 3, 7) for c in (1, 4, 16)]
    p = next(p for p in points if (p.k, p.concurrency) == (3, 4))
    rec = json.loads(summary(3, 4).read_text())[0]
    assert Path(p.file) == summary(3, 4) and p.run_number == 0 and p.block_size == 4
    assert (p.output_throughput, p.mean_tpot_ms) == (rec["output_throughput"], rec["mean_tpot_ms"])
    assert p.acceptance_length == rec["spec_decode_acceptance_length"] == 2.76
    assert p.per_position == [0.77, 0.57, 0.42]
    for p in points:
        if p.k == 0:  # no speculative config, no spec_decode_* keys: one token a step
            assert p.acceptance_length == 1.0 and p.per_position is None


def test_summary_csv_alone_reads_the_same_runs(sweep, tmp_path):
    shutil.copy(DATA / "summary.csv", tmp_path)
    points, rejects = read_sweep(tmp_path)
    assert rejects == []
    key = lambda p: (p.k, p.concurrency)  # noqa: E731
    strip = lambda p: dataclasses.replace(p, file="")  # noqa: E731
    assert sorted(map(strip, points), key=key) == sorted(map(strip, sweep.points), key=key)


def test_bad_runs_are_rejected_with_their_file_and_reason_and_the_others_kept(tmp_path):
    shutil.copytree(DATA, tmp_path / "s")
    root = tmp_path / "s"
    corrupt = root / comb(0, 1) / "summary.json"
    corrupt.write_text(corrupt.read_text()[:200])  # cut mid-write
    failed = root / comb(3, 16) / "summary.json"
    rec = json.loads(failed.read_text())
    rec[0].update(failed=3, completed=rec[0]["num_prompts"] - 3)
    failed.write_text(json.dumps(rec))
    no_tau = root / comb(7, 4) / "summary.json"
    rec = json.loads(no_tau.read_text())
    del rec[0]["spec_decode_acceptance_length"]
    no_tau.write_text(json.dumps(rec))
    (root / comb(7, 16) / "run=1.failure.json").write_text(json.dumps({"error_type": "TimeoutError", "error": "x"}))
    points, rejects = read_sweep(root)
    assert len(points) == 6 and (0, 1) not in {(p.k, p.concurrency) for p in points}
    why = {Path(r["file"]): r["reason"] for r in rejects}
    assert "unreadable" in why[corrupt]
    assert "failed request" in why[failed]
    assert "spec_decode_acceptance_length" in why[no_tau]
    assert "TimeoutError" in why[root / comb(7, 16) / "run=1.failure.json"]
    assert len(rejects) == 4


def test_k_is_read_in_every_spelling_the_sweep_records(tmp_path):
    base = json.loads(summary(3, 4).read_text())[0]
    del base["speculative_config"]
    recs = [{**base, "speculative_config.num_speculative_tokens": 3},
            {**base, "speculative_config": json.dumps({"method": "eagle3", "num_speculative_tokens": 3})},
            {**base, "speculative_config": {"num_speculative_tokens": 7,  # the schedule at c = 4 wins
                                            "num_speculative_tokens_per_batch_size": [[1, 2, 7], [3, 1024, 3]]}},
            base,  # speculative metrics, K set in the serve command: not knowable, rejected
            {k: v for k, v in {**base, "speculative_config": {"method": "dflash"}}.items()
             if not k.startswith("spec_decode")}]  # speculating, no K and no metrics: refused, not K = 0
    (tmp_path / "summary.json").write_text(json.dumps(recs))
    points, rejects = read_sweep(tmp_path)
    assert [p.k for p in points] == [3, 3, 3]
    assert [r["record"] for r in rejects] == [3, 4] and "no K" in rejects[0]["reason"]
    assert "refused, not read as K = 0" in rejects[1]["reason"]


def test_the_profile_round_trips_and_costs_each_measured_step_as_tpot_times_tau(sweep, tmp_path):
    d, lc = lossless(sweep, tmp_path)
    assert (d["format"], d["version"], d["source"], d["device"]) == ("blockpilot.cost_profile", 3,
                                                                     "vllm bench sweep serve", "serving engine")
    assert d["concurrency"] == [1, 4, 16] and d["block_sizes"] == [1, 4, 8] and d["top_level_concurrency"] == 1
    assert sorted(d["load"]) == ["16", "4"] and d["rejects"] == [] and d["sweep_dir"] == str(DATA)
    assert d["acceptance_length"]["16"] == pytest.approx({"1": 1.0, "4": 2.78, "8": 3.88})
    for p in sweep.points:
        step = p.mean_tpot_ms / 1000 * p.acceptance_length
        if p.k == 0:  # measured, kept as is
            assert lc.cost(1, p.concurrency) == step
        else:  # the affine fit through two b >= 2 points is exact
            assert lc.cost(p.block_size, p.concurrency) == pytest.approx(step, rel=1e-12)
        assert d["throughput"][str(p.concurrency)][str(p.block_size)] == p.output_throughput
    # Beyond the grid, the affine fit: b = 10 at c = 16 is 85 ms + 2 x (85 - 45) / 4 ms.
    assert lc.cost(10, 16) == pytest.approx(0.105, rel=1e-12)
    assert lc.cost(2, 1) == pytest.approx(0.01025, rel=1e-12)
    assert "`mean_tpot_ms`" in SWEEP_DOC and "`rejects`" in SWEEP_DOC


def test_raw_points_keep_both_the_tpot_and_the_throughput_figure(sweep):
    d = sweep_profile(sweep.points, str(DATA))
    raw = d["raw"] + [r for part in d["load"].values() for r in part["raw"]]
    assert len(raw) == 9
    for r in raw:
        assert r["tpot_step_seconds"] == pytest.approx(r["mean_tpot_ms"] / 1000 * r["acceptance_length"])
        assert r["throughput_step_seconds"] == pytest.approx(
            r["concurrency"] * r["acceptance_length"] / r["output_throughput"])
        # The throughput figure also counts prefill and the ramp: above TPOT's, by the data's 3-10 %.
        assert 1.02 < r["throughput_step_seconds"] / r["tpot_step_seconds"] < 1.12


def test_repeated_runs_give_the_median(sweep):
    p = next(p for p in sweep.points if (p.k, p.concurrency) == (3, 4))
    more = [dataclasses.replace(p, mean_tpot_ms=p.mean_tpot_ms * f, output_throughput=p.output_throughput / f,
                                run_number=i) for i, f in ((1, 1.3), (2, 0.95))]
    d = sweep_profile(sweep.points + more, "x")
    assert d["load"]["4"]["measured"]["4"]["total"] == pytest.approx(p.step_seconds)
    assert d["throughput"]["4"]["4"] == pytest.approx(p.output_throughput)


def test_vllm_tune_choice_is_the_sweeps_best_throughput_per_c(sweep):
    assert vllm_tune_choice(sweep.points) == {1: 7, 4: 3, 16: 0}
    # vLLM's tuner: within 1 % of the best counts as the best, and the smaller K wins.
    k7 = next(p for p in sweep.points if (p.k, p.concurrency) == (7, 1))
    close = [dataclasses.replace(p, output_throughput=k7.output_throughput * 0.995)
             if (p.k, p.concurrency) == (3, 1) else p for p in sweep.points]
    assert vllm_tune_choice(close)[1] == 3
    # ...and a noisy K pays 1.4826 MAD: K = 7 at c = 1 with runs 1.2x, 1x, 0.8x keeps its median but loses.
    noisy = sweep.points + [dataclasses.replace(k7, output_throughput=k7.output_throughput * f) for f in (1.2, 0.8)]
    assert vllm_tune_choice(noisy)[1] == 3


def test_least_cost_per_token_picks_the_k_vllms_tuner_picks(sweep, tmp_path):
    d, lc = lossless(sweep, tmp_path)
    tau = {int(c): {int(b): t for b, t in by_b.items()} for c, by_b in d["acceptance_length"].items()}
    ours = {c: min((1, 4, 8), key=lambda b: lc.cost(b, c) / tau[c][b]) - 1 for c in (1, 4, 16)}
    assert ours == vllm_tune_choice(sweep.points) == {1: 7, 4: 3, 16: 0}


def test_a_sweep_without_c_1_puts_its_smallest_c_on_top(sweep):
    d = sweep_profile([p for p in sweep.points if p.concurrency > 1], "x")
    assert d["top_level_concurrency"] == 4 and d["concurrency"] == [4, 16] and "top_level_note" in d
    assert sorted(d["load"]) == ["16", "4"]  # c = 4 in the load grid too, so it is not read as c = 1 alone
    lc = LoadCost.from_profile(CostProfile.from_dict(d))
    for c, ms in ((1, 26.0), (4, 26.0), (10, 55.5), (16, 85.0)):  # c = 1 is c = 4's stand-in; 10 interpolates
        assert lc.cost(8, c) == pytest.approx(ms / 1000)
    # A c with K = 0 alone has no fit in b: left out, and said so.
    d = sweep_profile([p for p in sweep.points if p.k == 0 or p.concurrency < 16], "x")
    assert d["concurrency"] == [1, 4] and "c=16" in d["rejects"][0]["reason"]


def test_deploy_takes_a_sweep_folder_as_its_cost_profile(tmp_path, capsys):
    """`blockpilot deploy RUN --cost-profile SWEEP_DIR`: the schedule by concurrency under the server's own step costs
    (the test sweep: K = 7 fastest at c = 1, K = 0 at c = 16), with the label set's tau; printed, and valid by
    vLLM's rules."""
    import torch

    from pipeline.evaluation import deploy
    from pipeline.policy.load_cost import vllm_schedule_errors
    from stages.cli import main
    from test_deploy import _run_folder  # the run folder deploy reads, made by the real writers

    torch.manual_seed(0)
    run = _run_folder(tmp_path / "run")
    d = deploy.load_deploy(run.root, str(DATA))
    assert d.schedule is not None and sorted(d.schedule) == [1, 4, 16]
    assert d.schedule[16] == 1  # no speculation at the sweep's highest load
    assert "imported from a vLLM sweep" in d.chosen_on
    spec = deploy.vllm_schedule_config(d)
    assert spec is not None  # K = 7 at c = 1, K = 0 at c = 16: a schedule by load, not one K
    ranges = spec["num_speculative_tokens_per_batch_size"]
    assert not vllm_schedule_errors(ranges, spec["num_speculative_tokens"])
    assert ranges[0][0] == 1 and ranges[0][2] > 0 and ranges[-1] == [16, 1024, 0], ranges  # K = 0 at c = 16
    capsys.readouterr()
    assert main(["deploy", str(run.root), "--cost-profile", str(DATA)]) == 0
    printed = capsys.readouterr().out
    assert json.dumps(ranges, separators=(",", ":")) in printed.replace(" ", ""), printed  # the sweep's schedule
    # the sweep used whole: vLLM's own choice beside ours, the server's acceptance against the labels' tau, rejects
    assert d.sweep["server_k"] == vllm_tune_choice(read_sweep(DATA).points) == {1: 7, 4: 3, 16: 0}
    assert "c=1: vLLM K=7, ours K=" in printed and "c=16: vLLM K=0, ours K=0" in printed
    tau8 = d.sweep["labels_tau"][8]
    assert f"K=7 (b=8): the server's acceptance length 3.90 at c=1, 3.86 at c=4, 3.88 at c=16; the labels' mean tau " \
           f"at b=8: {tau8:.2f}." in printed
    assert "Rejected runs: 0." in printed
    bad = dataclasses.replace(d, sweep={**d.sweep, "rejects": [{"file": "a/summary.json", "record": 2, "reason": "x"}]})
    assert deploy.sweep_lines(bad)[-1] == "Rejected runs: 1: a/summary.json (record 2): x."
