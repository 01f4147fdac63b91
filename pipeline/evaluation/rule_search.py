"""Tune's search for the per-step verify rule, offline on the label set's traces: nothing is decoded here.

The label rows of the train split fit the acceptance model (pipeline.policy.acceptance) that the learned rule
(pipeline.policy.step_rules.LearnedVerify) reads; every rule of the grid, the learned one included, is then
simulated (pipeline.policy.simulate, exact at T = 0) on EVERY row of the val split, beside the fixed baseline b and
the per-step oracle, and scored by modelled time under the policy's cost profile. The evaluation sets are never
read. Every row up to tune.max_rows a split; beyond, a fixed random subset of that many (:func:`read_traced`: the
traces are read into the driver).

Whether adaptive adopts the chosen rule is decided apart from the choice (:func:`cross_fitted_gain`): the best of
nine rules on the same rows is biased upwards (on 156 val rows tune adopted a rule at a simulated +0.3 % that then
lost when decoded, benchmarks/results/default-run-slow-machine.md), so the rule is adopted only when the best-rule
procedure gains on prompts its choice did not see, at a one-sided lower 5 % bound above 0.

The fixed baseline's modelled seconds come from the label row's own decode at that b (``steps`` x cost(b) plus the
first step's extra): the label set has no per-step lengths for a fixed b, so its last step (cut by max_new_tokens
or a stop token) is counted at full cost, which overstates the baseline by at most one step's verify of b - 1
tokens (a fraction of a percent at 128 tokens). Tune's decoded confirmation has no such approximation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from pipeline.io.storage import read_table
from pipeline.policy.acceptance import fit_acceptance, reliability
from pipeline.policy.blocksize import split_of
from pipeline.policy.stats import paired_bootstrap
from pipeline.policy.simulate import pack_traces, per_step_oracle, simulate_many
from pipeline.policy.step_rules import LEARNED, LearnedVerify, parse_rule
from pipeline.policy.trace import Trace

LABEL_COLUMNS = ["prompt_id", "source", "prompt_tokens", "candidates", "steps", "trace_block_size", "trace_stopped",
                 "trace_match", "trace_confidence"]
ORACLE = "oracle-per-step"


def family(rule: Optional[str]) -> Optional[str]:
    """``threshold``, ``learned``, ``ema``, ``full``: the kind of a rule string (None for a fixed b)."""
    return None if rule is None else str(rule).split(":")[0]


@dataclass
class TracedRow:
    prompt_id: str
    source: str
    prompt_tokens: int
    candidates: List[int]
    steps: List[int]
    trace: Trace


def read_traced(shards: Sequence, val_fraction: float, calibration_fraction: float,
                max_rows: Optional[int] = None) -> Dict[str, Any]:
    """The label rows with a trace, by split (``train`` holds the train and calibration splits: the acceptance model
    is not the MLP, and every row outside val is fair to fit it on), each in the shards' order, and ``counts``
    (label rows, traced rows per split, rows used per split, the cap).

    At most ``max_rows`` rows of each split (tune.max_rows; None: all): the rows of least :func:`row_rank`, a random
    subset that is the same on every run, machine and shard layout. A 1M-row label set's traces would not fit the
    driver: a first pass reads only the prompt ids and which rows have a trace, a second reads the trace columns of
    the chosen rows' shards alone and makes Python objects of the chosen rows only; shards are read READ_THREADS at
    a time (object storage is mostly waiting), so at most that many shards' tables are in memory beside the rows."""
    from concurrent.futures import ThreadPoolExecutor

    shards = list(shards)

    def ids(path):  # (label rows, the positions of those with a trace, which of them are val, their row_rank)
        t = read_table(path, columns=["prompt_id", "trace_block_size"])
        at = np.flatnonzero(t.column("trace_block_size").is_valid().to_numpy(zero_copy_only=False))
        pids = t.column("prompt_id").take(at).to_pylist()
        val = np.array([split_of(p, val_fraction, calibration_fraction) == "val" for p in pids], dtype=bool)
        return t.num_rows, at, val, np.array([row_rank(p) for p in pids], dtype=np.uint64)

    with ThreadPoolExecutor(READ_THREADS) as pool:
        sizes, at, val, ranks = zip(*pool.map(ids, shards)) if shards else ((), (), (), ())
        shard = np.repeat(np.arange(len(shards)), [len(a) for a in at])
        pos, is_val, rank = (np.concatenate([*x, np.zeros(0, dt)]) for x, dt in ((at, np.int64), (val, bool),
                                                                                  (ranks, np.uint64)))
        chosen = np.zeros(len(pos), dtype=bool)
        counts = {"label_rows": int(sum(sizes)), "traced": {}, "used": {}, "max_rows": max_rows}
        for name, want in (("train", False), ("val", True)):
            mine = np.flatnonzero(is_val == want)
            pick = mine[np.lexsort((pos[mine], shard[mine], rank[mine]))][:max_rows]
            chosen[pick] = True
            counts["traced"][name], counts["used"][name] = len(mine), len(pick)
        keep = np.split(chosen, np.cumsum([len(a) for a in at])[:-1])

        def traced(i):
            if not keep[i].any():
                return []
            t = read_table(shards[i], columns=LABEL_COLUMNS).take(at[i][keep[i]])
            return [("val" if v else "train", _row(r)) for r, v in zip(t.to_pylist(), val[i][keep[i]])]

        out: Dict[str, Any] = {"train": [], "val": [], "counts": counts}
        for got in pool.map(traced, range(len(shards))):
            for name, r in got:
                out[name].append(r)
    return out


