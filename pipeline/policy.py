"""The BlockPilot policy: an MLP from the target's raw last-position prefill logits to a block size.

Linear(V, hidden) -> ReLU -> Dropout, then (n_layers - 1) x [Linear(hidden, hidden) -> ReLU -> Dropout, residual],
then Linear(hidden, |C|). Kaiming init for the hidden layers, Xavier for the output layer, zero biases.
Exported as ``model.safetensors`` + ``policy.json``; loaded with :meth:`BlockSizePolicy.from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

TRANSFORMS = ("none", "softmax", "log_softmax", "standardize")


class BlockSizeMLP(nn.Module):
    def __init__(self, vocab_size: int, num_classes: int, hidden: int = 2048, n_layers: int = 2,
                 dropout: float = 0.2):
        super().__init__()
        self.input = nn.Linear(vocab_size, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(n_layers - 1))
        self.output = nn.Linear(hidden, num_classes)
        self.dropout = nn.Dropout(dropout)
        for layer in [self.input, *self.blocks]:
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        nn.init.xavier_uniform_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(F.relu(self.input(x)))
        for layer in self.blocks:
            h = h + self.dropout(F.relu(layer(h)))
        return self.output(h)


def transform_inputs(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The ablation's input transforms; the paper's best (and our default) is the raw logits ("none")."""
    x = x.float()
    if kind == "none":
        return x
    if kind == "softmax":
        return torch.softmax(x, dim=-1)
    if kind == "log_softmax":
        return torch.log_softmax(x, dim=-1)
    if kind == "standardize":  # per row, so nothing needs to be stored with the policy
        return (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True).clamp_min(1e-6)
    raise ValueError(f"unknown input_transform {kind!r}; expected one of {', '.join(TRANSFORMS)}")


class BlockSizePolicy:
    """A trained policy: ``choose(logits) -> block size``."""

    def __init__(self, model: BlockSizeMLP, candidates: Sequence[int], vocab_size: int, input_transform: str = "none",
                 info: Optional[Dict[str, Any]] = None):
        self.model = model.eval()
        self.candidates = [int(b) for b in candidates]
        self.vocab_size = int(vocab_size)
        self.input_transform = input_transform
        self.info = dict(info or {})

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _check(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"policy expects logits over a vocabulary of {self.vocab_size}, got "
                             f"{logits.shape[-1]} (was it trained for another target?)")
        return logits

    @torch.inference_mode()
    def scores(self, logits: Union[torch.Tensor, np.ndarray]) -> torch.Tensor:
        x = torch.as_tensor(logits)
        x = self._check(x if x.dim() == 2 else x.reshape(1, -1))
        return self.model(transform_inputs(x.to(self.device), self.input_transform))

    def choose(self, logits: Union[torch.Tensor, np.ndarray]) -> int:
        """The block size for one prompt, from its raw last-position prefill logits [V]."""
        return self.candidates[int(self.scores(logits)[0].argmax())]

    def choose_batch(self, logits) -> List[int]:
        return [self.candidates[i] for i in self.scores(logits).argmax(dim=-1).tolist()]

    def save_pretrained(self, folder: Union[str, Path]) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()},
                  str(folder / "model.safetensors"))
        arch = {"hidden": self.model.input.out_features, "n_layers": 1 + len(self.model.blocks),
                "dropout": self.model.dropout.p}
        meta = {"candidates": self.candidates, "vocab_size": self.vocab_size,
                "input_transform": self.input_transform, "architecture": arch, **self.info}
        (folder / "policy.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")

    @classmethod
    def from_pretrained(cls, folder: Union[str, Path], device: Union[str, torch.device] = "cpu") -> "BlockSizePolicy":
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / "policy.json").is_file() or not (folder / "model.safetensors").is_file():
            raise FileNotFoundError(f"{folder} is not an exported policy (needs policy.json and model.safetensors)")
        meta = json.loads((folder / "policy.json").read_text())
        arch = meta.get("architecture", {})
        model = BlockSizeMLP(meta["vocab_size"], len(meta["candidates"]), **arch)
        model.load_state_dict(load_file(str(folder / "model.safetensors")))
        info = {k: v for k, v in meta.items() if k not in ("candidates", "vocab_size", "input_transform", "architecture")}
        return cls(model.to(device), meta["candidates"], meta["vocab_size"], meta.get("input_transform", "none"), info)


def is_val(prompt_id: str, val_fraction: float) -> bool:
    """Deterministic train/val split by a hash of prompt_id (stable across runs, machines and shard layouts)."""
    import hashlib

    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


def choice_metrics(scores: torch.Tensor, label_index: np.ndarray, tau: np.ndarray, fixed_index: int,
                   trained_index: int) -> Dict[str, float]:
    """How good the policy's choices are: accuracy, top-2 accuracy, and the mean tau it buys vs baselines.

    tau: [N, |C|] measured tau per candidate. fixed_index: the single best fixed candidate (chosen on the TRAIN
    split); trained_index: the draft's trained B. regret = oracle - policy.
    """
    n = len(label_index)
    if n == 0:
        return {}
    pred = scores.argmax(dim=-1).cpu().numpy()
    top2 = scores.topk(min(2, scores.shape[-1]), dim=-1).indices.cpu().numpy()
    rows = np.arange(n)
    tau_policy = float(tau[rows, pred].mean())
    tau_oracle = float(tau.max(axis=1).mean())
    return {
        "accuracy": float((pred == label_index).mean()),
        "top2_accuracy": float((top2 == label_index[:, None]).any(axis=1).mean()),
        "tau_policy": tau_policy, "tau_trained_b": float(tau[:, trained_index].mean()),
        "tau_best_fixed": float(tau[:, fixed_index].mean()), "tau_oracle": tau_oracle,
        "regret": tau_oracle - tau_policy,
    }
