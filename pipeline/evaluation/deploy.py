"""What to set in a serving engine, from a run folder's trained artefacts (``blockpilot deploy``, the report's
deploy section). Ray-free; reads ``train/policy/`` (policy.json, cost_profile.json), ``tune/step_rule.json``, the
train stage's resolved config and, given a serving machine's cost profile, the label set's train split.

Every engine key written here was checked against the engine's own documentation or source (the comment beside
it names where); a key that could not be confirmed is said so here and in the output, and is never emitted.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from pipeline import ASSETS
from pipeline.io.layout import CONFIG, COST_PROFILE, POLICY_META, RunLayout
from pipeline.io.storage import location
from pipeline.policy.blocksize import SPEED_SCORE, policy_actions, train_chosen_block_size

BUNDLED = "bundled:"
VERDICTS = "verdicts.json"  # RUN/deploy-check/: what deploy --check-vllm measured (stages.deploy_check)

# vLLM: `vllm serve TARGET --speculative-config JSON`.
#   method "dflash", model, num_speculative_tokens: docs/features/speculative_decoding/dflash.md and
#     vllm/config/speculative.py (SpeculativeConfig fields) in vllm-project/vllm.
#   num_speculative_tokens = b - 1: the draft proposes the b - 1 tokens after the known one; z-lab/dflash README
#     serves the block-16 drafts with 15 (vLLM's dflash.md shows 16 for a Domino b16 checkpoint, another drafter).
#   revision: SpeculativeConfig.revision (the draft's revision).
#   enable_adaptive_verification: docs/features/speculative_decoding/adaptive_verification.md (DFlash supported
#     through the online acceptance estimator, vllm PR #52228); older SpeculativeConfig docstrings say dspark-only,
#     so it needs a vLLM that has #52228.
#   num_speculative_tokens_per_batch_size: docs/features/speculative_decoding/dynamic_speculative_decoding.md
#     (a list of [start_bs, end_bs, optimal_K]: K draft tokens while the concurrency is in [start_bs, end_bs]; every
#     K <= num_speculative_tokens, the maximum draft window; "Tested with Eagle, Eagle-3, and DFlash"); merged in
#     vllm PR #32374 ("Dynamic Speculative Decoding").
#   With --data-parallel-size > 1 vLLM drops num_speculative_tokens_per_batch_size with a warning and serves the
#     static num_speculative_tokens (VllmConfig._maybe_disable_dynamic_sd_for_data_parallel, vllm/config/vllm.py,
#     vLLM 0.32.0: "DP divergence and deadlocks").
#   adaptive_verification_ema_alpha: UNCONFIRMED as a documented key (only in vllm PR #47808's description, DSpark,
#     default 0.8, and vllm-ascend code); never emitted.
VLLM_METHOD = "dflash"
# SGLang: `python -m sglang.launch_server --model-path TARGET ...`.
#   --speculative-algorithm DFLASH, --speculative-draft-model-path, --speculative-num-draft-tokens (the DFlash verify
#     block size, b), --speculative-dflash-draft-window-size (the draft's KV sliding window, >= the block size):
#     docs.sglang.io docs/advanced_features/speculative_decoding.md, "DFLASH Decoding"; z-lab DFlash model cards
#     ("Use --speculative-num-draft-tokens to set the block size").
#   --speculative-draft-model-revision: the same page, core parameters.
#   --speculative-adaptive: docs/advanced_features/adaptive_speculative_decoding.md, EAGLE with topk 1 only.
#   By concurrency: SGLang documents no per-batch-size schedule for DFlash (AutoSpec, PRs #17749 / #22246, picks
#     EAGLE's step count by batch size at run time; --speculative-adaptive is EAGLE-only): deploy says so.
#   DFLASH_CONFIDENCE: UNCONFIRMED (sgl-project/sglang PR #36136, open: confidence-ranked verify prefixes for
#     DFlash2); not in the released docs, never emitted.
SGLANG_ALGORITHM = "DFLASH"


@dataclass
class Deploy:
    """What the run's artefacts say to deploy."""

    run_dir: str
    block_size: int  # the fixed b to deploy
    chosen_on: str  # how that b was chosen, in words
    train_b: int  # the train stage's own choice (equal to block_size unless a serving profile changed it)
    target: str
    draft: str  # as the engines take it: a hub id or a local folder
    draft_note: Optional[str]  # e.g. a bundled draft is a local folder
    draft_revision: Optional[str]
    trust_remote_code: bool
    candidates: List[int]
    rule_actions: List[str]  # the policy's per-request rule actions, "RULE@b_max" (train.rules)
    policy_answers_fallback_only: bool  # a speed policy without a calibrated margin
    step_rule: Optional[Dict[str, Any]]  # tune/step_rule.json, or None without a tune stage
    schedule: Optional[Dict[int, int]] = None  # b*(c), the train-chosen b at each concurrency (policy.json)
    context: Optional[Dict[int, Any]] = None  # c -> the train split's ContextTable (tau and best b by prompt length)
    load_check: Optional[Dict[str, Any]] = None  # tune/load_check.json where it shaped ``schedule``, else None
    sweep: Optional[Dict[str, Any]] = None  # --cost-profile a vLLM sweep: its own best K, acceptance, rejects
    options: Optional[Any] = None  # pipeline.evaluation.vllm_options.Options: plain / fixed K / schedule, priced
    options_note: Optional[str] = None  # why there are none, or where their costs come from

    @property
    def no_speculation_at(self) -> List[int]:
        """The loads where tune's load check left no speculation, each by its own evidence: a checked load whose
        verdicts serve b = 1, and the loads the monotone fit covers (``inherited``). A load the check kept, or never
        timed and did not cover, is not among them, whatever lies below it."""
        from pipeline.evaluation.load_check import served

        check = self.load_check or {}
        off = {int(c) for c, v in (check.get("loads") or {}).items() if served(v) == 1}
        return sorted(off | {int(c) for c in (check.get("inherited") or {})})

    @property
    def no_speculation_from(self) -> Optional[int]:
        """The first of :attr:`no_speculation_at`, or None (not "K = 0 from here on": loads above it keep their own
        answers)."""
        off = self.no_speculation_at
        return off[0] if off else None

    @property
    def rule(self) -> Optional[str]:
        return None if self.step_rule is None else str(self.step_rule["rule"])

    @property
    def b_max(self) -> Optional[int]:
        return None if self.step_rule is None else int(self.step_rule["max_block_size"])