# Shards read at once by read_traced: a few tables in memory, enough to keep object storage's latency hidden.
READ_THREADS = 8


def row_rank(prompt_id: str) -> int:
    """A prompt's place in the order read_traced keeps rows by under tune.max_rows: a hash apart from the split's
    (pipeline.policy.blocksize.split_of), so the rows kept are uniform within each split (the least split hashes of
    the non-val rows would all be calibration rows)."""
    return int.from_bytes(hashlib.sha256(f"tune-rows:{prompt_id}".encode()).digest()[:8], "big")


def _row(r: Dict[str, Any]) -> TracedRow:
    return TracedRow(r["prompt_id"], r["source"], int(r["prompt_tokens"]), list(r["candidates"]), list(r["steps"]),
                     Trace.from_row(r))


def fixed_seconds(row: TracedRow, b: int, profile) -> float:
    """A fixed b's modelled seconds on the row: its label decode's steps at cost(b); b = 1 (no speculation, the
    schedule's choice at a load where it wins) is one step per new token."""
    steps = row.trace.new_tokens if b == 1 and 1 not in row.candidates else row.steps[row.candidates.index(b)]
    return steps * profile.cost(b) + profile.first_step_seconds(b, row.prompt_tokens)


def learned_rule(model, profile, b_max: int, rows: Sequence[TracedRow], max_new_tokens: Optional[int] = None,
                 iterations: int = 20, tol: float = 1e-9) -> LearnedVerify:
    """The learned rule at the rate it reaches itself on ``rows`` (the train split's traces): Dinkelbach's
    iteration, rate <- tokens / modelled seconds of the rule at the previous rate, from the full block's rate (rate 0
    picks the largest expected gain, the whole block). The rate rises to the fixed point where no k pays more than
    its seconds at that rate; a few rounds on the default."""
    rows = [r for r in rows if r.trace.block_size == b_max]
    if not rows:
        return LearnedVerify.from_profile(model, profile, b_max)  # rate 0: the per-step ratio
    packed = pack_traces([r.trace for r in rows], max_new_tokens)
    rate = 0.0
    for _ in range(iterations):
        sim = simulate_many(packed, LearnedVerify.from_profile(model, profile, b_max, rate) if rate else
                            parse_rule("full"))
        seconds = sum(profile.decode_seconds(v, b_max, rule=True, context=r.prompt_tokens)
                      for v, r in zip(sim.verified, rows))
        new = sum(sum(c) for c in sim.committed) / seconds
        if abs(new - rate) <= tol * new:
            break
        rate = new
    return LearnedVerify.from_profile(model, profile, b_max, rate)


