"""label with the cost profile shared per device kind (profile.share=on: on CPUs it is off by default), on the
session's Ray with its two label actors, one per (fake) GPU: one measures, the other reuses it after a check of its own, and says so
when its own steps differ (a tolerance no two timings meet)."""

from __future__ import annotations

import json

from conftest import FAST

from .conftest import blockpilot_here


def test_two_label_workers_of_one_kind_measure_the_profile_once(tmp_path, ray_session):
    out = tmp_path / "run"
    prep = blockpilot_here("prepare", f"output_dir={out}", *FAST)
    assert prep.rc == 0, prep.tail()
    run = blockpilot_here("label", f"output_dir={out}", *FAST, "label.num_workers=2", "profile.share=on",
                          "profile.share_tolerance=1e-9")
    assert run.rc == 0, run.tail()
    workers = json.loads((out / "labels" / "summary.json").read_text())["workers"]
    assert len(workers) == 2, workers
    # one actor per (fake) GPU of the session's node, on distinct GPU ids
    assert sorted(w["gpu_ids"][0] for w in workers) == ["0", "1"] and len({w["identity"] for w in workers}) == 2
    how = sorted(w["cost_profile"]["sharing"]["shared"] for w in workers)
    assert how == ["measured", "reused"], workers
    assert workers[0]["step_cost_seconds"] == workers[1]["step_cost_seconds"]  # one cost model for the set
    reused = next(w for w in workers if w["cost_profile"]["sharing"]["shared"] == "reused")
    assert set(reused["cost_profile"]["sharing"]["check_ratio"]) == {"1", "8"}  # b = 1 and B, timed by itself
    profiles = list((out / ".profiles").glob("*.json"))
    assert len(profiles) == 1 and len(list((out / ".profiles").glob("*.claim"))) == 1
    said = run.output + run.workers
    assert f"{reused['identity']}: its own step times differ from the shared cost profile's" in said, said[-3000:]
