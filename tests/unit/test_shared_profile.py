"""The cost profile shared per device kind (pipeline/labelling/shared_profile.py), without Ray or models: workers
are threads, profiles are made here, the folder is a real one (the exclusive create and the atomic write as on a
shared disk)."""

from __future__ import annotations

import json
import threading
import time

from pipeline.labelling.shared_profile import clear_unfinished_claims, kind_key, shared_profile, sharing
from pipeline.policy.cost import CostProfile

KIND = {"device": "cuda/bfloat16", "gpu_model": "NVIDIA H100 80GB HBM3", "candidates": [6, 7, 8, 9, 10]}


def profile(ms_1: float, ms_8: float) -> CostProfile:
    return CostProfile(seconds={1: ms_1 / 1e3, 8: ms_8 / 1e3}, meta={"worker": "measured"})


def test_sharing_is_on_for_gpus_by_default_and_as_configured():
    assert sharing("auto", "cuda") and not sharing("auto", "cpu")
    assert sharing("on", "cpu") and not sharing("off", "cuda")
    assert kind_key(KIND) == kind_key(dict(reversed(list(KIND.items()))))  # the key ignores order
    assert kind_key(KIND) != kind_key({**KIND, "gpu_model": "NVIDIA A100-SXM4-80GB"})


def test_workers_of_one_kind_measure_once_and_the_rest_reuse_it(tmp_path):
    measured, said, got = [], [], {}
    start = threading.Barrier(4)

    def worker(i):
        def measure():
            measured.append(i)
            return profile(10.0, 20.0)

        start.wait()
        got[i] = shared_profile(str(tmp_path), KIND, measure, lambda: profile(10.5, 19.0), 0.15, said.append)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(measured) == 1 and not said  # one measurement; the others' own checks within 15 %
    how = sorted(g[1]["shared"] for g in got.values())
    assert how == ["measured", "reused", "reused", "reused"]
    assert all(g[0].seconds == {1: 0.010, 8: 0.020} for g in got.values())
    reused = next(g[1] for g in got.values() if g[1]["shared"] == "reused")
    assert reused["check_ratio"] == {"1": 1.05, "8": 0.95}
    key = kind_key(KIND)
    assert json.loads((tmp_path / ".profiles" / f"{key}.json").read_text())["seconds"] == {"1": 0.01, "8": 0.02}

    # another kind meets its own file
    other = shared_profile(str(tmp_path), {**KIND, "gpu_model": "x"}, lambda: profile(1.0, 2.0), None, 0.15,
                           said.append)
    assert other[1]["shared"] == "measured" and other[0].seconds[8] == 0.002


def test_a_worker_whose_own_steps_disagree_says_so_and_keeps_the_shared_profile(tmp_path):
    said = []
    shared_profile(str(tmp_path), KIND, lambda: profile(10.0, 20.0), None, 0.15, said.append)
    got, how = shared_profile(str(tmp_path), KIND, None, lambda: profile(10.0, 26.0), 0.15, said.append)
    assert got.seconds[8] == 0.020 and how["shared"] == "reused"
    assert len(said) == 1 and "profile.share_tolerance=0.15" in said[0], said
    assert "b=8 26.00 ms against 20.00 ms" in said[0] and "b=1 10.00 ms against 10.00 ms" in said[0]


def test_a_dead_measurers_claim_is_taken_over_once_its_beat_stops_and_published_for_the_rest(tmp_path):
    """Issue #67: a claim whose measurer died (no beat) is taken over after stale_s, by one worker, which publishes
    the profile for the others; before, each waiting worker measured its own after workers.check_timeout_s."""
    said = []
    folder = tmp_path / ".profiles"
    folder.mkdir()
    (folder / f"{kind_key(KIND)}.claim").write_text("{}")  # a claim whose measurer died before publishing
    got, how = shared_profile(str(tmp_path), KIND, lambda: profile(3.0, 4.0), None, 0.15, said.append, stale_s=1.0)
    assert how == {"shared": "measured", "key": kind_key(KIND), "generation": 1} and got.seconds[8] == 0.004
    assert len(said) == 1 and "gave no sign of progress for 1 s" in said[0] and "taking its claim over" in said[0]
    # published: the next worker reuses it, measuring nothing
    again, how = shared_profile(str(tmp_path), KIND, None, lambda: profile(3.0, 4.0), 0.15, said.append,
                                stale_s=1.0)
    assert how["shared"] == "reused" and again.seconds == got.seconds


def test_a_measurer_that_beats_is_waited_for_however_long_it_takes(tmp_path):
    """The waiters wait as long as the measurer beats: a profile taking 6x stale_s is still measured once."""
    measured, said, got = [], [], {}
    start = threading.Barrier(3)

    def worker(i):
        def measure():
            measured.append(i)
            time.sleep(3.0)
            return profile(10.0, 20.0)

        start.wait()
        got[i] = shared_profile(str(tmp_path), KIND, measure, lambda: profile(10.0, 20.0), 0.15, said.append,
                                stale_s=0.5, beat_s=0.1)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(measured) == 1 and not said, said
    assert sorted(g[1]["shared"] for g in got.values()) == ["measured", "reused", "reused"]


def test_a_rerun_clears_the_claims_an_earlier_run_left_unfinished(tmp_path):
    assert clear_unfinished_claims(str(tmp_path)) == 0  # no folder yet
    shared_profile(str(tmp_path), KIND, lambda: profile(1.0, 2.0), None, 0.15, print)  # finished: kept
    folder = tmp_path / ".profiles"
    (folder / "0123456789abcdef.claim").write_text("{}")  # its measurer died
    (folder / "0123456789abcdef.claim.1").write_text("{}")  # and so did the one that took it over
    (folder / "0123456789abcdef.beat.1").write_text("{}")
    assert clear_unfinished_claims(str(tmp_path)) == 2
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == \
        [f"{kind_key(KIND)}.claim", f"{kind_key(KIND)}.json"]
