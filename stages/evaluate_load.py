"""evaluate's pass at load: every evaluation prompt served c at a time for each c > 1 of ``evaluate.concurrency``.

Runs after evaluate's per-prompt shards, in one Ray task with the stage's device resources (a GPU of a worker node,
or one CPU: a wall-clock benchmark wants one quiet process, and the job's driver may have no GPU at all), on one
thread on a CPU; in this process when Ray is not running (tests). The batched engine
(pipeline.decoding.batched), the methods and their interleaved repeats (pipeline.evaluation.load). Writes
``eval/load.parquet`` (one row per c x method x repeat) and ``eval/load.json`` (per c: the table, the headline
against b*(c) and b*(1) with measured intervals, the cost model's error); a rerun with the same policy, prompts and
settings keeps them.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pyarrow as pa

from pipeline.io.shards import file_sha256, list_shards, write_parquet_atomic, write_text_atomic
from pipeline.io.storage import read_table
from pipeline.runtime.log import get as log

LOAD_ROWS, LOAD_SUMMARY = "load.parquet", "load.json"


def _fingerprint(cfg, stage) -> Dict[str, Any]:
    return {"policy": file_sha256(stage.policy_dir / "policy.json"), "concurrency": list(cfg.evaluate.concurrency),
            "repeats": cfg.evaluate.load_repeats, "decode": vars(cfg.decode), "model": vars(cfg.model),
            "prompts": file_sha256(stage.prompts / "manifest.json")}


def run_load(cfg, stage) -> Dict[str, Any]:
    """{"c": summary} for every c > 1 (empty without one, or when the cost profile has no load grid)."""
    loads = [int(c) for c in cfg.evaluate.concurrency if int(c) > 1]
    out = stage.folder / LOAD_SUMMARY
    fp = _fingerprint(cfg, stage)
    if not loads:
        return {}
    if out.exists():
        done = json.loads(out.read_text())
        if done.get("fingerprint") == fp:
            return done["loads"]
    info = stage.policy_info
    if not info.get("schedule"):
        log("evaluate").info("no evaluation at load: the cost profile has no load grid (profile.concurrency)")
        return {}
    summaries, rows, where = _measure_where_it_fits(cfg, stage, loads, info)
    from pipeline.evaluation.load import render_load

    for summary in summaries.values():
        for line in render_load(summary):
            log("evaluate").info(line)
    write_parquet_atomic(pa.Table.from_pylist(rows), stage.folder / LOAD_ROWS, compression="zstd")
    write_text_atomic(json.dumps({"fingerprint": fp, "where": where, "loads": summaries}, indent=1, default=str)
                      + "\n", out)
    return summaries


def _measure_where_it_fits(cfg, stage, loads: List[int], info: Dict[str, Any]):
    """_measure in a Ray task that asks what one of the stage's workers asks (one GPU, or its CPUs), so that the
    models load where they fit, never in a GPU-less driver; here when Ray is not running."""
    import time

    import ray

    if not ray.is_initialized():
        return _measure(cfg, stage, loads, info)
    from .placement import plan_workers

    place = stage.placement or plan_workers(stage.resources(), ray.cluster_resources())
    task = ray.remote(_measure).options(num_gpus=place.num_gpus, num_cpus=place.num_cpus, max_retries=0)
    say = log("evaluate")
    say.info(f"at load: one task of {place.asks()} (models on {place.device})")
    ref, t0 = task.remote(cfg, stage, loads, info), time.monotonic()
    while not ray.wait([ref], timeout=60.0)[0]:
        say.info(f"at load: running for {time.monotonic() - t0:.0f} s")
    return ray.get(ref)


def _measure(cfg, stage, loads: List[int], info: Dict[str, Any]):
    import torch

    from pipeline.decoding.batched import BatchedEngine, fixed
    from pipeline.decoding.compiled import apply_compile
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.evaluation.load import ADAPTIVE, evaluate_at_load, load_summary
    from pipeline.policy.blocksize import BlockSizePolicy
    from pipeline.policy.cost import CostProfile
    from pipeline.policy.load_cost import LoadCost

    from .memory_checks import engines_at_once

    models = load_models(cfg.model)
    if models.device.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as one decoding actor of one CPU runs
    apply_compile(models, cfg.engine.compile)
    engine = Engine(models.target, models.draft, models.stop_token_ids if cfg.decode.stop_on_eos else None)
    batched = BatchedEngine(engine)
    policy = BlockSizePolicy.from_pretrained(stage.policy_dir, device=models.device)
    try:
        policy = policy.fold(models.target.lm_head)
    except ValueError:
        pass
    load_cost = LoadCost.from_profile(CostProfile.load(stage.policy_dir / "cost_profile.json"))
    prompts = [p for shard in list_shards(stage.prompts)
               for p in read_table(shard, columns=["input_ids"]).column("input_ids").to_pylist()]
    sched = {int(c): int(b) for c, b in info["schedule"].items()}
    summaries, rows = {}, []
    try:
        for c in loads:
            choosers = {"AR": fixed(1), **{f"b={b}": fixed(b) for b in stage.candidates}}
            rule = _rule_at(stage, c)
            if rule is not None:  # tune's rule at c, alone
                choosers["per-step"] = fixed(rule[1], rule[0])
            choosers[ADAPTIVE] = _adaptive(policy.at_load(c), rule)
            # AR too, timed in every repeat: no speculation is a choice at every load (b*(c) may be 1 itself)
            baselines = {"AR": "AR", "b*(c)": _method(sched[c]), "b*(1)": _method(sched[1])}
            # every method's engine at once when their slot caches fit the memory plan's budget, else fewer
            at_once = engines_at_once(cfg, models, prompts, c, len(choosers), max(stage.candidates))
            log("evaluate").info(f"at load c={c}: {len(prompts)} prompts, {len(choosers)} methods ({at_once} at a "
                                 f"time), b*(c)={sched[c]}, b*(1)={sched[1]}, {cfg.evaluate.load_repeats} repeats")
            got = evaluate_at_load(batched, prompts, c, choosers, list(baselines.values()),
                                   cfg.evaluate.load_repeats, cfg.decode.max_new_tokens, load_cost, cfg.decode.seed,
                                   log=log("evaluate").debug, max_engines=at_once, temperature=cfg.decode.temperature,
                                   top_p=cfg.decode.top_p, top_k=cfg.decode.top_k)
            rows += got
            summaries[str(c)] = {**load_summary(got, c, baselines), "engines_at_once": at_once}
    finally:
        if models.device.type == "cpu":
            torch.set_num_threads(threads)
    return summaries, rows, _where(models.device)


def _method(b: int) -> str:
    return "AR" if b == 1 else f"b={b}"


def _where(device) -> Dict[str, Any]:
    """Where the pass ran (load.json's ``where``): the Ray node and GPU ids, or the process without Ray."""
    import ray

    here = {"device": str(device)}
    if ray.is_initialized():
        here.update(node_id=ray.get_runtime_context().get_node_id(), gpu_ids=[str(g) for g in ray.get_gpu_ids()])
    return here


def _rule_at(stage, c: int):
    """(rule, b_max, gain) of tune's choice at c when adaptive adopts it (tune/step_rule.json's ``load``,
    pipeline.decoding.adaptive.adopted_gain), else None."""
    from pipeline.policy.step_rules import LEARNED, LearnedVerify, parse_rule

    from pipeline.decoding.adaptive import adopted_gain

    got = ((stage.step_rule or {}).get("load") or {}).get(str(c))
    gain = adopted_gain(got) if got else None
    if gain is None:
        return None
    rule = LearnedVerify.from_dict(got["learned_model"]) if got["rule"] == LEARNED else parse_rule(got["rule"])
    return rule, int(got["max_block_size"]), gain


def _adaptive(policy, rule):
    """The product's decoder at c: the policy at c, and where it answers its fallback b*(c), tune's rule at c (when
    that gained); the policy leaves the rule only for a predicted gain above the rule's own (as at c = 1)."""
    import math

    min_gain = math.log1p(rule[2]) if rule is not None else 0.0

    def choose(i, logits, hidden):
        a = policy.choose_action(hidden if policy.reads_hidden else logits, min_gain=min_gain)
        if rule is not None and a.block_size == policy.fallback_block_size and a.rule is None:
            return rule[1], rule[0]
        return a.block_size, None

    return choose


def with_load(stage, summary: Dict[str, Any], loads: Dict[str, Any]) -> Dict[str, Any]:
    """summary.json's ``headline_by_concurrency`` ({c: headline}: c = 1's is ``headline``, each c > 1's against
    b*(c) and b*(1) with its wall-clock intervals) and ``load`` (eval/load.json's), written into the folder's
    summary.json beside what the per-prompt pass wrote."""
    from pipeline.io.shards import write_json_atomic

    extra = {"headline_by_concurrency": {"1": summary.get("headline"),
                                         **{c: s["headline"] for c, s in loads.items()}}, "load": loads}
    path = stage.folder / "summary.json"
    if path.exists():
        write_json_atomic({**json.loads(path.read_text()), **extra}, path)
    return extra
