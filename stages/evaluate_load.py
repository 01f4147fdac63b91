"""evaluate's pass at load: every evaluation prompt served c at a time for each c > 1 of ``evaluate.concurrency``.

Runs after evaluate's per-prompt shards, in Ray tasks with the stage's device resources (on GPUs, each load's prompts
cut into chunks of whole waves so that every worker has one, each on its own GPU; on CPUs one task on one thread: a
wall-clock benchmark wants one quiet process; never the job's driver, which may have no GPU at all); in this process
when Ray is not running (tests). The batched engine (pipeline.decoding.batched), the methods and their interleaved
repeats (pipeline.evaluation.load). Each chunk is saved as it ends (``eval/load/<c>-<chunk>.parquet``, then its
``.json``), so a failed or cancelled pass keeps what it finished and a rerun with the same fingerprint decodes only
the missing chunks. Then ``eval/load.parquet`` (one row per c x method x repeat, each load's chunks merged:
pipeline.evaluation.load.merge_chunks) and ``eval/load.json`` (per c: the table, the headline against b*(c) and b*(1)
with measured intervals, the cost model's error); a rerun with the same policy, prompts and settings keeps them.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import pyarrow as pa

from pipeline.io.shards import file_sha256, list_shards, write_json_atomic, write_parquet_atomic, write_text_atomic
from pipeline.io.storage import read_table
from pipeline.runtime.log import get as log
from pipeline.io.layout import COST_PROFILE, POLICY_META

LOAD_ROWS, LOAD_SUMMARY, CHUNKS = "load.parquet", "load.json", "load"

Chunk = Tuple[int, int, int, int]  # pipeline.executor.ray.device_task.chunks: c, k, start, stop


def _fingerprint(cfg, stage) -> Dict[str, Any]:
    return {"policy": file_sha256(stage.policy_dir / POLICY_META), "concurrency": list(cfg.evaluate.concurrency),
            "repeats": cfg.evaluate.load_repeats, "decode": vars(cfg.decode),
            "model": vars(stage.worker_model()),  # the commits it loads
            "prompts": file_sha256(stage.prompts / "manifest.json"),
            # the schedule it runs is the load check's, when tune made one
            "load_check": file_sha256(stage.layout.load_check) if stage.layout.load_check.is_file() else None}


def run_load(cfg, stage, tables: bool = True) -> Dict[str, Any]:
    """{"c": summary} for every c > 1 (empty without one, or when the cost profile has no load grid); ``tables``:
    log each c's table once measured."""
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
    from pipeline.evaluation.load import load_summary, merge_chunks, render_load
    from pipeline.executor.ray.device_task import chunks, on_workers, split, where_of

    prompts = [p for shard in list_shards(stage.prompts)
               for p in read_table(shard, columns=["input_ids"]).column("input_ids").to_pylist()]
    plan = chunks(loads, len(prompts), stage)
    (stage.folder / CHUNKS).mkdir(parents=True, exist_ok=True)
    todo = [u for u in plan if _saved(stage, u, fp) is None]
    if len(todo) < len(plan):
        log("evaluate").info(f"at load: {len(plan) - len(todo)} of {len(plan)} chunks kept from an earlier run")
    sched = schedule_of(stage, info)
    if todo:  # on GPUs one chunk a worker (each decodes on a GPU alone); on CPUs every chunk in one task
        on_workers(stage, _measure, [(cfg, stage, [(u, prompts[u[2]:u[3]]) for u in part], sched, fp)
                                     for part in split(todo, stage)], what="at load")
    summaries, rows, where = {}, [], []
    for c in loads:
        mine = [u for u in plan if u[0] == c]
        saved = [_saved(stage, u, fp) for u in mine]
        got = merge_chunks([read_table(stage.folder / CHUNKS / f"{_name(u)}.parquet").to_pylist() for u in mine])
        rows += got
        where += [s["where"] for s in saved]
        summaries[str(c)] = {**load_summary(got, c, _baselines(sched, c)), "chunks": len(mine),
                             "engines_at_once": min(s["engines_at_once"] for s in saved)}
    for summary in summaries.values():
        for line in render_load(summary) if tables else ():
            log("evaluate").info(line)
    write_parquet_atomic(pa.Table.from_pylist(rows), stage.folder / LOAD_ROWS, compression="zstd")
    write_text_atomic(json.dumps({"fingerprint": fp, "where": where_of(where), "loads": summaries}, indent=1,
                                 default=str) + "\n", out)
    return summaries


def _name(u: Chunk) -> str:
    return f"{u[0]}-{u[1]:05d}"


def _saved(stage, u: Chunk, fp: Dict[str, Any]):
    """The chunk's saved ``.json`` when it holds this fingerprint and these prompts (its rows then saved before
    it), else None."""
    meta = stage.folder / CHUNKS / f"{_name(u)}.json"
    if not meta.exists():
        return None
    got = json.loads(meta.read_text())
    return got if got.get("fingerprint") == fp and [got.get("start"), got.get("stop")] == list(u[2:]) else None


