"""The train loop in named pieces (torchtitan style): the loss and optimiser step, an epoch, the val metrics, and
the epoch loop that reports through a callable (stages/train.py passes Ray Train's report with a checkpoint)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from pipeline.policy.blocksize import choice_metrics, speed_targets, transform_inputs

from .analysis import val_speed_metrics
from .data import Batch, SplitData

# report(epoch, metrics of that epoch, the whole history so far)
Report = Callable[[int, Dict[str, Any], List[Dict[str, Any]]], None]


def loss(model, batch: Batch, t: Dict[str, Any], speed: Optional[Dict[str, Any]] = None) -> torch.Tensor:
    """The batch's loss under ``t["objective"]``. speed: mean squared error of every candidate's predicted log speed
    ratio over the fallback (tau / cost, divided by ``speed["scale"]``), not only the argmax's; soft: cross-entropy
    on the softmax of tau; otherwise cross-entropy on the label index."""
    x, y, tau = batch
    out = model(transform_inputs(torch.from_numpy(x), t["input_transform"]))
    if t["objective"] == "speed":
        target = speed_targets(tau.astype(np.float64), np.asarray(speed["costs"]), speed["fallback_index"])
        return torch.nn.functional.mse_loss(out, torch.from_numpy(target / speed["scale"]).float())
    if t["objective"] == "soft":
        target = torch.softmax(torch.from_numpy(tau) / t["soft_temperature"], dim=-1)
        return -(target * torch.log_softmax(out, dim=-1)).sum(-1).mean()
    return torch.nn.functional.cross_entropy(out, torch.from_numpy(y))


def train_step(model, opt, batch: Batch, t: Dict[str, Any], speed: Optional[Dict[str, Any]] = None) -> float:
    """One optimiser step; returns the batch's loss."""
    value = loss(model, batch, t, speed)
    opt.zero_grad()
    value.backward()
    opt.step()
    return float(value.detach())


def train_epoch(model, opt, data: SplitData, epoch: int, t: Dict[str, Any],
                speed: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    model.train()
    total, seen = 0.0, 0
    for batch in data.epoch(epoch):
        total += train_step(model, opt, batch, t, speed) * len(batch[1])
        seen += len(batch[1])
    return {"epoch": epoch, "train_loss": total / max(1, seen)}


def validate(model, data: SplitData, epoch: int, config: Dict[str, Any]) -> Dict[str, Any]:
    """The policy's choices on the val split against the baselines (``val_*`` metrics); empty without val rows."""
    model.eval()
    scores, ys, taus = [], [], []
    with torch.no_grad():
        for x, y, tau in data.epoch(epoch):
            scores.append(model(transform_inputs(torch.from_numpy(x), config["train"]["input_transform"])))
            ys.append(y)
            taus.append(tau)
    if not ys:
        return {}
    scores, tau = torch.cat(scores), np.concatenate(taus)
    vm = choice_metrics(scores, np.concatenate(ys), tau, config["fixed_index"], config["trained_index"])
    if config.get("costs") is not None:
        vm.update(val_speed_metrics(tau, np.asarray(config["costs"]), scores.argmax(dim=-1).numpy(),
                                    config["fixed_index"]))
    return {f"val_{k}": v for k, v in vm.items()}


def reports_at(epoch: int, epochs: int, every: int) -> bool:
    """Every ``every`` epochs and at the last: a report carries a checkpoint, and costs about the same whatever the
    model (benchmarks/results/train-report-cost.md), so not every epoch."""
    return (epoch + 1) % every == 0 or epoch + 1 == epochs


def fit(model, opt, train_data: SplitData, val_data: SplitData, config: Dict[str, Any], start_epoch: int,
        history: List[Dict[str, Any]], report: Report) -> List[Dict[str, Any]]:
    """Epochs ``start_epoch`` .. train.epochs - 1: train, validate, and report where :func:`reports_at` says.
    Returns the whole history (the restored one and this run's epochs)."""
    t = config["train"]
    every = max(1, int(t.get("checkpoint_every", 1)))
    for epoch in range(start_epoch, t["epochs"]):
        metrics = train_epoch(model, opt, train_data, epoch, t, config.get("speed"))
        metrics.update(validate(model, val_data, epoch, config))
        history.append(metrics)
        if reports_at(epoch, t["epochs"], every):
            report(epoch, metrics, history)
    return history