def search(rows: Dict[str, List[TracedRow]], rules: Sequence[str], profile, baseline_b: int,
           max_new_tokens: Optional[int] = None) -> Dict[str, Any]:
    """Fit, simulate every rule and the oracle on the val rows, choose; see the module docstring. The answer:
    ``choice`` (step_rule.json's body), ``learned`` (the LearnedVerify, or None) and ``rows`` (one per val prompt x
    method, TUNE_SCHEMA's columns)."""
    val = rows["val"]
    if not val:
        raise ValueError("tune: the label set has no val-split row with a trace (train.val_fraction is 0, or the "
                         "labels were made without traces: label schema < v3, or T > 0)")
    if baseline_b != 1 and baseline_b not in val[0].candidates:
        raise ValueError(f"tune: the baseline b={baseline_b} is not a labelled candidate {val[0].candidates}")
    b_max = val[0].trace.block_size
    learned, model_info, calib = None, None, None
    if LEARNED in rules:
        model = fit_acceptance([r.trace for r in rows["train"]])
        learned = learned_rule(model, profile, b_max, rows["train"], max_new_tokens)
        model_info, calib = dict(model.info), reliability(model, [r.trace for r in val])
        model_info["rate"] = learned.rate
    packed = pack_traces([r.trace for r in val], max_new_tokens)
    ctx = [r.prompt_tokens for r in val]
    out_rows: List[Dict[str, Any]] = []

    def add(method, b, rule, verified, committed, seconds):
        for r, v, c, s in zip(val, verified, committed, seconds):
            out_rows.append({"prompt_id": r.prompt_id, "source": r.source, "method": method, "block_size": b,
                             "step_rule": rule, "steps": len(c), "new_tokens": r.trace.new_tokens,
                             "verified": v, "committed": c, "modelled_seconds": s, "worker": "simulated"})

    base_s = [fixed_seconds(r, baseline_b, profile) for r in val]
    add(f"b={baseline_b}", baseline_b, None, [None] * len(val), [[]] * len(val), base_s)
    per: Dict[str, float] = {}
    per_prompt: Dict[str, np.ndarray] = {}
    for rule in rules:
        sim = simulate_many(packed, learned if rule == LEARNED else parse_rule(rule))
        secs = [profile.decode_seconds(v, b_max, rule=True, context=n) for v, n in zip(sim.verified, ctx)]
        add(f"{rule}@{b_max}", b_max, rule, sim.verified, sim.committed, secs)
        per[rule] = float(np.sum(secs))
        per_prompt[rule] = np.asarray(secs, dtype=np.float64)
    costs = [profile.step_seconds(b_max, k) for k in range(1, b_max)]  # what the learned rule trades against
    oracle_v = [per_step_oracle(r.trace, costs) for r in val]
    oracle_s = [profile.decode_seconds(v, b_max, rule=True, context=n) for v, n in zip(oracle_v, ctx)]
    add(f"{ORACLE}@{b_max}", b_max, ORACLE, oracle_v, [_committed(r.trace, v) for r, v in zip(val, oracle_v)],
        oracle_s)
    base, oracle = float(np.sum(base_s)), float(np.sum(oracle_s))
    tokens = sum(r.trace.new_tokens for r in val)

    def gain(seconds: float) -> float:
        return base / seconds - 1  # same tokens for every method (lossless): the ratio of time per token

    o_gain = gain(oracle)
    table = sorted([{"method": f"{rule}@{b_max}", "rule": rule, "family": family(rule), "max_block_size": b_max,
                     "modelled_time_per_token": s / tokens, "gain": gain(s),
                     "oracle_gain_captured": gain(s) / o_gain if o_gain > 0 else None, "prompts": len(val)}
                    for rule, s in per.items()], key=lambda t: t["modelled_time_per_token"])
    best = table[0]
    families = {}
    for t in table:  # sorted: the first of each family is its best
        families.setdefault(t["family"], t)
    choice = {"rule": best["rule"], "max_block_size": b_max, "gain": best["gain"], "baseline_b": baseline_b,
              "chosen_on": "held-out (val split) label prompts, simulated from their traces", "prompts": len(val),
              "families": families, "table": table,
              "per_step_oracle": {"gain": o_gain, "modelled_time_per_token": oracle / tokens,
                                  "baseline_modelled_time_per_token": base / tokens},
              "acceptance_model": model_info, "reliability": calib, "fitted_on_prompts": len(rows["train"]),
              "adoption": cross_fitted_gain(per_prompt, np.asarray(base_s, dtype=np.float64),
                                            fold_of([r.prompt_id for r in val]))}
    return {"choice": choice, "learned": learned, "rows": out_rows}


