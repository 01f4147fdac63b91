"""evaluate's pass at load cut into chunks of prompts (issue #66, 5b): every GPU worker gets a part even with one load,
each chunk is saved as it ends, a rerun decodes only the missing chunks, and a load's chunks merge into the rows one
part over all its prompts gives (pipeline.evaluation.load.merge_chunks). No models: the decode is a stand-in."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

import stages.evaluate_load as evaluate_load
from pipeline.evaluation.load import merge_chunks, run_row
from pipeline.executor.ray.device_task import chunks, split
from pipeline.executor.ray.placement import Placement


def gpus(workers: int, device: str = "cuda"):
    return SimpleNamespace(placement=Placement(workers, 1, 0.5, device))


def test_one_load_on_64_gpu_workers_is_cut_into_64_chunks_of_whole_waves_covering_every_prompt_once():
    got = chunks([16], 2650, gpus(64))
    assert len(got) == 64 and [k for _, k, _, _ in got] == list(range(64))
    assert [p for _, _, a, b in got for p in range(a, b)] == list(range(2650))  # contiguous, each prompt once
    assert all(b - a >= 16 and a % 16 == 0 for _, _, a, b in got)  # whole waves, at least one
    assert all((b - a) % 16 == 0 for _, _, a, b in got[:-1])  # only the load's last wave may be short
    assert split(got, gpus(64)) == [[u] for u in got]  # every worker a part of its own


def test_the_workers_go_to_the_loads_with_the_most_waves_and_cpus_take_one_chunk_a_load():
    got = chunks([4, 16], 100, gpus(4))  # 25 waves at c = 4, 7 at c = 16
    assert got == [(4, 0, 0, 32), (4, 1, 32, 64), (4, 2, 64, 100), (16, 0, 0, 100)]
    assert chunks([4, 16], 100, gpus(4, device="cpu")) == [(4, 0, 0, 100), (16, 0, 0, 100)]  # logical GPUs
    assert chunks([4, 16], 100, SimpleNamespace(placement=None)) == [(4, 0, 0, 100), (16, 0, 0, 100)]
    assert len(chunks([64], 100, gpus(8))) == 2  # no part smaller than a wave
    assert len(chunks([2, 4, 8], 100, gpus(2))) == 3  # a part a load at least: split deals them to the workers


def fake_run(n: int, c: int, b: int, seed: float):
    """A batched run of n requests at c: a prefill step, full steps (c rows), then a ragged tail."""
    step = lambda kind, rows, committed, s: SimpleNamespace(kind=kind, rows=rows, committed=committed,  # noqa: E731
                                                           draft_seconds=s / 3, verify_seconds=2 * s / 3)
    steps = [step("prefill", n, 0, 0.01 * n)] + [step("decode", c, c * b, 0.02 + seed * 1e-3) for _ in range(n)]
    steps += [step("decode", r, r, 0.01) for r in range(c - 1, 0, -1)]
    committed = sum(s.committed for s in steps)
    requests = [SimpleNamespace(latency=seed + 0.1 * i, choice=(b, None)) for i in range(n)]
    return SimpleNamespace(steps=steps, requests=requests, new_tokens=committed + n,
                           wall_seconds=sum(s.draft_seconds + s.verify_seconds for s in steps) + 0.05)


def test_merged_chunks_are_the_row_of_their_runs_one_after_the_other():
    cost = SimpleNamespace(run_seconds=lambda steps: sum(1e-3 * s.rows + 2e-3 for s in steps))
    runs = [fake_run(5, 4, 3, 1.0), fake_run(9, 4, 3, 2.0), fake_run(2, 4, 3, 3.0)]
    whole = SimpleNamespace(steps=[s for r in runs for s in r.steps], requests=[q for r in runs for q in r.requests],
                            new_tokens=sum(r.new_tokens for r in runs), wall_seconds=sum(r.wall_seconds for r in runs))
    merged = merge_chunks([[run_row(4, "b=3", 0, r, cost, same_as="b*")] for r in runs])
    assert len(merged) == 1 and merged[0].pop("window_throughput") is None
    want = run_row(4, "b=3", 0, whole, cost, same_as="b*")
    assert merged[0].keys() == want.keys()
    for k, v in want.items():
        assert merged[0][k] == (pytest.approx(v) if isinstance(v, (float, list)) else v), k
    one = [run_row(4, "b=3", 0, runs[0], cost)]
    assert merge_chunks([one]) is one  # one chunk: its rows as they are


def test_a_rerun_decodes_only_the_chunks_missing_and_the_summary_covers_every_prompt(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    pq.write_table(pa.table({"input_ids": [[i, i + 1] for i in range(100)]}), prompts / "part-00000.parquet")
    (prompts / "manifest.json").write_text("{}")
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "policy.json").write_text("{}")
    cfg = SimpleNamespace(evaluate=SimpleNamespace(concurrency=[1, 4, 16], load_repeats=2),
                          decode=SimpleNamespace(max_new_tokens=8, seed=0), model=SimpleNamespace(name="tiny"))
    stage = SimpleNamespace(name="evaluate", cfg=cfg, worker_model=lambda: cfg.model, folder=tmp_path / "eval",
                            prompts=prompts, policy_dir=tmp_path / "policy", placement=Placement(4, 1, 0.5, "cuda"),
                            layout=SimpleNamespace(load_check=tmp_path / "tune" / "load_check.json"),
                            policy_info={"schedule": {"1": 3, "4": 3, "16": 2}})
    calls, fail_at = [], [3]

    def measure(cfg_, stage_, part, sched, fp):  # what _measure saves, without models
        assert len(part) == 1 and sched == {1: 3, 4: 3, 16: 2}  # one chunk a GPU worker
        for u, ids in part:
            calls.append(u)
            if len(calls) == fail_at[0]:
                raise RuntimeError("a lost GPU")
            assert ids == [[i, i + 1] for i in range(u[2], u[3])]
            rows = [{**run_row(u[0], m, rep, fake_run(len(ids), u[0], b, rep + u[2]), None), "window_throughput": None}
                    for rep in range(2) for m, b in (("AR", 1), ("b=2", 2), ("b=3", 3), ("adaptive", 3))]
            evaluate_load.save_chunk(stage_, u, rows, fp, engines_at_once=4 - (u[1] == 1), where={"chunk": u[:2]})

    monkeypatch.setattr(evaluate_load, "_measure", measure)
    # the parts in this process, in turn: an earlier test in this xdist worker may have left a Ray session up
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="a lost GPU"):
        evaluate_load.run_load(cfg, stage, tables=False)
    first = list(calls)
    assert len(first) == 3 and not (stage.folder / "load.json").exists()
    assert sorted(p.name for p in (stage.folder / "load").iterdir()) == [
        f"{evaluate_load._name(u)}.{ext}" for u in sorted(first[:2]) for ext in ("json", "parquet")]

    calls.clear()
    fail_at[0] = 0
    got = evaluate_load.run_load(cfg, stage, tables=False)
    plan = chunks([4, 16], 100, stage)
    assert sorted(calls) == sorted(u for u in plan if u not in first[:2])  # only the missing, each once
    assert got["4"]["chunks"] == 3 and got["16"]["chunks"] == 1 and got["4"]["engines_at_once"] == 3
    rows = pq.read_table(stage.folder / "load.parquet").to_pylist()
    assert {(r["concurrency"], r["requests"]) for r in rows} == {(4, 100), (16, 100)}  # every prompt, once
    assert got["4"]["headline"]["b*(c)"]["measured"]["identical"]  # adaptive and b=3 merged alike, still paired
    assert json.loads((stage.folder / "load.json").read_text())["where"] == [{"chunk": list(u[:2])} for u in plan]

    calls.clear()
    assert evaluate_load.run_load(cfg, stage, tables=False) == got and calls == []  # done: nothing decoded


def test_the_one_off_tasks_load_and_fingerprint_the_labels_commits(tmp_path, monkeypatch):
    """Issue #67 item 7: evaluate's pass at load and tune's load check loaded cfg.model (a null revision: each task
    resolving the hub's "main" on its own) and fingerprinted it. They take the stage's worker_model(): the labels'
    commits. Fails on the old batched_engine(cfg) and on fingerprints of cfg.model."""
    from dataclasses import replace

    import pipeline.decoding.models as models_mod
    import stages.load_check as load_check
    from pipeline.executor.ray.device_task import batched_engine
    from pipeline.runtime.config import load_config

    cfg = load_config([])
    pinned = replace(cfg.model, target="org/target", target_revision="a" * 40, draft_revision="b" * 40)
    for name in ("prompts", "policy"):
        (tmp_path / name).mkdir()
    for f in ("prompts/manifest.json", "policy/policy.json", "policy/cost_profile.json"):
        (tmp_path / f).write_text("{}")
    stage = SimpleNamespace(cfg=cfg, worker_model=lambda: pinned, prompts=tmp_path / "prompts",
                            policy_dir=tmp_path / "policy",
                            layout=SimpleNamespace(load_check=tmp_path / "tune" / "load_check.json"))
    assert evaluate_load._fingerprint(cfg, stage)["model"]["target_revision"] == "a" * 40
    assert load_check._fingerprint(cfg, stage, {1: 3})["model"]["draft_revision"] == "b" * 40

    loaded = []

    def load_models(model):
        loaded.append(model)
        raise RuntimeError("stop here: no weights in this test")

    monkeypatch.setattr(models_mod, "load_models", load_models)
    with pytest.raises(RuntimeError, match="stop here"):
        with batched_engine(cfg, stage.worker_model()):
            pass
    assert loaded == [pinned]
