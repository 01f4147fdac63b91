"""train's curves (``curves.png``): the train loss, the val accuracy and the val mean tau of the chosen b per epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from pipeline.io.storage import savefig


def plot_curves(history: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = [h["epoch"] + 1 for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(ep, [h["train_loss"] for h in history])
    axes[0].set(title="train loss", xlabel="epoch")
    for key in ("val_accuracy", "val_top2_accuracy"):
        if key in history[0]:
            axes[1].plot(ep, [h[key] for h in history], label=key[4:])
    axes[1].set(title="val accuracy", xlabel="epoch")
    axes[1].legend()
    for key in ("val_tau_policy", "val_tau_best_fixed", "val_tau_trained_b", "val_tau_oracle"):
        if key in history[0]:
            axes[2].plot(ep, [h[key] for h in history], label=key[8:])
    axes[2].set(title="val mean tau of the chosen b", xlabel="epoch")
    axes[2].legend()
    fig.tight_layout()
    savefig(fig, path, dpi=90)
    plt.close(fig)