def _model_path(name: str):
    """(what an engine takes, a note): a bundled name is a folder shipped inside the pipeline package."""
    if name.startswith(BUNDLED):
        path = ASSETS / name[len(BUNDLED):]
        return str(path), (f"`{name}` is the bundled tiny test pair's draft, a local folder ({path}); an engine "
                           "loads it by path, and whether it supports its architecture is not checked here")
    return name, None


def serving_profile(path):
    """The serving machine's CostProfile from ``--cost-profile``: a cost_profile.json (``blockpilot profile`` run
    there), or the folder of a ``vllm bench sweep serve`` run (pipeline.policy.vllm_sweep: the server's own step
    seconds at each (K, c) it ran; its ``source`` says so)."""
    from pipeline.policy.cost import CostProfile

    where = location(path)
    if not where.is_dir():
        return CostProfile.load(where)
    from pipeline.policy.vllm_sweep import read_sweep, sweep_profile

    got = read_sweep(where)
    if not got.points:
        raise ValueError(f"--cost-profile {path}: a folder, but no `vllm bench sweep serve` run in it "
                         f"({len(got.rejects)} rejected: {'; '.join(r['reason'] for r in got.rejects[:3])})")
    return CostProfile.from_dict(sweep_profile(got.points, str(path), got.rejects))


def sweep_summary(folder, serving, run: RunLayout, candidates: List[int]) -> Dict[str, Any]:
    """What a vLLM sweep says beside the schedule deploy re-chose from it: the K vLLM's own tuner picks at each c
    (pipeline.policy.vllm_sweep.vllm_tune_choice), the acceptance length the server measured per (c, b) against the
    label set's mean tau at that b, and the runs it could not use."""
    import numpy as np

    from pipeline.io.shards import list_shards
    from pipeline.io.storage import read_table
    from pipeline.policy.vllm_sweep import read_sweep, vllm_tune_choice

    taus = [row for shard in list_shards(run.labels) for row in read_table(shard, columns=["tau"]).column(
        "tau").to_pylist()]
    labels = {b: float(np.mean([t[i] for t in taus])) for i, b in enumerate(candidates)} if taus else {}
    return {"server_k": vllm_tune_choice(read_sweep(folder).points),
            "acceptance": {int(c): {int(b): float(t) for b, t in by_b.items()}
                           for c, by_b in (serving.meta.get("acceptance_length") or {}).items()},
            "labels_tau": labels, "rejects": list(serving.meta.get("rejects") or [])}


def sweep_lines(d: Deploy) -> List[str]:
    """The sweep used whole: the server's own best K beside ours, its acceptance against the labels' tau, its
    rejected runs."""
    s = d.sweep
    ours = d.schedule or {}
    lines = ["K by load, vLLM's own tuner (tune_speculative_k's defaults on the sweep's output throughput) beside "
             "this schedule's: " + ", ".join(f"c={c}: vLLM K={k}, ours K={max(ours.get(c, 1) - 1, 0)}"
                                              if c in ours else f"c={c}: vLLM K={k}, ours not on the grid"
                                              for c, k in sorted(s["server_k"].items())) + "."]
    for b in sorted({b for by_b in s["acceptance"].values() for b in by_b if b > 1}):
        measured = ", ".join(f"{by_b[b]:.2f} at c={c}" for c, by_b in sorted(s["acceptance"].items()) if b in by_b)
        tau = s["labels_tau"].get(b)
        lines.append(f"K={b - 1} (b={b}): the server's acceptance length {measured}; the labels' mean tau at b={b}: "
                     + (f"{tau:.2f}" if tau is not None else "not labelled (b outside the candidates)") + ".")
    rejects = s["rejects"]
    def where(r):
        return r["file"] + ("" if r.get("record") is None else f" (record {r['record']})")

    lines.append(f"Rejected runs: {len(rejects)}" + ("" if not rejects else ": " + "; ".join(
        f"{where(r)}: {r['reason']}" for r in rejects)) + ".")
    return lines


