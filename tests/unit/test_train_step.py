"""The train loop's optimiser step (pipeline/training/loop.py: train_step) learns, for each objective, on a problem
with a known answer. (The integration run trains 4 epochs on ~12 rows of random-model labels, where whether the loss
falls is seed luck; this is where learning itself is checked.)"""

import numpy as np
import pytest
import torch

from pipeline.policy.blocksize import BlockSizeMLP, speed_targets
from pipeline.training.loop import train_step


def _problem(n=96, v=48, c=5, seed=0):
    """Logits whose first c coordinates say which candidate accepts longest: tau rises by 1.5 at that candidate."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, v)).astype(np.float32)
    best = x[:, :c].argmax(axis=1)
    tau = np.full((n, c), 3.0, dtype=np.float32)
    tau[np.arange(n), best] += 1.5
    return x, best.astype(np.int64), tau


@pytest.mark.parametrize("objective", ["speed", "paper", "soft"])
def test_train_step_fits_a_learnable_problem(objective):
    torch.manual_seed(0)
    x, y, tau = _problem()
    costs = [1.0, 1.05, 1.1, 1.15, 1.2]
    t = {"input_transform": "none", "objective": objective, "soft_temperature": 0.5}
    speed = None
    if objective == "speed":
        target = speed_targets(tau.astype(np.float64), np.asarray(costs), 2)
        speed = {"costs": costs, "fallback_index": 2, "scale": float(target.std())}
    model = BlockSizeMLP(x.shape[1], 5, hidden=64, n_layers=2, dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = [train_step(model, opt, (x, y, tau), t, speed) for _ in range(150)]
    # The least loss there is: 0, or for soft labels the cross-entropy floor, their own entropy.
    p = torch.softmax(torch.from_numpy(tau) / t["soft_temperature"], dim=-1)
    floor = float(-(p * p.log()).sum(-1).mean()) if objective == "soft" else 0.0
    assert np.isfinite(losses).all()
    assert losses[-1] - floor < 0.2 * (losses[0] - floor), (losses[0], losses[-1], floor)
    with torch.no_grad():  # and it learned the answer, not only a lower loss
        pred = model(torch.from_numpy(x)).argmax(-1).numpy()
    assert (pred == y).mean() > 0.9


def test_a_step_with_zero_learning_rate_changes_nothing():
    """The negative control: the loss only falls above because the optimiser moves the weights."""
    torch.manual_seed(0)
    x, y, tau = _problem()
    model = BlockSizeMLP(x.shape[1], 5, hidden=64, n_layers=2, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    t = {"input_transform": "none", "objective": "paper"}
    losses = [train_step(model, opt, (x, y, tau), t) for _ in range(5)]
    assert losses == pytest.approx([losses[0]] * 5)
