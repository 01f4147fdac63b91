"""tune's load check (pipeline.evaluation.load_check): b*(c) against no speculation, timed on the label set's val
prompts at each evaluated load where b*(c) speculates, in one task with a worker's resources (pipeline.executor.ray.device_task).

Runs in tune's finalize, after its shards and choice (their actors gone); writes ``tune/load_check.json``, which
evaluate and deploy read. A finalize run again with the same policy, cost profile, prompts and settings keeps it.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List

from pipeline.io.shards import file_sha256, list_shards, write_text_atomic
from pipeline.io.storage import read_table
from pipeline.runtime.log import get as log
from pipeline.io.layout import COST_PROFILE, POLICY_META


def _fingerprint(cfg, stage, model: Dict[int, int]) -> Dict[str, Any]:
    t = cfg.tune
    return {"policy": file_sha256(stage.policy_dir / POLICY_META),
            "cost_profile": file_sha256(stage.policy_dir / COST_PROFILE),
            "prompts": file_sha256(stage.prompts / "manifest.json"),
            "model_schedule": {str(c): b for c, b in model.items()},  # JSON keys: as read back
            "concurrency": [int(c) for c in cfg.evaluate.concurrency], "load_prompts": t.load_prompts,
            "load_repeats": t.load_repeats, "load_max_repeats": t.load_max_repeats, "load_alpha": t.load_alpha,
            "load_tie": t.load_tie, "load_min_gain": t.load_min_gain, "load_loads": t.load_loads,
            "load_budget_s": t.load_budget_s,
            "val_fraction": cfg.train.val_fraction, "calibration_fraction": cfg.train.calibration_fraction,
            "decode": vars(cfg.decode), "model": vars(stage.worker_model())}  # the commits it loads


def run_check(cfg, stage) -> Dict[str, Any]:
    """tune/load_check.json's content (kept from an earlier run when its fingerprint matches); {} when the policy
    has no schedule by load or the check is off (tune.load_prompts 0)."""
    from pipeline.evaluation.load_check import checked_schedule, inherited, loads_to_check

    info = stage.policy_info
    if not info.get("schedule") or cfg.tune.load_prompts == 0:
        return {}
    model = {int(c): int(b) for c, b in info["schedule"].items()}
    out, fp = stage.layout.load_check, _fingerprint(cfg, stage, model)
    if out.is_file():
        done = json.loads(out.read_text())
        if done.get("fingerprint") == fp:
            return done
    loads = loads_to_check(model, cfg.evaluate.concurrency, cfg.tune.load_loads)
    prompts = val_prompts(cfg, stage) if loads else []
    check: Dict[str, Any] = {"fingerprint": fp, "model_schedule": model, "min_gain": cfg.tune.load_min_gain}
    if not loads:
        check.update(loads={}, skipped="b*(c) = 1 at every evaluated load (evaluate.concurrency)")
    elif not prompts:  # nothing to time on: the model's schedule stands, said as not measured
        check.update(loads={}, skipped="the label set has no val prompt (train.val_fraction)")
    else:
        from pipeline.executor.ray.device_task import by_load, on_workers, split, where_of

        # on GPUs, the loads dealt out to the stage's workers, one part each
        parts = on_workers(stage, _measure, [(cfg, stage, prompts, model, group) for group in split(loads, stage)],
                           what="load check")
        check["loads"], check["where"] = by_load([got for got, _ in parts]), where_of([w for _, w in parts])
        check["seconds"] = round(sum(v["seconds"] for v in check["loads"].values()), 1)
        over = sorted(c for c in loads if str(c) not in check["loads"])
        if over:
            check["over_budget"] = over
    check["schedule"] = checked_schedule(model, check["loads"])
    check["inherited"] = {str(c): why for c, why in inherited(model, check["loads"]).items()}
    check["unmeasured"] = [c for c, b in sorted(model.items())
                           if c > 1 and b > 1 and str(c) not in check["loads"] and str(c) not in check["inherited"]]
    text = json.dumps(check, indent=1) + "\n"
    write_text_atomic(text, out)
    return json.loads(text)  # as a reader, or a rerun that keeps it, gets it back: string keys


def val_prompts(cfg, stage) -> List[List[int]]:
    """The first tune.load_prompts prompts of the label set's val split, in the prompt shards' order."""
    from pipeline.policy.blocksize import split_of

    t, got = cfg.train, []
    for shard in list_shards(stage.prompts):
        for r in read_table(shard, columns=["prompt_id", "input_ids"]).to_pylist():
            if split_of(r["prompt_id"], t.val_fraction, t.calibration_fraction) == "val":
                got.append(r["input_ids"])
        if len(got) >= cfg.tune.load_prompts:
            break
    return got[:cfg.tune.load_prompts]


def rule_of(cfg):
    """tune's sequential rule (pipeline.evaluation.sequential) from its settings."""
    from pipeline.evaluation.sequential import SequentialRule

    t = cfg.tune
    return SequentialRule(min_repeats=t.load_repeats, max_repeats=t.load_max_repeats, alpha=t.load_alpha, tie=t.load_tie)


SMALL_B = (2, 3)  # timed at a load before K = 0 there: a b*(c) that loses does not show that every K > 0 does


def _measure(cfg, stage, prompts: List[List[int]], model: Dict[int, int], loads: List[int]):
    from pipeline.evaluation.load_check import check_at
    from pipeline.policy.cost import CostProfile
    from pipeline.policy.load_cost import LoadCost

    from pipeline.executor.ray.device_task import batched_engine, where
    from pipeline.executor.memory_checks import engines_at_once

    load_cost = LoadCost.from_profile(CostProfile.load(stage.policy_dir / COST_PROFILE))
    rule, say = rule_of(cfg), log("tune")
    out = {}
    with batched_engine(cfg, stage.worker_model()) as (models, batched):
        def check(c, b):
            at_once = engines_at_once(cfg, models, prompts, c, 2, b)
            say.info(f"load check c={c}: b={b} against AR on {len(prompts)} val label prompts, "
                     f"{rule.min_repeats}-{rule.max_repeats} repeats {'in lockstep' if at_once > 1 else 'in turn'}")
            got = check_at(batched, prompts, c, b, rule, cfg.decode.max_new_tokens, load_cost, cfg.decode.seed,
                           max_engines=at_once, min_gain=cfg.tune.load_min_gain, log=say.debug)
            got.pop("rows")
            say.info(f"load check c={c}: b={b} {got['verdict']}: {got['why']}")
            return got

        t0 = time.monotonic()
        for i, c in enumerate(loads):
            spent = time.monotonic() - t0
            if i and cfg.tune.load_budget_s and spent >= cfg.tune.load_budget_s:
                say.info(f"load check: {spent:.0f} s spent of tune.load_budget_s={cfg.tune.load_budget_s:g}: c in "
                         f"{loads[i:]} not timed (the model's b*(c) stands there)")
                break
            t_load = time.monotonic()
            got = check(c, model[c])
            got["serve"] = got["b"] if got["kept"] else 1
            if not got["kept"]:
                got["small_b"] = []
                for b in (x for x in SMALL_B if x < model[c]):
                    small = check(c, b)
                    got["small_b"].append(small)
                    if small["kept"]:
                        got["serve"] = b
                        break
            got["seconds"] = round(time.monotonic() - t_load, 1)  # this load's check, its small b included
            out[str(c)] = got
        return out, where(models.device)