def save_chunk(stage, u: Chunk, rows: List[Dict[str, Any]], fp: Dict[str, Any], **meta: Any) -> None:
    """A chunk's rows, then its ``.json`` (the fingerprint, its prompts, ``meta``): the json last, so that it marks
    rows that are all there."""
    folder = stage.folder / CHUNKS
    write_parquet_atomic(pa.Table.from_pylist(rows), folder / f"{_name(u)}.parquet", compression="zstd")
    write_json_atomic({"fingerprint": fp, "concurrency": u[0], "start": u[2], "stop": u[3], **meta},
                      folder / f"{_name(u)}.json")


def _measure(cfg, stage, part: List[Tuple[Chunk, List[List[int]]]], sched: Dict[int, int], fp: Dict[str, Any]):
    """Decode each chunk of ``part`` (with its prompts) at its c, every method, and save it as it ends."""
    from pipeline.decoding.batched import fixed
    from pipeline.evaluation.load import ADAPTIVE, evaluate_at_load
    from pipeline.policy.blocksize import BlockSizePolicy
    from pipeline.policy.cost import CostProfile
    from pipeline.policy.load_cost import LoadCost

    from pipeline.executor.ray.device_task import batched_engine, where
    from pipeline.executor.memory_checks import engines_at_once

    load_cost = LoadCost.from_profile(CostProfile.load(stage.policy_dir / COST_PROFILE))
    with batched_engine(cfg, stage.worker_model()) as (models, batched):
        policy = BlockSizePolicy.from_pretrained(stage.policy_dir, device=models.device)
        try:
            policy = policy.fold(models.target.lm_head)
        except ValueError:
            pass
        for u, prompts in part:
            c = u[0]
            choosers = {"AR": fixed(1), **{f"b={b}": fixed(b) for b in stage.candidates}}
            rule = _rule_at(stage, c, sched)
            if rule is not None:  # tune's rule at c, alone
                choosers["per-step"] = fixed(rule[1], rule[0])
            choosers[ADAPTIVE] = _adaptive(policy.at_load(c, fallback=sched[c]), rule)
            baselines = _baselines(sched, c)
            # every method's engine at once when their slot caches fit the memory plan's budget, else fewer
            at_once = engines_at_once(cfg, models, prompts, c, len(choosers), max(stage.candidates))
            log("evaluate").info(f"at load c={c}, chunk {u[1]} (prompts {u[2]}..{u[3] - 1}): {len(prompts)} prompts, "
                                 f"{len(choosers)} methods ({at_once} at a time), b*(c)={sched[c]}, "
                                 f"b*(1)={sched[1]}, {cfg.evaluate.load_repeats} repeats")
            got = evaluate_at_load(batched, prompts, c, choosers, list(baselines.values()),
                                   cfg.evaluate.load_repeats, cfg.decode.max_new_tokens, load_cost, cfg.decode.seed,
                                   log=log("evaluate").debug, max_engines=at_once, temperature=cfg.decode.temperature,
                                   top_p=cfg.decode.top_p, top_k=cfg.decode.top_k)
            save_chunk(stage, u, got, fp, engines_at_once=at_once, where=where(models.device))


def schedule_of(stage, info: Dict[str, Any]) -> Dict[int, int]:
    """b*(c) as evaluate runs it: train's schedule (policy.json) as tune's load check left it (tune/load_check.json,
    when tune ran it), so that the K = 0 loads the check measured are AR here too."""
    from pipeline.evaluation.load_check import read_checked

    return read_checked(stage.layout.load_check, {int(c): int(b) for c, b in info["schedule"].items()})


def _baselines(sched: Dict[int, int], c: int) -> Dict[str, str]:
    """The headline's baselines at c: AR too, timed in every repeat (no speculation is a choice at every load, and
    b*(c) may be 1 itself), b*(c) and b*(1)."""
    return {"AR": "AR", "b*(c)": _method(sched[c]), "b*(1)": _method(sched[1])}


def _method(b: int) -> str:
    return "AR" if b == 1 else f"b={b}"


def _rule_at(stage, c: int, sched: Dict[int, int]):
    """(rule, b_max, gain) of tune's choice at c when adaptive adopts it (tune/step_rule.json's ``load``,
    pipeline.decoding.adaptive.adopted_gain), else None; None at a load where b*(c) = 1: no speculation there, the
    rule's neither (tune searched it against the model's b*(c), which the load check may have taken away)."""
    from pipeline.policy.step_rules import LEARNED, LearnedVerify, parse_rule

    from pipeline.decoding.adaptive import adopted_gain

    got = ((stage.step_rule or {}).get("load") or {}).get(str(c))
    gain = adopted_gain(got) if got and sched.get(c, 1) > 1 else None
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
