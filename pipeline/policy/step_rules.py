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
from functools import cached_property
from typing import Any, Dict, Sequence, Tuple

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


@dataclass(frozen=True)
class LearnedVerify:
    """Verify the k that maximises a step's expected committed tokens net of its modelled seconds at the decode's
    own rate: argmax_k (1 + S_1 + ... + S_k) - rate x step_seconds[k - 1], where S_j is the acceptance model's
    survival of the first j drafted slots (pipeline.policy.acceptance, fitted on the label set's traces),
    ``step_seconds[k - 1]`` the cost profile's step at this b_max verifying k drafted tokens
    (pipeline.policy.cost.CostProfile.step_seconds: the draft's pass, the rule's own work, the verify) and ``rate``
    the tokens per second the rule itself reaches on the train traces (tune finds it by Dinkelbach's iteration:
    pipeline.evaluation.rule_search.learned_rule). That maximises tokens per second over the whole decode (a
    renewal-reward argument: a step is worth its tokens less what its seconds would have earned at that rate);
    the greedy per-step ratio (1 + S_1 + ... + S_k) / step_seconds[k - 1], what ``rate`` = 0 keeps (format version
    1), verifies slots a long decode cannot afford on an unsure step and cuts too early on a sure one. Ties go to
    the smaller k. Reads only the draft's confidences and the accepted count of the previous step, so it stays
    exact like every rule here."""

    model: Any  # pipeline.policy.acceptance.AcceptanceModel
    step_seconds: Tuple[float, ...]
    rate: float = 0.0  # tokens per second; 0 = the per-step ratio (version 1)
    name = "learned"

    def __post_init__(self):
        if not self.step_seconds or min(self.step_seconds) <= 0:
            raise ValueError(f"a learned rule needs positive step seconds for k = 1..b_max - 1, got "
                             f"{list(self.step_seconds)}")

    @classmethod
    def from_profile(cls, model, profile, block_size: int, rate: float = 0.0) -> "LearnedVerify":
        return cls(model, tuple(float(profile.step_seconds(block_size, k)) for k in range(1, block_size)), float(rate))

    def _value(self, expected, seconds):
        """What argmax picks k by (elementwise, the same in :meth:`lengths` and :meth:`verify_length`)."""
        return expected - self.rate * seconds if self.rate > 0 else expected / seconds

    def lengths(self, conf, width, prev):
        """k for L steps at once (numpy: ``conf`` [L, W] zero-padded, ``width`` [L] drafted slots, ``prev`` [L]
        the previous step's accepted count or -1): what pipeline.policy.simulate runs in lockstep, and
        :meth:`verify_length` on one step, so that both make the same float64 arithmetic."""
        import numpy as np

        conf = np.asarray(conf, dtype=np.float64)
        W = conf.shape[1]
        if W > len(self.step_seconds):
            raise ValueError(f"a block of {W} drafted slots, the rule was built for b_max {len(self.step_seconds) + 1}")
        gain = self._value(self.model.expected_committed(conf, np.asarray(prev), np.asarray(width)),
                           self._seconds[None, :W])
        gain[np.arange(W)[None, :] >= np.asarray(width)[:, None]] = -np.inf
        return gain.argmax(axis=1) + 1

    @cached_property
    def _seconds(self):
        import numpy as np

        return np.asarray(self.step_seconds, dtype=np.float64)

    def verify_length(self, confidence: torch.Tensor, committed: Sequence[int]) -> int:
        """One step: :meth:`lengths`' arithmetic, op for op, on one row: a rule runs once per decode step, and the
        batched form's masks cost several times the arithmetic (benchmarks/results/learned-rule-cost.md)."""
        import numpy as np

        from pipeline.policy.acceptance import _FLOOR

        c = confidence.double().cpu().numpy()
        W = c.shape[0]
        a, b, by_pos, p_w, p_first, p_c = self.model._folded(W)
        prev = committed[-1] - 1 if committed else -1
        logc = np.log(np.maximum(c, _FLOOR))
        z = a * logc + b * np.cumsum(logc) + by_pos + ((p_first if prev < 0 else p_w * float(max(prev, 0))) + p_c)
        e = 1.0 + np.cumsum(np.cumprod(self.model.calibrate(1.0 / (1.0 + np.exp(-z)))))
        return int(self._value(e, self._seconds[:W]).argmax()) + 1

    def describe(self) -> Dict[str, Any]:
        return {"rule": self.name, "block_size": len(self.step_seconds) + 1, "rate": self.rate}

    def to_dict(self) -> Dict[str, Any]:
        """``verify_model.json``: the acceptance model, the step seconds and the rate, plain JSON (version 2; a
        version-1 file has no rate and reads as the per-step ratio)."""
        return {"format": LEARNED_FORMAT, "version": 2, "rule": self.name, "block_size": len(self.step_seconds) + 1,
                "step_seconds": list(self.step_seconds), "rate": self.rate, "acceptance_model": self.model.to_dict()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "LearnedVerify":
        from pipeline.policy.acceptance import AcceptanceModel

        if d.get("format") != LEARNED_FORMAT:
            raise ValueError(f"not a learned verify rule (format {d.get('format')!r}, expected {LEARNED_FORMAT!r})")
        if int(d.get("version", 1)) > 2:
            raise ValueError(f"learned verify rule version {d['version']} is newer than this reader (2)")
        return cls(AcceptanceModel.from_dict(d["acceptance_model"]), tuple(map(float, d["step_seconds"])),
                   float(d.get("rate", 0.0)))


LEARNED = LearnedVerify.name
LEARNED_FORMAT = "blockpilot.learned_verify"


def parse_rule(text: str):
    """``full``, ``threshold:T[:MIN]``, ``ema:ALPHA[:SLACK]`` -> a rule; a bad form names itself. ``learned`` is
    fitted, not parsed: :func:`load_rule`."""
    parts = str(text).strip().split(":")
    if parts == [LEARNED]:
        raise ValueError("the learned rule is fitted by blockpilot tune and read from its verify_model.json "
                         "(pipeline.policy.step_rules.load_rule)")
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


def load_rule(text: str, folder=None):
    """A rule by name: :func:`parse_rule`'s forms, or ``learned`` from ``folder``/verify_model.json (tune's folder;
    plain JSON, never pickle)."""
    import json

    from pipeline.io.layout import VERIFY_MODEL
    from pipeline.io.storage import location

    if str(text).strip() != LEARNED:
        return parse_rule(text)
    if folder is None:
        raise ValueError("the learned rule needs the folder of its verify_model.json (tune's)")
    return LearnedVerify.from_dict(json.loads((location(folder) / VERIFY_MODEL).read_text()))


def draft_confidence(draft_probs, draft_logits) -> torch.Tensor:
    """[n] top-1 probability of the draft at each drafted position (from its sampling probabilities when it has
    them, else the softmax of its logits)."""
    if draft_probs is not None:
        return draft_probs[0].max(dim=-1).values.float()
    return torch.softmax(draft_logits[0].float(), dim=-1).max(dim=-1).values