def rechoose(run: RunLayout, info: Dict[str, Any], train_cfg, profile):
    """(the train-chosen b, the schedule b*(c) or None) again, under another machine's cost profile (a serving
    machine's `blockpilot profile`, or a vLLM sweep imported by pipeline.policy.vllm_sweep): the same rules train
    applies (least mean modelled time per token on the label set's train split, pipeline.training.problem; b*(c) by
    pipeline.policy.load_cost.schedule, no speculation among the options), with that machine's seconds per step."""
    from pipeline.io.shards import list_shards
    from pipeline.policy.load_cost import LoadCost, schedule
    from pipeline.training.data import read_splits
    from pipeline.training.problem import train_chosen_index

    shards = list_shards(run.labels)
    if not shards:
        raise FileNotFoundError(f"{run.labels} holds no label shards: choosing b under another cost profile needs "
                                "the label set's tau")
    cands = [int(b) for b in info["candidates"]]
    calib = train_cfg.calibration_fraction if train_cfg.objective == "speed" else 0.0
    splits = read_splits(shards, train_cfg.val_fraction, cands, calib)
    tau = splits.tau[splits.train][:, :len(cands)]
    b = cands[train_chosen_index(tau, [profile.cost(x) for x in cands])]
    load = LoadCost.from_profile(profile)
    return b, (schedule(tau, cands, load, load.concurrency, splits.train_widths) if len(load.concurrency) > 1
               else None)


def pinned_draft_revision(cfg, labels) -> Optional[str]:
    """The draft revision to serve: the config's, else the hub commit the labels were made with (a local folder's
    sha256 is no revision an engine takes). A configured one that is not the labels' is refused, naming both."""
    from pipeline.io.shards import labels_revisions

    recorded = labels_revisions(labels).get("draft_revision")
    commit = None if recorded is None or recorded.startswith("sha256:") else recorded
    mine = cfg.model.draft_revision
    if mine and commit and mine != commit:
        raise ValueError(f"model.draft_revision: {mine} is not the commit the labels were made with ({commit}, "
                         f"{labels}/fingerprint.json): deploy serves the draft the policy was trained for")
    return mine or commit


def load_deploy(output_dir, cost_profile=None) -> Deploy:
    """The deployment the run folder's artefacts give; ``cost_profile`` (a serving machine's cost_profile.json,
    from `blockpilot profile` there) re-chooses the fixed b for that machine."""
    from omegaconf import OmegaConf

    run = RunLayout(location(output_dir))
    meta = run.policy / POLICY_META
    if not meta.is_file():
        raise FileNotFoundError(f"{meta} is missing: deploy reads the trained policy (run `blockpilot train`)")
    info = json.loads(meta.read_text())
    cfg = OmegaConf.create((run.train / CONFIG).read_text())
    train_b = train_chosen_block_size(info)
    sched, check, sweep = None, None, None
    if cost_profile is None:
        if info.get("schedule"):
            from pipeline.evaluation.load_check import check_for, checked_schedule

            model = {int(c): int(x) for c, x in info["schedule"].items()}
            check = check_for(run.load_check, model)  # the measured K = 0 loads, where tune checked
            sched = model if check is None else checked_schedule(model, check["loads"])
        b = train_b
        chosen_on = ("the label set's train split, by modelled time per token under the labelling machine's cost "
                     f"profile ({run.policy / COST_PROFILE})" if "cost_profile" in info else
                     "the label set's train split, by mean tau (no cost profile)")
    else:
        serving = serving_profile(cost_profile)
        b, sched = rechoose(run, info, cfg.train, serving)
        if serving.meta.get("source") == "vllm bench sweep serve":
            sweep = sweep_summary(location(cost_profile), serving, run, [int(c) for c in info["candidates"]])
        chosen_on = (f"the label set's train split, by modelled time per token under the serving machine's cost "
                     f"profile ({cost_profile}{', imported from a vLLM sweep' if serving.meta.get('source') else ''})"
                     f"; under the labelling machine's, train chose b={train_b}")
    draft, note = _model_path(str(cfg.model.draft))
    target, _ = _model_path(str(cfg.model.target))
    rule_path = run.step_rule
    profile_path = run.policy / COST_PROFILE
    options, options_note = vllm_options(run, cfg.train, info, b, sched,
                                         serving if cost_profile is not None else
                                         (_load_profile(profile_path) if profile_path.is_file() else None),
                                         str(cost_profile) if cost_profile is not None else str(profile_path))
    d = Deploy(
        run_dir=str(run.root), block_size=b, chosen_on=chosen_on, train_b=train_b, target=target, draft=draft,
        draft_note=note, draft_revision=pinned_draft_revision(cfg, run.labels),
        trust_remote_code=bool(cfg.model.trust_remote_code),
        candidates=[int(c) for c in info["candidates"]],
        rule_actions=[a.name for a in policy_actions(info["candidates"], info.get("rule_actions")) if a.rule],
        policy_answers_fallback_only=info.get("score") == SPEED_SCORE and info.get("margin") is None,
        step_rule=json.loads(rule_path.read_text()) if rule_path.is_file() else None,
        schedule=sched, load_check=check, sweep=sweep, options=options, options_note=options_note,
        # each length bucket compared with the b the 3-item form serves at that load (the schedule, after the load
        # check, is over the same grid; without one, the fixed b): where length does not matter, both forms agree
        context=context_tables(run, cfg.train, info, None if cost_profile is None else serving,
                               base=lambda c: (sched or {}).get(c, b)))
    verdicts = run.root / "deploy-check" / VERDICTS
    if d.options is not None and verdicts.is_file():  # the vLLM check's measured verdicts, as tune's load check
        from pipeline.evaluation.vllm_options import apply_verdicts

        apply_verdicts(d.options, lambda o: json.dumps(option_config(d, o)), json.loads(verdicts.read_text()))
    return d


