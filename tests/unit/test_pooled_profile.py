"""The label folder's cost profile pools every worker's start-up points on the labelling machine
(pipeline.labelling.summary.chosen_cost_profile): one worker's profile pins the verify slope to about +-25 % on a
busy 2-core machine, and the pooled refit is what CostProfile.from_raw gives on the union of the points."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.io.shards import encode_metadata, write_parquet_atomic
from pipeline.labelling.summary import chosen_cost_profile
from pipeline.policy.cost import CostProfile

HW = {"platform": "linux", "machine": "x86_64", "processor": "", "cpu_count": 2, "torch_threads": 1, "torch": "2.13.0",
      "gpu": None}


def profile(seed: int, slope: float, hardware=HW) -> dict:
    """A worker's profile from noisy synthetic points at b = 1..6 (version 2 points: steady steps, first step)."""
    rng = np.random.default_rng(seed)
    raw = []
    for rnd in range(1, 4):
        for b in range(1, 7):
            for ctx in (32, 64):
                d = 0.0 if b == 1 else 1e-3 + 0.5 * slope * b
                v = 2e-3 + slope * b
                noise = rng.uniform(1.0, 1.3)  # load on a shared machine only ever slows a step
                raw.append({"b": b, "context": ctx, "round": rnd, "steps": 8, "draft_seconds": d * noise,
                            "verify_seconds": v * noise, "first_draft_seconds": d * 2, "first_verify_seconds": v * 2,
                            "rule": None, "rule_seconds": 0.0})
    meta = {"device": "cpu", "dtype": "float32", "hardware": hardware, "target": "t", "draft": "d",
            "block_sizes": list(range(1, 7)), "context_lengths": [32, 64], "rounds": 3, "stable": True}
    return CostProfile.from_raw(raw, meta).to_dict()


def write(folder, name, prof, rows):
    t = pa.table({"x": list(range(rows))})
    write_parquet_atomic(t.replace_schema_metadata(encode_metadata({"cost_profile": prof})), folder / name)
    return {"file": name, "rows": rows}


def test_workers_on_one_machine_are_pooled_and_another_machine_stays_out(tmp_path):
    a, b = profile(0, 1e-4), profile(1, 1.5e-4)
    other = profile(2, 9e-4, {**HW, "gpu": "H200"})
    files = [write(tmp_path, "part-00000.parquet", a, 64), write(tmp_path, "part-00001.parquet", b, 32),
             write(tmp_path, "part-00002.parquet", other, 16)]
    got, seen, pooled = chosen_cost_profile(tmp_path, {"files": files})
    assert (seen, pooled) == (3, 2)
    want = CostProfile.from_raw(a["raw"] + b["raw"])
    assert got.fit["verify"] == pytest.approx(want.fit["verify"]) and got.seconds == pytest.approx(want.seconds)
    # Neither worker's own fit, nor the other machine's.
    for alone in (a, b, other):
        assert got.fit["verify"]["slope"] != pytest.approx(alone["fit"]["verify"]["slope"], rel=1e-6)
    assert got.meta["pooled_workers"] == 2 and got.meta["rounds"] == 6 and len(got.raw) == len(a["raw"]) * 2
    # It reads back as itself.
    path = tmp_path / "cost_profile.json"
    got.save(path)
    assert CostProfile.load(path).seconds == pytest.approx(got.seconds)


def test_one_worker_is_its_own_profile(tmp_path):
    a = profile(0, 1e-4)
    files = [write(tmp_path, "part-00000.parquet", a, 64), write(tmp_path, "part-00001.parquet", a, 64)]
    got, seen, pooled = chosen_cost_profile(tmp_path, {"files": files})
    assert (seen, pooled) == (1, 1) and got.seconds == pytest.approx(CostProfile.from_dict(a).seconds)
    assert chosen_cost_profile(tmp_path, {"files": []}) is None


def test_finalize_reads_one_footer_per_worker_profile_named_by_the_shards_statistics(tmp_path, monkeypatch):
    """Issue #66: at 15,625 shards the driver read every shard's footer for the profile before _SUCCESS. The
    shards' statistics (merge_label_stats' cost_profiles: each profile's rows and one shard carrying it) let it read
    one footer per worker; the result is the every-footer one. Fails when chosen_cost_profile reads every footer."""
    import pipeline.labelling.summary as summary

    a, b = profile(0, 1e-4), profile(1, 1.5e-4)
    files = [write(tmp_path, f"part-{i:05d}.parquet", a if i % 3 else b, 8) for i in range(30)]
    stats = [{"rows": 8, "candidates": [1], "labels": {}, "speed_labels": {}, "tau_sum": [1.0],
              "cost_profile": {"key": summary.profile_key(a if i % 3 else b), "shard": f["file"]}}
             for i, f in enumerate(files)]
    merged = summary.merge_label_stats(stats)
    assert merged["cost_profiles"] == {summary.profile_key(a): {"rows": 160, "shard": "part-00001.parquet"},
                                       summary.profile_key(b): {"rows": 80, "shard": "part-00000.parquet"}}
    every = chosen_cost_profile(tmp_path, {"files": files})
    read = []
    real = summary.parquet_file
    monkeypatch.setattr(summary, "parquet_file", lambda p: read.append(p.name) or real(p))
    got, seen, pooled = chosen_cost_profile(tmp_path, {"files": files, "summary": merged})
    assert sorted(read) == ["part-00000.parquet", "part-00001.parquet"]
    assert (seen, pooled) == every[1:] == (2, 2) and got.seconds == pytest.approx(every[0].seconds)
    # A shard without the statistic (written before it existed): no cost_profiles, every footer read as before.
    assert "cost_profiles" not in summary.merge_label_stats([*stats, {**stats[0], "cost_profile": None}])
