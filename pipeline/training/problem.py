"""What one training run learns from and is measured against, decided on the driver before any worker starts: the
label set's candidates and vocabulary, the cost profile, the split, the baselines chosen on the TRAIN split (the
train-chosen fixed b, the majority class, the draft's trained B) and the speed objective's target scale."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from pipeline.io.layout import COST_PROFILE
from pipeline.io.shards import decode_metadata, list_shards
from pipeline.io.storage import location, parquet_file
from pipeline.policy.blocksize import speed_targets
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

    @property
    def costs(self) -> Optional[List[float]]:
        """Seconds per step at each candidate, under the cost profile; None without one."""
        return None if self.profile is None else [self.profile.cost(b) for b in self.candidates]

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
    costs = None if profile is None else [profile.cost(b) for b in candidates]
    learns_speed = uses_costs(train_cfg.objective, train_cfg.label)
    calib_frac = train_cfg.calibration_fraction if train_cfg.objective == "speed" else 0.0
    splits = read_splits(shards, train_cfg.val_fraction, candidates, calib_frac, costs if learns_speed else None,
                         LABEL_COLUMN)
    if splits.train.sum() == 0:
        raise ValueError("train.val_fraction + train.calibration_fraction leave no training rows")
    tau_train = splits.tau[splits.train]
    fixed = train_chosen_index(tau_train, costs)
    speed = None
    if train_cfg.objective == "speed":
        speed = {"costs": costs, "fallback_index": fixed, "scale": speed_scale(tau_train, costs, fixed)}
    return Problem(
        shards=shards, candidates=candidates, vocab_size=int(meta["vocab_size"]), trained_block_size=B,
        splits=splits, fixed_index=fixed,
        majority_index=int(np.bincount(splits.y[splits.train], minlength=len(candidates)).argmax()),
        trained_index=candidates.index(B) if B in candidates else len(candidates) // 2,
        profile=profile, profile_path=profile_path, speed=speed)