def _load_profile(path):
    from pipeline.policy.cost import CostProfile

    return CostProfile.load(path)


def vllm_options(run: RunLayout, train_cfg, info: Dict[str, Any], fixed_b: int, sched: Optional[Dict[int, int]],
                 profile, source: str):
    """(Options, a note): plain vLLM, the fixed K and the schedule priced at every load of the profile's grid on the
    label set's train split (pipeline.evaluation.vllm_options), and which deploy serves; (None, why) where they
    cannot be priced (no profile, no label shards, no plain step in the profile)."""
    from pipeline.evaluation.vllm_options import choose, price
    from pipeline.io.shards import list_shards
    from pipeline.policy.load_cost import LoadCost, has_ar, padded_width
    from pipeline.training.data import read_splits

    if profile is None:
        return None, "no cost profile: the options are not priced"
    shards = list_shards(run.labels) if run.labels.is_dir() else []
    if not shards:
        return None, f"{run.labels} holds no label shards: no tau to price the options with"
    load = LoadCost.from_profile(profile)
    if not has_ar(load):
        return None, (f"the cost profile ({source}) has no plain step (b = 1) at every load: plain vLLM cannot be "
                      "priced; time it (a sweep run without --speculative-config)")
    cands = [int(b) for b in info["candidates"]]
    calib = train_cfg.calibration_fraction if train_cfg.objective == "speed" else 0.0
    splits = read_splits(shards, train_cfg.val_fraction, cands, calib)
    widths = splits.train_widths
    loads = list(load.concurrency) if len(load.concurrency) > 1 else [1]
    schedule = dict(sched) if sched else {c: int(fixed_b) for c in loads}

    def cost(b: int, c: int) -> float:
        width = padded_width(widths, c) if widths is not None and len(widths) and c > 1 else None
        return load.cost(b, c, width)

    k0 = {int(c): float(v) for c, v in (profile.meta.get("speculative_k0") or {}).items()}
    o = choose(price(splits.tau[splits.train][:, :len(cands)], cands, cost, loads, fixed_b, schedule, k0))
    engine = profile.meta.get("engine") or profile.meta.get("source") or "our engine"
    return o, f"{source} (timed in {engine})"


def context_tables(run: RunLayout, train_cfg, info: Dict[str, Any], serving=None,
                   base: Optional[Callable[[int], int]] = None) -> Optional[Dict[int, Any]]:
    """{c: the label set's train split bucketed by prompt length} under the cost at each c of the schedule's grid
    (the run's profile, or the serving machine's), at the width b*(c) is costed at (pipeline.policy.load_cost.
    padded_width of the train rows), each bucket compared with ``base(c)`` (the 3-item form's b there) and the
    "varies" verdicts corrected over every bucket at every c together (context_length.decide). None without label
    shards or a cost profile."""
    from pipeline.evaluation.context_length import context_table, decide, rows_from_shards
    from pipeline.io.shards import list_shards
    from pipeline.policy.cost import CostProfile
    from pipeline.io.storage import parquet_file
    from pipeline.policy.load_cost import LoadCost, has_ar, padded_width
    from pipeline.training.data import read_splits

    path = run.policy / COST_PROFILE
    shards = list_shards(run.labels) if run.labels.is_dir() else []
    if not shards or (serving is None and not path.is_file()) or \
            "prompt_tokens" not in parquet_file(shards[0]).schema_arrow.names:
        return None
    load = LoadCost.from_profile(serving or CostProfile.load(path))
    cands = [int(b) for b in info["candidates"]]
    calib = train_cfg.calibration_fraction if train_cfg.objective == "speed" else 0.0
    widths = read_splits(shards, train_cfg.val_fraction, cands, calib).train_widths

    def width(c: int) -> Optional[float]:  # as pipeline.policy.load_cost.schedule takes it
        return padded_width(widths, c) if widths is not None and len(widths) and c > 1 else None

    def base_at(c: int) -> Optional[int]:  # a b the labels never measured (b = 1 without a timed AR, a small b the
        b = None if base is None else base(c)  # load check kept): its K comes from the check (context_ranges)
        return b if b is not None and (b in cands or (b == 1 and has_ar(load))) else None

    x, tau = rows_from_shards(shards, cands, "train", train_cfg.val_fraction, calib)  # once, for every c
    tables = {c: context_table(x, tau, cands, lambda b, c=c: load.cost(b, c, width(c)), with_ar=has_ar(load),
                               base_b=base_at(c)) for c in load.concurrency}
    decide(list(tables.values()))
    return tables


# ---- the engines' settings ---------------------------------------------------------------------------------------

