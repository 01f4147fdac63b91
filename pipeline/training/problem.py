"""What one training run learns from and is measured against, decided on the driver before any worker starts: the
label set's candidates and vocabulary, the cost profile, the split, the baselines chosen on the TRAIN split (the
train-chosen fixed b, the majority class, the draft's trained B), the speed objective's target scale, and its rule
actions.

A rule action (``train.rules``, speed objective only) is a per-step verify rule at the label set's trace b_max: its
value for every label row comes from the row's per-step trace through the simulator (pipeline.policy.simulate,
exact at T = 0), without decoding again. It joins the candidates as one more column of ``tau``, holding the rule's
*equivalent* tau: committed tokens per step times cost(b_max) / the rule's modelled seconds per step, so that tau /
cost is the rule's modelled speed exactly as tau(b) / cost(b) is a fixed b's, and every speed helper (targets,
gains, the margin's calibration) reads the rule columns like the candidates."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from pipeline.io.layout import COST_PROFILE
from pipeline.io.shards import decode_metadata, list_shards
from pipeline.io.storage import location, parquet_file
from pipeline.policy.blocksize import Action, policy_actions, speed_targets
from pipeline.policy.cost import CostProfile

from .data import LABEL_COLUMN, Splits, read_splits, uses_costs


def cost_profile_path(train_cfg, labels_dir: Path) -> Path:
    """train.cost_profile, else the labelling profile beside the shards."""
    return location(train_cfg.cost_profile) if train_cfg.cost_profile else labels_dir / COST_PROFILE


def load_cost_profile(train_cfg, labels_dir: Path) -> Tuple[Optional[CostProfile], Optional[Path]]:
    """(profile, its path); (None, None) when there is none and the objective does not need one."""
    path = cost_profile_path(train_cfg, labels_dir)
    if not path.is_file():
        if train_cfg.cost_profile or uses_costs(train_cfg.objective, train_cfg.label):
            raise ValueError(f"config key 'train.cost_profile': no cost profile at {path} (objective "
                             f"{train_cfg.objective!r} needs one: run `blockpilot profile` and pass "
                             "train.cost_profile=PATH, or relabel)")
        return None, None
    return CostProfile.load(path), path


def train_chosen_index(tau_train: np.ndarray, costs: Optional[List[float]]) -> int:
    """The one fixed b a user could deploy, chosen on the train rows: the least modelled time per token (mean of
    cost / tau) under a cost profile, else the largest mean tau. Ties go to the smaller b (the first index)."""
    if costs is not None:
        return int(np.argmin((np.asarray(costs)[None, :] / tau_train).mean(axis=0)))
    return int(np.argmax(tau_train.mean(axis=0)))


def speed_scale(tau_train: np.ndarray, costs: List[float], fallback_index: int) -> float:
    """The spread of the train rows' speed targets: the MLP regresses the targets divided by it, so that the
    loss's size does not depend on the cost profile's units."""
    target = speed_targets(tau_train.astype(np.float64), np.asarray(costs), fallback_index)
    return float(max(target.std(), 1e-4))


def rule_action_columns(shards: List[Path], rules: List[str], profile: CostProfile) -> Tuple[List[Dict[str, Any]],
                                                                                            Dict[str, List[float]]]:
    """(rule actions [{"rule", "max_block_size"}], equivalent tau per prompt_id [one per rule]) from every row's
    trace; ([], {}) when the label set has no traces. A set whose rows are partly traced is refused: a rule action
    has no value on the others."""
    from pipeline.io.storage import read_table
    from pipeline.policy.simulate import pack_traces, simulate_many
    from pipeline.policy.step_rules import parse_rule
    from pipeline.policy.trace import Trace

    cols = ["prompt_id", "trace_block_size", "trace_match", "trace_confidence", "trace_stopped"]
    if not rules or any(c not in parquet_file(shards[0]).schema_arrow.names for c in cols):  # schema < v3
        return [], {}
    rows = [r for p in shards for r in read_table(p, columns=cols).to_pylist()]
    traces = [Trace.from_row(r) for r in rows]
    if all(t is None for t in traces):
        return [], {}
    if any(t is None for t in traces):
        missing = next(r["prompt_id"] for r, t in zip(rows, traces) if t is None)
        raise ValueError(f"config key 'train.rules': label row {missing} has no per-step trace, so a rule action has "
                         "no value there (relabel, or set train.rules=[])")
    b_max = traces[0].block_size
    packed, ref = pack_traces(traces), profile.cost(b_max)
    columns = []
    for rule in rules:
        sim = simulate_many(packed, parse_rule(rule))
        columns.append([sum(c) / len(c) * ref / (sum(profile.step_seconds(b_max, v) for v in ver) / len(ver))
                        for ver, c in zip(sim.verified, sim.committed)])
    by_id = {r["prompt_id"]: [float(col[i]) for col in columns] for i, r in enumerate(rows)}
    return [{"rule": rule, "max_block_size": b_max} for rule in rules], by_id


@dataclass
class Problem:
    """Everything the workers and the export need to know about the label set, beside the logits."""

    shards: List[Path]
    candidates: List[int]
    vocab_size: int
    trained_block_size: int
    splits: Splits
    fixed_index: int  # the train-chosen fixed b (also the speed policy's fallback)
    majority_index: int
    trained_index: int  # the draft's trained B among the candidates (the middle one when B is not a candidate)
    profile: Optional[CostProfile] = None
    profile_path: Optional[Path] = None
    speed: Optional[Dict[str, Any]] = None  # objective speed: {"costs", "fallback_index", "scale"}
    rule_actions: List[Dict[str, Any]] = field(default_factory=list)  # after the candidates: {"rule", "max_block_size"}
    rule_tau: Dict[str, List[float]] = field(default_factory=dict)  # prompt_id -> each rule action's equivalent tau

    @property
    def actions(self) -> List[Action]:
        """The policy's outputs in order: the candidates, then the rule actions."""
        return policy_actions(self.candidates, self.rule_actions)

    @property
    def costs(self) -> Optional[List[float]]:
        """Seconds per step at each action (the candidates, then the rule actions at cost(b_max): see the module
        docstring), under the cost profile; None without one."""
        return None if self.profile is None else [self.profile.cost(a.block_size) for a in self.actions]

    @property
    def action_names(self) -> List[str]:
        return [a.name for a in self.actions]

    @property
    def train_chosen_block_size(self) -> int:
        return self.candidates[self.fixed_index]

    @property
    def fixed_chosen_on(self) -> str:
        return ("the train split, by modelled time per token (cost profile)" if self.profile is not None else
                "the train split, by mean tau")


