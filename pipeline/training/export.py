"""The trained policy's export: the last checkpoint's model, its metadata (policy.json, read back by
:class:`pipeline.policy.blocksize.BlockSizePolicy`) and the cost profile it was trained with, beside it.

The metadata names the train-chosen fixed b as ``fallback_block_size`` for every objective
(:func:`pipeline.policy.blocksize.train_chosen_block_size` reads it); only a speed policy (``score`` =
log_speed_ratio) answers it as its fallback. ``best_fixed_block_size`` repeats it for the readers that still use
that name (evaluate's comparisons).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from pipeline.io.layout import COST_PROFILE
from pipeline.policy.blocksize import SPEED_SCORE, BlockSizePolicy, policy_model

from .analysis import held_out
from .data import read_logits
from .problem import Problem


@dataclass
class ExportInput:
    """What the export needs: the run's problem and settings, and the last checkpoint's state and history."""

    problem: Problem
    train: Any  # the train config (pipeline.runtime.config.TrainConfig)
    state: Dict[str, Any]  # checkpoint.load_state's: model, optimizer, epoch
    history: List[Dict[str, Any]]
    label_dataset_fingerprint: str  # the label set's manifest sha256

    @property
    def epochs(self) -> int:
        return int(self.state["epoch"]) + 1


def model_of(inp: ExportInput):
    t, p = inp.train, inp.problem
    arch = {"kind": "linear"} if t.model == "ridge" else {"hidden": t.hidden, "n_layers": t.n_layers,
                                                           "dropout": t.dropout}
    model = policy_model(arch, p.vocab_size, len(p.action_names))
    model.load_state_dict(inp.state["model"])
    return model.eval()


def policy_metadata(inp: ExportInput, held: Dict[str, Any]) -> Dict[str, Any]:
    """policy.json's info; ``held`` the held-out analyses (a speed policy's margin and calibration), else {}."""
    p, t = inp.problem, inp.train
    b = p.train_chosen_block_size
    info: Dict[str, Any] = {
        "label_dataset_fingerprint": inp.label_dataset_fingerprint, "label": t.label, "objective": t.objective,
        "epochs": inp.epochs, "final_metrics": inp.history[-1], "fallback_block_size": b,
        "best_fixed_block_size": b, "trained_block_size": p.trained_block_size,
        "best_fixed_chosen_on": p.fixed_chosen_on}
    if p.profile is not None:
        info["cost_profile"] = {"file": COST_PROFILE, "source": str(p.profile_path),
                                "seconds": {str(c): p.profile.cost(c) for c in p.candidates},
                                "device": p.profile.meta.get("device"), "hardware": p.profile.meta.get("hardware")}
    if p.profile is not None and p.profile.meta.get("load"):
        info.update(load_choices(p))
    if p.speed is not None:
        info.update(score=SPEED_SCORE, score_scale=p.speed["scale"], margin=held["calibration"]["margin"],
                    calibration=held["calibration"], model=t.model, rule_actions=p.rule_actions)
    else:
        info["score"] = "class_logits"
    return info


def load_choices(p: Problem) -> Dict[str, Any]:
    """policy.json's choices under load (a version-3 cost profile): ``schedule`` {c: b*(c)}, each c's train-chosen b
    (pipeline.policy.load_cost.schedule, on the train rows), and ``load`` {c: {block_size, score_shift, seconds}}:
    what :meth:`BlockSizePolicy.at_load` shifts each block-size action's score by at c, log(cost(b, 1) /
    cost(b, c)) in score units (the speed targets are log tau - log cost, and at T = 0 tau does not depend on load),
    and the modelled seconds per batched step at each candidate."""
    from pipeline.policy.load_cost import LoadCost, schedule

    load = LoadCost.from_profile(p.profile)
    n_c = len(p.candidates)
    sched = schedule(p.splits.tau[p.splits.train][:, :n_c], p.candidates, load, load.concurrency,
                     p.splits.train_widths)
    scale = float(p.speed["scale"]) if p.speed is not None else 1.0
    out = {}
    for c in load.concurrency:
        shift = [float(np.log(load.cost(b, 1) / load.cost(b, c)) / scale) for b in p.candidates]
        out[str(c)] = {"block_size": sched[c], "score_shift": shift + [None] * (len(p.action_names) - n_c),
                       "seconds": {str(b): load.cost(b, c) for b in p.candidates}}
    return {"schedule": {str(c): b for c, b in sched.items()}, "load": out}


def export_policy(inp: ExportInput, policy_dir: Path) -> Dict[str, Any]:
    """Writes the policy (and its cost profile, what evaluate's modelled speedups use) to ``policy_dir``; returns the
    held-out analyses (empty but for a speed policy)."""
    p, t = inp.problem, inp.train
    model = model_of(inp)
    held: Dict[str, Any] = {}
    if p.speed is not None:
        held = held_out(model, t.input_transform, read_logits(p.shards), p.splits, np.asarray(p.costs),
                        p.fixed_index, p.speed["scale"], len(p.candidates),
                        calibration=inp.history[-1].get("ridge_calibration") if t.model == "ridge" else None)
    policy = BlockSizePolicy(model, p.candidates, p.vocab_size, t.input_transform, policy_metadata(inp, held))
    policy.save_pretrained(policy_dir)
    if p.profile is not None:
        p.profile.save(policy_dir / COST_PROFILE)
    return held