def fold_of(prompt_ids: Sequence[str]) -> np.ndarray:
    """Two folds by a hash of the prompt id: the same prompt is in the same fold on every run."""
    return np.array([hashlib.sha256(f"tune-fold:{p}".encode()).digest()[0] & 1 for p in prompt_ids], dtype=np.int8)


def cross_fitted_gain(per_prompt: Dict[str, np.ndarray], base: np.ndarray, folds: np.ndarray, reps: int = 2000,
                      seed: int = 0) -> Dict[str, Any]:
    """The gain of choosing the fastest rule, measured on prompts the choice did not see: each fold's prompts are
    scored under the rule the other fold chose (two-fold cross-fitting), so the estimate carries no winner's curse
    over the rules. ``per_prompt``: {rule: modelled seconds per prompt}; ``base``: the fixed b's. The gain is the
    ratio of summed seconds (base / chosen - 1) with its one-sided lower 5 % bound (paired bootstrap over prompts);
    ``adopt`` when that bound is above 0. {gain, lower_5, adopt, picks: {fold: rule}, prompts}."""
    n = len(base)
    if not per_prompt or min(int((folds == 0).sum()), int((folds == 1).sum())) == 0:
        return {"gain": None, "lower_5": None, "adopt": False, "picks": {}, "prompts": n}
    scored = np.empty(n, dtype=np.float64)
    picks = {}
    for f in (0, 1):
        other = folds != f
        best = min(per_prompt, key=lambda r: float(per_prompt[r][other].sum()))
        picks[str(f)] = best
        scored[folds == f] = per_prompt[best][folds == f]
    gain = float(base.sum() / scored.sum() - 1)
    lower = paired_bootstrap(lambda b, c: b / c - 1, base, scored, reps=reps, seed=seed, level=0.90)[0]
    return {"gain": gain, "lower_5": float(lower), "adopt": bool(lower > 0), "picks": picks, "prompts": n}


def _committed(trace: Trace, verified: Sequence[int]) -> List[int]:
    out, i, end = [], 0, trace.new_tokens - 1
    for k in verified:
        c = min(min(trace.match[i], k) + 1, end - i)
        out.append(c)
        i += c
    return out


def search_at_load(rows: Dict[str, List[TracedRow]], rules: Sequence[str], load, schedule: Dict[int, int],
                   max_new_tokens: Optional[int] = None) -> Dict[str, Any]:
    """tune's choice at each c > 1 of the schedule: every rule simulated on the val traces under the seconds of a
    stream at c (``load.at(c)``), against that c's train-chosen b; the learned rule's step seconds and rate are
    refitted at c (its acceptance model, fitted on the train traces, does not depend on load) and kept inline
    (``learned_model``, plain JSON). {c: {rule, max_block_size, gain, baseline_b, per_step_oracle_gain,
    learned_vs_threshold, table}}."""
    out = {}
    for c, b in sorted(schedule.items()):
        if int(c) == 1 or not rules:
            continue
        found = search(rows, rules, load.at(int(c)), int(b), max_new_tokens)
        got = found["choice"]
        fam = got["families"]
        out[str(c)] = {k: got[k] for k in ("rule", "max_block_size", "gain", "baseline_b", "adoption")}
        out[str(c)].update(
            per_step_oracle_gain=got["per_step_oracle"]["gain"],
            learned_vs_threshold=(None if not {"learned", "threshold"} <= set(fam) else
                                  (1 + fam["learned"]["gain"]) / (1 + fam["threshold"]["gain"]) - 1),
            learned_model=found["learned"].to_dict() if found["learned"] is not None else None,
            table=[{k: t[k] for k in ("rule", "gain", "oracle_gain_captured")} for t in got["table"]])
    return out


def adoption_line(a: Dict[str, Any]) -> str:
    """Whether adaptive runs the rule: the best-rule choice scored on prompts it did not see (two folds)."""
    if a.get("gain") is None:
        return "adaptive does not adopt it: too few val prompts to score the choice out of fold"
    return (f"adaptive {'adopts' if a['adopt'] else 'does not adopt'} it: the choice scored out of fold gains "
            f"{a['gain']:+.2%} (lower 5 % bound {a['lower_5']:+.2%}, {a['prompts']} prompts)")
