"""A training checkpoint's folder: the model, the optimizer and the epoch (``state.pt``) and the metric history
(``history.json``). Ray Train stores and hands back the folder (stages/train.py); resume and the export read it
here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

STATE, HISTORY = "state.pt", "history.json"


def save_state(folder: Path, model, opt, epoch: int, history: List[Dict[str, Any]]) -> None:
    """The unwrapped model's weights (not DistributedDataParallel's ``module.`` names), so that any process loads
    them."""
    raw = model.module if hasattr(model, "module") else model
    # A ridge fit has no optimiser (opt None): its state is the weights alone.
    torch.save({"model": raw.state_dict(), "optimizer": {} if opt is None else opt.state_dict(), "epoch": epoch},
               Path(folder) / STATE)
    (Path(folder) / HISTORY).write_text(json.dumps(history))


def load_state(folder: Path) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """(state, history). weights_only: our own file, loaded the safe way all the same."""
    state = torch.load(Path(folder) / STATE, weights_only=True)
    return state, json.loads((Path(folder) / HISTORY).read_text())


def restore(folder: Path, model, opt) -> Tuple[int, List[Dict[str, Any]]]:
    """Loads the checkpoint into ``model`` and ``opt``; returns (the first epoch still to run, the history so far)."""
    state, history = load_state(folder)
    model.load_state_dict(state["model"])
    if opt is not None:
        opt.load_state_dict(state["optimizer"])
    return int(state["epoch"]) + 1, history


def storage(train_dir) -> Dict[str, Any]:
    """Ray Train's checkpoint storage (RunConfig's storage_path and storage_filesystem): the train folder itself, on
    disk or in object storage (through the same filesystem client as the other stages, so an S3-compatible endpoint
    set in the environment applies to both)."""
    from pipeline.io.storage import arrow_filesystem, is_remote

    if not is_remote(train_dir):
        return {"storage_path": str(train_dir)}
    fs, path = arrow_filesystem(train_dir)
    return {"storage_path": path, "storage_filesystem": fs}
