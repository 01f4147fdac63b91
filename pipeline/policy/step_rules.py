"""Per-step verify length: how many of the draft's b_max proposed tokens the target verifies at each step.

A block-diffusion draft proposes its whole block in one pass, and with it every position's probabilities. Verifying
a drafted token costs target time whether or not it is accepted, so a step whose draft is unsure past position j
should send only the first j tokens to the target. The rules here look only at the draft's own numbers (its top-1
probability per position) and at the lengths committed so far, never at the target's, so the verify step stays
ordinary speculative decoding on a prefix of the draft: at T = 0 the output is the target's greedy continuation,
and at T > 0 rejection sampling on the prefix (then the bonus token from the target at the cut) stays lossless.

A rule is a small frozen dataclass with ``verify_length(confidence, committed) -> k`` (1 <= k <= len(confidence),
the number of drafted tokens to verify) and ``describe()`` (a JSON-able dict, recorded with every result).
:func:`parse_rule` reads the config / CLI form, e.g. ``threshold:0.6`` or ``ema:0.5:1``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Sequence

import torch


@dataclass(frozen=True)
class Full:
    """Verify the whole block (plain DFlash at b_max): the reference the other rules are compared with."""

    name = "full"

    def verify_length(self, confidence: torch.Tensor, committed: Sequence[int]) -> int:
        return int(confidence.numel())

    def describe(self) -> Dict[str, Any]:
        return {"rule": self.name}


@dataclass(frozen=True)
class ConfidenceThreshold:
    """Verify the longest prefix whose cumulative draft confidence (the product of the top-1 probabilities, the
    draft's own estimate that the whole prefix is accepted) stays >= ``threshold``; at least ``min_tokens``."""

    threshold: float
    min_tokens: int = 1
    name = "threshold"

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")

    def verify_length(self, confidence: torch.Tensor, committed: Sequence[int]) -> int:
        n = int(confidence.numel())
        kept = int((torch.cumprod(confidence.double(), 0) >= self.threshold).sum())  # cumprod is non-increasing
        return max(min(self.min_tokens, n), min(kept, n))

    def describe(self) -> Dict[str, Any]:
        return {"rule": self.name, **asdict(self)}


@dataclass(frozen=True)
class RunningAcceptance:
    """Verify ``ceil(ema + slack)`` drafted tokens, where ``ema`` is an exponential moving average (weight ``alpha``
    on the newest step) of the drafted tokens accepted so far (committed - 1); the first step verifies the whole
    block. Ignores the draft's confidence: the baseline rule of the issue."""

    alpha: float = 0.5
    slack: float = 1.0
    name = "ema"

    def __post_init__(self):
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.slack < 0:
            raise ValueError(f"slack must be >= 0, got {self.slack}")

    def verify_length(self, confidence: torch.Tensor, committed: Sequence[int]) -> int:
        n = int(confidence.numel())
        if not committed:
            return n
        ema = float(committed[0] - 1)
        for c in committed[1:]:
            ema = self.alpha * (c - 1) + (1 - self.alpha) * ema
        return max(1, min(n, int(-(-(ema + self.slack) // 1))))

    def describe(self) -> Dict[str, Any]:
        return {"rule": self.name, **asdict(self)}


def parse_rule(text: str):
    """``full``, ``threshold:T[:MIN]``, ``ema:ALPHA[:SLACK]`` -> a rule; a bad form names itself."""
    parts = str(text).strip().split(":")
    try:
        if parts[0] == "full" and len(parts) == 1:
            return Full()
        if parts[0] == "threshold" and len(parts) in (2, 3):
            return ConfidenceThreshold(float(parts[1]), *(int(p) for p in parts[2:]))
        if parts[0] == "ema" and len(parts) in (1, 2, 3):
            return RunningAcceptance(*(float(p) for p in parts[1:]))
    except ValueError as err:
        raise ValueError(f"step rule {text!r}: {err}") from None
    raise ValueError(f"step rule {text!r}: expected full, threshold:T[:MIN_TOKENS] or ema[:ALPHA[:SLACK]]")


def draft_confidence(draft_probs, draft_logits) -> torch.Tensor:
    """[n] top-1 probability of the draft at each drafted position (from its sampling probabilities when it has
    them, else the softmax of its logits)."""
    if draft_probs is not None:
        return draft_probs[0].max(dim=-1).values.float()
    return torch.softmax(draft_logits[0].float(), dim=-1).max(dim=-1).values