def load_problem(train_cfg, labels_dir: Path) -> Problem:
    """Reads the shards' metadata and small columns, the cost profile, and decides the baselines on the train split.
    A classifier on the argmax-tau label (paper, hard with label=tau, soft) ignores the costs while training; the
    modelled-speed metrics and the train-chosen fixed b still use them when a profile exists."""
    shards = list_shards(labels_dir)
    meta = decode_metadata(parquet_file(shards[0]).schema_arrow.metadata)
    candidates = [int(b) for b in meta["candidates"]]
    B = int(meta["trained_block_size"])
    profile, profile_path = load_cost_profile(train_cfg, labels_dir)
    rule_actions, rule_tau = ([], {}) if train_cfg.objective != "speed" else \
        rule_action_columns(shards, list(train_cfg.rules), profile)
    costs = None if profile is None else [profile.cost(a.block_size) for a in policy_actions(candidates, rule_actions)]
    learns_speed = uses_costs(train_cfg.objective, train_cfg.label)
    calib_frac = train_cfg.calibration_fraction if train_cfg.objective == "speed" else 0.0
    if train_cfg.tau_column not in parquet_file(shards[0]).schema_arrow.names:
        raise ValueError(f"config key 'train.tau_column': {train_cfg.tau_column!r} is not a column of "
                         f"{shards[0]} (label schema v{meta.get('schema_version')}; tau_expected needs v4)")
    splits = read_splits(shards, train_cfg.val_fraction, candidates, calib_frac, costs if learns_speed else None,
                         LABEL_COLUMN, rule_tau, train_cfg.tau_column)
    if splits.train.sum() == 0:
        raise ValueError("train.val_fraction + train.calibration_fraction leave no training rows")
    tau_train = splits.tau[splits.train]
    # The train-chosen fixed b is a block size: the rule actions never are (they are the policy's to choose).
    n_c = len(candidates)
    fixed = train_chosen_index(tau_train[:, :n_c], None if costs is None else costs[:n_c])
    speed = None
    if train_cfg.objective == "speed":
        speed = {"costs": costs, "fallback_index": fixed, "scale": speed_scale(tau_train, costs, fixed)}
    return Problem(
        shards=shards, candidates=candidates, vocab_size=int(meta["vocab_size"]), trained_block_size=B,
        splits=splits, fixed_index=fixed,
        majority_index=int(np.bincount(splits.y[splits.train], minlength=len(candidates)).argmax()),
        trained_index=candidates.index(B) if B in candidates else len(candidates) // 2,
        profile=profile, profile_path=profile_path, speed=speed, rule_actions=rule_actions, rule_tau=rule_tau)