def vllm_speculative_config(d: Deploy, block_size: Optional[int] = None, adaptive: bool = False) -> Dict[str, Any]:
    """vLLM's --speculative-config for a fixed b (keys: see the module's comments)."""
    b = d.block_size if block_size is None else block_size
    spec: Dict[str, Any] = {"method": VLLM_METHOD, "model": d.draft, "num_speculative_tokens": b - 1}
    if d.draft_revision:
        spec["revision"] = d.draft_revision
    if adaptive:
        spec["enable_adaptive_verification"] = True
    return spec


def vllm_schedule_config(d: Deploy) -> Optional[Dict[str, Any]]:
    """vLLM's --speculative-config by concurrency: ``num_speculative_tokens_per_batch_size`` from the schedule b*(c)
    (K = b - 1 per range, K = 0 where not speculating wins), ``num_speculative_tokens`` its largest K; None without
    a schedule, or where K = 0 at every load (vLLM refuses num_speculative_tokens 0: serve without speculation).
    Checked against vLLM's own rules (:func:`pipeline.policy.load_cost.vllm_schedule_errors`) before it is printed."""
    from pipeline.policy.load_cost import vllm_ranges, vllm_schedule_errors

    if not d.schedule or max(d.schedule.values()) < 2:
        return None
    ranges = vllm_ranges(d.schedule)
    spec = vllm_speculative_config(d, max(d.schedule.values()))
    spec["num_speculative_tokens_per_batch_size"] = ranges
    errors = vllm_schedule_errors(ranges, spec["num_speculative_tokens"])
    if errors:  # a bug here, never the user's: say it rather than print a setting vLLM refuses
        raise ValueError(f"deploy built a schedule vLLM would refuse ({'; '.join(errors)}): {ranges}")
    return spec


def option_config(d: Deploy, option: str) -> Optional[Dict[str, Any]]:
    """vLLM's --speculative-config of one option of :mod:`pipeline.evaluation.vllm_options` (None: plain vLLM)."""
    from pipeline.evaluation.vllm_options import FIXED, SCHEDULE

    if option == FIXED:
        return vllm_speculative_config(d) if d.block_size > 1 else None
    if option == SCHEDULE:
        return vllm_schedule_config(d) or (vllm_speculative_config(d) if not d.schedule and d.block_size > 1
                                           else None)
    return None


def served_configs(d: Deploy) -> Dict[int, Optional[Dict[str, Any]]]:
    """{c: the --speculative-config deploy serves at c (None: plain vLLM)} over the priced grid; without priced
    options, the schedule (else the fixed K) at c = 1 and every load of the schedule."""
    if d.options is None:
        spec = vllm_schedule_config(d) or (vllm_speculative_config(d) if d.block_size > 1 else None)
        return {c: spec for c in sorted(d.schedule or {1: d.block_size})}
    return {c: option_config(d, o) for c, o in sorted(d.options.serve.items())}


def options_lines(d: Deploy) -> List[str]:
    """Plain vLLM, the fixed K and the schedule priced at each load, what deploy serves and why, and the commands."""
    from pipeline.evaluation.vllm_options import FIXED, PLAIN, SCHEDULE, SPLIT, lines

    if d.options is None:
        return [f"Not priced: {d.options_note}."]
    o = d.options
    name = {PLAIN: "no --speculative-config", FIXED: f"K={d.block_size - 1}", SCHEDULE: "its K at c"}
    out = [f"Expected output tokens/s over c streams at each load (costs: {d.options_note}; tau: the label set's "
           "train split; x = against plain vLLM). A schedule's K = 0 is NOT plain vLLM: a server with a speculative "
           "config runs the drafter's forward at every step, K = 0 included (vllm/v1/spec_decode/"
           "llm_base_proposer.py, vLLM 0.32.0), so it is priced apart:", "", *lines(o, lambda n: name[n]), ""]
    remote = ["--trust-remote-code"] if d.trust_remote_code else []
    plain_cmd = _shell(["vllm", "serve", d.target, *remote])
    if o.chosen == SPLIT:
        spec = option_config(d, o.speculative)
        at = [c for c, x in o.serve.items() if x == PLAIN]
        spans = [(c, next((x for x in o.loads if x > c), None)) for c in at]
        where = ", ".join(f"{c} or more" if hi is None else f"{c} to {hi - 1}" for c, hi in spans)
        out += [f"Deploys: plain vLLM and a speculative server ({o.speculative}), the load routed between them: "
                f"{o.why}. Send a request to the plain server while the speculative one has {where} running, to the "
                "speculative one otherwise:", "", "```bash", plain_cmd,
                _shell(["vllm", "serve", d.target, *remote, "--speculative-config", json.dumps(spec)]), "```"]
    else:
        spec = option_config(d, o.chosen)
        out += [f"Deploys: {o.chosen}: {o.why}.", "", "```bash",
                plain_cmd if spec is None else _shell(["vllm", "serve", d.target, *remote, "--speculative-config",
                                                       json.dumps(spec)]), "```"]
    if o.notes:
        out += ["", "Priced without labels: " + "; ".join(o.notes) + "."]
    zero = [c for c in o.loads if any(o.k[n][c] == 0 for n in o.k if n != PLAIN)]
    if any(o.k0[c] != "measured" for c in zero):
        out += ["", "A speculative server's K = 0 was not timed at c in "
                f"{[c for c in zero if o.k0[c] != 'measured']}: priced as an estimate (a b = 2 step committing one "
                "token); `--cost-profile` with a vLLM profile (label.engine=vllm's, or a sweep with a speculative "
                "run at K = 0) measures it."]
    return out


