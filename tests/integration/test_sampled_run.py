"""`blockpilot run` at T = 1 on the real tiny pair and real Ray: every stage runs or says in one line why not, the
labels carry the expected-acceptance column, evaluate pools its draws per row and checks every token by
distribution, and the pass at load runs."""

import logging

import pyarrow.parquet as pq

from conftest import FAST
from pipeline.runtime.config import load_config


def test_a_sampled_run_goes_end_to_end(tmp_path, ray_session, caplog):
    from stages.run import run

    out = tmp_path / "t1"
    # 8 label prompts (a quarter of them val, by the hash split) and 2 evaluation prompts per set: at T = 1 every
    # candidate is decoded (no replay) and evaluate decodes each method twice a prompt, so these two sizes are most of
    # the test's CPU (12 and 3: label 33 and evaluate 36 of its 153 CPU-s, 2026-12-06). 4 prompts x 2 draws still
    # give every method's distribution check a verdict (asserted below).
    cfg = load_config([f"output_dir={out}", *FAST, "decode.temperature=1.0", "evaluate.samples=2",
                       "evaluate.limit=2", "prepare.limit=8", "profile.concurrency=[1,4]",
                       "evaluate.concurrency=[1,4]"])
    with caplog.at_level(logging.INFO, logger="blockpilot"):
        got = run(cfg)
    assert any("=== tune === skipped: decode.temperature=1.0" in r.getMessage() for r in caplog.records)
    assert not (out / "tune").exists()

    labels = pq.read_table(out / "labels" / "part-00000.parquet").to_pylist()
    assert all(len(r["tau_expected"]) == len(r["tau"]) and min(r["tau_expected"]) >= 1 for r in labels)
    assert any(a != b for r in labels for a, b in zip(r["tau"], r["tau_expected"]))  # one draw vs its expectation

    rows = pq.read_table(out / "eval" / "results.parquet").to_pylist()
    assert {r["samples"] for r in rows} == {2}
    assert all(r["matches_autoregressive"] is None and len(r["pit"]) == r["new_tokens"] for r in rows)
    import json

    summary = json.loads((out / "eval" / "summary.json").read_text())
    dist = summary["distribution"]
    assert set(dist["methods"]) == set(summary["methods"]) and dist["all_pass"] and not dist["failing"]
    assert all(v["p_value"] is not None for v in dist["methods"].values())  # enough tokens for a verdict
    assert set(summary["load"]) == {"4"} and got["report"]
