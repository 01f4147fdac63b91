"""The acceptance model's calibration on a label set's val split, the raw logistic against the recalibrated one,
and what each learned rule gains in simulation. Usage: python benchmarks/acceptance_calibration.py RUN_DIR (a run
with labels, train and tune done)."""
import json
import sys
from pathlib import Path

import numpy as np

from pipeline.evaluation.rule_search import read_traced
from pipeline.io.shards import list_shards
from pipeline.policy.acceptance import fit_acceptance, reliability
from pipeline.policy.cost import CostProfile
from pipeline.policy.simulate import pack_traces, simulate_many
from pipeline.policy.step_rules import LearnedVerify, parse_rule

run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/default")
cfg_val = 0.3
rows = read_traced(list_shards(run / "labels"), cfg_val, 0.15)
profile = CostProfile.load(run / "train/policy/cost_profile.json")
baseline = json.loads((run / "tune/step_rule.json").read_text())["baseline_b"]
val, train = rows["val"], [r.trace for r in rows["train"]]
b_max = val[0].trace.block_size
packed = pack_traces([r.trace for r in val])
base = sum(r.steps[r.candidates.index(baseline)] * profile.cost(baseline)
           + profile.first_step_seconds(baseline, r.prompt_tokens) for r in val)


def gain(rule):
    sim = simulate_many(packed, rule)
    return base / sum(profile.decode_seconds(v, b_max, rule=True, context=r.prompt_tokens)
                      for v, r in zip(sim.verified, val)) - 1


print(f"{len(train)} train traces, {len(val)} val, b_max {b_max}, baseline b={baseline}")
for name, cal in (("raw logistic", False), ("recalibrated", True)):
    m = fit_acceptance(train, calibrate=cal)
    rel = reliability(m, [r.trace for r in val])
    print(f"\n{name}: val log loss {rel['log_loss']:.4f} (base rate {rel['base_rate_log_loss']:.4f}), max gap "
          f"{rel['max_abs_gap']:.3f}, simulated gain of the learned rule {gain(LearnedVerify.from_profile(m, profile, b_max)):+.2%}")
    print("| decile | predicted | observed | slots |\n| --- | --- | --- | --- |")
    for t in rel["table"]:
        print(f"| {t['decile']} | {t['predicted']:.3f} | {t['observed']:.3f} | {t['slots']} |")
print(f"\nthreshold:0.002 {gain(parse_rule('threshold:0.002')):+.2%}")
