"""The two labels of a prompt, from its measured tau(b) at the candidates: one definition each.

* the paper's label: argmax over candidates of tau(b);
* the speed label: argmax over candidates of tau(b) / cost(b), cost(b) the modelled seconds of one verify step at
  b (pipeline.policy.cost), i.e. the candidate that commits the most tokens per second.

Ties go to the smaller block size (candidates are ascending). Both work on one prompt (sequences) or on many
(numpy arrays [N, |C|], one row per prompt).
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

Values = Union[Sequence[float], np.ndarray]


def tau_label(tau: Values) -> Union[int, np.ndarray]:
    """The BlockPilot paper's label: the index of the largest tau (per row for [N, |C|])."""
    tau = np.asarray(tau, dtype=np.float64)
    return int(np.argmax(tau)) if tau.ndim == 1 else np.argmax(tau, axis=-1)  # np.argmax: first of ties


def speed(tau: Values, step_cost: Values) -> np.ndarray:
    """tau(b) / cost(b): committed tokens per modelled second at each candidate (per row for [N, |C|])."""
    return np.asarray(tau, dtype=np.float64) / np.asarray(step_cost, dtype=np.float64)


def speed_label(tau: Values, step_cost: Values) -> Union[int, np.ndarray]:
    """The cost-aware label: the index of the largest tau(b) / cost(b), ``step_cost`` aligned with the candidates."""
    return tau_label(speed(tau, step_cost))