def crossover(schedule: Dict[int, int]) -> Optional[int]:
    """The smallest grid c from which not speculating (b*(c) = 1) holds at every larger grid point; None if never."""
    cs = sorted(schedule)
    tail = [c for i, c in enumerate(cs) if all(schedule[x] == 1 for x in cs[i:])]
    return tail[0] if tail else None


def load_lines(d: Deploy) -> List[str]:
    """What deploy says about serving under load: the schedule, vLLM's setting and SGLang's lack of one."""
    if not d.schedule:
        return ["No schedule by concurrency: the cost profile has no load grid (profile.concurrency, cost profile "
                "version 3)."]
    table = ", ".join(f"c={c}: {'no speculation' if b == 1 else f'b={b}'}" for c, b in sorted(d.schedule.items()))
    checked = " as tune's load check left it (below)" if d.load_check and d.load_check.get("loads") else ""
    lines = [f"Train-chosen b by concurrency, no speculation (b = 1) among the options (modelled time per token on "
             f"the label set's train split under the profile's batched seconds per step){checked}: {table}."]
    measured = set(d.no_speculation_at)
    from pipeline.evaluation.load_check import served

    for c, v in sorted(((d.load_check or {}).get("loads") or {}).items(), key=lambda kv: int(kv[0])):
        small = "".join(f" Then b={x['b']}: {x.get('verdict', '')}, {x['why']}." for x in v.get("small_b", []))
        serve = served(v)
        lines.append(f"Measured at c={c} (tune's load check, {v['prompts']} val label prompts, {v['repeats']} "
                     f"repeats {v.get('timing', 'in lockstep')}): b={v['b']} {v.get('verdict', '')}, {v['why']}."
                     + small + (" Served: " + ("b*(c), as modelled." if serve == v["b"] else
                                              "no speculation (K = 0) at this load." if serve == 1 else
                                              f"b={serve} (K = {serve - 1}).")))
    for c, why in sorted(((d.load_check or {}).get("inherited") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"Not timed at c={c}: K = 0 there by the monotone fit ({why}).")
    ar = sorted(c for c, b in d.schedule.items() if b == 1 and c not in measured)
    cross = crossover(d.schedule)
    if ar:
        lines.append(f"K = 0 at c in {ar}: there a verify of b tokens costs more per step than the tokens it accepts "
                     "save, so plain decoding is modelled fastest" + (f"; from c = {cross} on no speculation wins at "
                                                                      "every larger load of the grid" if cross else "")
                     + ".")
    if not (d.load_check or {}).get("loads") and d.schedule and max(d.schedule.values()) > 1:
        why = (d.load_check or {}).get("skipped")
        lines.append("Not measured: the schedule is the cost model's alone ("
                     + (f"tune's load check: {why}" if why else "no tune/load_check.json, or a serving machine's "
                        "profile") + "; time b*(c) against no speculation there before trusting a close call).")
    spec = vllm_schedule_config(d)
    remote = " --trust-remote-code" if d.trust_remote_code else ""
    if spec is None:
        lines.append(f"vLLM: `{_shell(['vllm', 'serve', d.target])}{remote}` without --speculative-config: no "
                     "speculation at any load of the grid (vLLM's schedule needs num_speculative_tokens > 0).")
    else:
        lines.append(f"vLLM: `{_shell(['vllm', 'serve', d.target])}{remote} --speculative-config "
                     f"{shlex.quote(json.dumps(spec))}`: K draft tokens while the number of running requests is in "
                     "[start_bs, end_bs], K = 0 = no speculation (a grid point's K holds up to the next point; the last "
                     "range ends at 1024, raise it to your --max-num-seqs). Checked by vLLM's own rules "
                     "(vllm/v1/spec_decode/dynamic/utils.py).")
    lines.append("SGLang: `--speculative-adaptive-config` takes EAGLE/EAGLE3 with topk 1 only, not DFLASH "
                 "(python/sglang/srt/speculative/adaptive_spec_params.py), and no per-batch-size schedule is "
                 "documented for DFlash; nearest: the b of your typical concurrency with "
                 "`--speculative-num-draft-tokens`, or no speculative arguments where that b is 1.")
    return lines


def context_lines(d: Deploy) -> List[str]:
    """The context-length table (c = 1), whether the best b varies with prompt length at each c, and where it does,
    the 5-item schedule of vLLM's open PR #48944 (never a merged key)."""
    from pipeline.evaluation.context_length import context_ranges, render_table

    if not d.context:
        return ["No context-length table: the run folder has no label shards or no cost profile."]
    first = min(d.context)
    lines = [f"Acceptance by prompt length (the label set's train split, modelled cost at c={first}):", "",
             *render_table(d.context[first]), ""]
    inherited = {int(c) for c in ((d.load_check or {}).get("inherited") or {})}
    off = set(d.no_speculation_at)

    def verdict(c: int) -> str:  # each load's own answer: a tie at c = 4 says nothing of c = 8 or a b kept at c = 16
        if c not in off:
            return ""
        if c in inherited:
            return (" Served: K = 0 in every length bucket, by the load check's monotone fit above its checked loads "
                    "(not timed at this load).")
        return (" Served: K = 0 in every length bucket, as tune's load check measured at this load (the buckets "
                "are the cost model's).")

    lines += [f"- c={c}: best b {'varies' if t.varies else 'does not vary'} with prompt length ({t.why})."
              + (verdict(c) if t.varies else "")
              for c, t in sorted(d.context.items()) if c != first]
    if any(t.varies for t in d.context.values()):
        entries = context_ranges(d.context, no_speculation_at=d.no_speculation_at, served=d.schedule)
        t = next(iter(d.context.values()))
        lines += ["", "Where it varies, the 5-item form `[bs_lo, bs_hi, ctx_lo, ctx_hi, K]` of vLLM's OPEN PR #48944. "
                  "It needs a vLLM built from that PR: no released vLLM takes 5-item entries (0.32.0 refuses them). "
                  "Each length bucket keeps the 3-item schedule's K unless its own b is faster beyond noise (Holm "
                  f"over {t.tests} tests, every bucket and block size at every load, family-wise 5 %); ctx is the "
                  "request's context length, "
                  "the buckets here are prompt lengths. As `num_speculative_tokens_per_batch_size`:", "",
                  "```json", json.dumps(entries), "```"]
    else:
        lines += ["", "Tau's dependence on prompt length does not change the best b beyond noise at any c: the 3-item "
                  "schedule above is the whole answer."]
    return lines


def sglang_args(d: Deploy, block_size: Optional[int] = None) -> List[str]:
    """SGLang launch_server's speculative arguments for a fixed b (keys: see the module's comments)."""
    b = d.block_size if block_size is None else block_size
    args = ["--speculative-algorithm", SGLANG_ALGORITHM, "--speculative-draft-model-path", d.draft,
            "--speculative-num-draft-tokens", str(b)]
    if d.draft_revision:
        args += ["--speculative-draft-model-revision", d.draft_revision]
    return args


def _shell(words: List[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)  # a path with a space or a quote still pastes as one word


# What vLLM 0.32.0's own source says of enable_adaptive_verification (checked in the installed package): the field's
# docstring "Currently only supported for method=\"dspark\"" (vllm/config/speculative.py), its only model-runner
# wiring in the GPU Model Runner V2 (vllm/v1/worker/gpu/model_runner.py, warmup.py), and a refusal beside
# use_local_argmax_reduction for any method but dspark. The docs page (docs/features/speculative_decoding/
# adaptive_verification.md, vllm PR #52228) lists DFlash, with Model Runner V2, full CUDA graphs, no LoRA and no
# pipeline parallelism: those four are the page's, not verified here.
ADAPTIVE_CONDITIONS = ("Conditions: vLLM 0.32.0's own docstring still says enable_adaptive_verification is "
                       "\"only supported for method='dspark'\" (vllm/config/speculative.py) and wires it only in the "
                       "GPU Model Runner V2; its docs (vllm PR #52228) add DFlash with full CUDA graphs, no LoRA, no "
                       "pipeline parallelism and not with use_local_argmax_reduction: check your build before "
                       "serving it.")


def vllm_schedule_command(d: Deploy) -> str:
    """The whole ``vllm serve`` command of the schedule by load (no --speculative-config where it never speculates)."""
    spec = vllm_schedule_config(d)
    remote = ["--trust-remote-code"] if d.trust_remote_code else []
    return _shell(["vllm", "serve", d.target, *remote, *(["--speculative-config", json.dumps(spec)] if spec else [])])


DATA_PARALLEL_NOTE = ("With data parallelism (--data-parallel-size > 1) vLLM drops the schedule and serves the "
                      "static num_speculative_tokens (its warning: ranks could pick different K and deadlock; "
                      "vllm/config/vllm.py, vLLM 0.32.0): serve the fixed b above there.")


def vllm_command(d: Deploy, **kw) -> str:
    remote = ["--trust-remote-code"] if d.trust_remote_code else []
    return _shell(["vllm", "serve", d.target, *remote, "--speculative-config",
                   json.dumps(vllm_speculative_config(d, **kw))])


def sglang_command(d: Deploy, **kw) -> str:
    remote = ["--trust-remote-code"] if d.trust_remote_code else []
    return _shell(["python", "-m", "sglang.launch_server", "--model-path", d.target, *remote, *sglang_args(d, **kw)])


# ---- what it says ------------------------------------------------------------------------------------------------

def per_step_lines(d: Deploy) -> List[str]:
    """The nearest per-step setting each engine offers, and how tune's rule relates to it. Any rule form is taken
    (full, threshold:T, ema:..., a learned:... form or one added later): what is not recognised is named as is."""
    if d.step_rule is None:
        return ["No tune stage in this run folder: no per-step rule was chosen."]
    rule, bm, kind = d.rule, d.b_max, d.rule.split(":", 1)[0]
    gain = d.step_rule.get("gain")
    head = (f"Tune chose `{rule}` at b_max={bm}" + (f" (modelled {gain:+.2%} over b={d.step_rule.get('baseline_b')} "
            "on held-out label prompts)" if isinstance(gain, (int, float)) else "") + ".")
    if kind == "full":
        return [head, f"It verifies every drafted token: no per-step setting is needed; the fixed settings above at "
                f"b={bm} are the rule (`num_speculative_tokens` {bm - 1} / `--speculative-num-draft-tokens` {bm})."]
    relation = {
        "threshold": "ours verifies the longest drafted prefix whose cumulative draft top-1 probability stays >= T; "
                     "vLLM ranks slots by the same kind of running product (of its own acceptance estimates from the "
                     "draft's logits) but cuts at the budget its startup-profiled cost model picks, so T is not "
                     "settable and its cut follows load",
        "ema": "ours verifies ceil(EMA of accepted + slack) tokens per request; vLLM's cut comes from per-position "
               "acceptance estimates (its EMA smoothing key, adaptive_verification_ema_alpha, is unconfirmed in its "
               "docs) under a cost-model budget; SGLang's EMA-driven --speculative-adaptive is EAGLE-only",
    }.get(kind, f"`{rule}` has no engine counterpart; vLLM's adaptive verification is the nearest (it also verifies "
                "a per-request prefix of the block chosen from the draft's own numbers)")
    adaptive = shlex.quote(json.dumps(vllm_speculative_config(d, bm, adaptive=True)))
    return [head,
            f"vLLM, nearest: `--speculative-config {adaptive}` "
            f"(adaptive verification: a per-request prefix of the b_max block, each step). Relation: {relation}. "
            + ADAPTIVE_CONDITIONS,
            f"SGLang: no per-step verify control is documented for {SGLANG_ALGORITHM} (the nearest, "
            "`--speculative-algorithm DFLASH_CONFIDENCE` of sglang PR #36136, is unmerged and unconfirmed); deploy "
            f"the fixed b there. `--speculative-dflash-draft-window-size N` (N >= the block size) bounds the draft's "
            "context for long prompts; it does not change what is verified."]


def per_request_lines(d: Deploy) -> List[str]:
    lines = [f"The per-request policy runs once after prefill on the target's last-position logits (its folded form: "
             f"the final hidden state) and answers a b among {d.candidates}"
             + (f", or a per-step verify rule at b_max ({', '.join(d.rule_actions)})" if d.rule_actions else "")
             + ". An engine must give it that prefill output and then take a block size (and, for a rule action, a "
             "verify rule) per request for that request's decode.",
             "vLLM: `num_speculative_tokens` is one per server (`num_speculative_tokens_per_batch_size` varies it by "
             "concurrency, not by request); vLLM issue #52258 asks for per-request speculation control (cited from "
             "the issue; its thread was not found in our search index, its state is unconfirmed).",
             "SGLang: the speculative settings are server arguments; no per-request block size is documented.",
             "Until then the policy runs in this pipeline's engine (pipeline.decoding.adaptive), or in front of "
             "servers launched at different b, routing each request by its answer."]
    if d.policy_answers_fallback_only:
        lines.append(f"This run's policy has no calibrated margin: it answers b={d.train_b} for every request, so the "
                     "fixed deployment gives up nothing of it.")
    return lines


def render(d: Deploy, short: bool = False) -> str:
    """Markdown for `blockpilot deploy` (whole) and the report (``short``: the fixed b, both engines, one line
    each on the per-step rule and the policy)."""
    md = [f"Fixed b to deploy: **{d.block_size}**, chosen on {d.chosen_on}.", ""]
    if d.draft_note:
        md += [f"Note: {d.draft_note}.", ""]
    md += ["vLLM:", "", "```bash", vllm_command(d), "```", "", "SGLang:", "", "```bash", sglang_command(d), "```", ""]
    step, req = per_step_lines(d), per_request_lines(d)
    if short:
        under_load = f"Under load: {load_lines(d)[0]} " if d.schedule else ""
        if d.options is not None:
            under_load += f"vLLM deploys {d.options.chosen}: {d.options.why}. "
        md += [f"{under_load}Per-step rule: {step[0]} Per-request policy: no engine takes a block size per request yet "
               f"(`blockpilot deploy {d.run_dir}` gives the nearest settings and the details).", ""]
        return "\n".join(md)
    md += ["Under load (by concurrency):", ""] + [f"- {x}" for x in load_lines(d)] + [""]
    if d.sweep:
        md += ["The vLLM sweep (--cost-profile):", ""] + [f"- {x}" for x in sweep_lines(d)] + [""]
    if d.schedule:
        md += ["vLLM, the schedule by load (one server whose concurrency varies):", "", "```bash",
               vllm_schedule_command(d), "```", "", DATA_PARALLEL_NOTE, ""]
    md += ["vLLM, what to serve: plain, one fixed K or one schedule (or plain and speculative servers, the load "
           "routed), priced per load:", ""] + options_lines(d) + [""]
    md += ["By prompt length:", ""] + context_lines(d) + [""]
    md += ["Per-step verify rule:", ""] + [f"- {x}" for x in step] + [""]
    md += ["Per-request block size:", ""] + [f"- {x}" for x in req] + [""]
    md += ["Keys as each engine documents them (sources in pipeline/evaluation/deploy.py); "
           "`adaptive_verification_ema_alpha` (vLLM) and `DFLASH_CONFIDENCE` (SGLang) could not be confirmed in "
           "their docs and are not emitted.", ""]
    return "\n".join(md)
