"""Adaptive decoding: prefill -> policy.choose_action(logits) -> decode the whole request with the chosen action.

Two levels of adaptation, each chosen on the label set, never on evaluation prompts:
* per request, the policy (pipeline/policy/blocksize.py) picks an action from the prefill: a block size b, or (a
  policy trained with ``train.rules``) a per-step rule at b_max; a speed policy answers its fallback b unless it
  predicts a gain above its calibrated margin;
* per step, a verify rule (pipeline/policy/step_rules.py, chosen by ``blockpilot tune`` on held-out label prompts) can
  replace that fallback: the draft proposes b_max tokens and the rule sends the target only a prefix. When the
  policy answers its fallback b, the decoder runs the rule instead, if tune measured it faster than the fallback b
  on prompts its choice did not see (:func:`adopted_gain`); the policy then deviates only where it predicts more
  than the rule's gain.

Ray-free; the evaluate stage's actors use it and so can a serving loop or a notebook.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, Optional

import torch

from pipeline.decoding.engine import DecodeResult, Engine, PrefillState
from pipeline.policy.blocksize import BlockSizePolicy
from pipeline.policy.step_rules import load_rule, parse_rule


@dataclass(frozen=True)
class RuleFallback:
    """A per-step verify rule at b_max that replaces the policy's fallback b (``tune/step_rule.json``)."""

    rule: str  # pipeline.policy.step_rules.load_rule form, e.g. "threshold:0.01" or "learned"
    max_block_size: int
    gain: float  # modelled gain over plain decoding at the fallback b, measured on held-out label prompts
    folder: Optional[str] = None  # tune's folder: where the learned rule's verify_model.json lies

    @classmethod
    def from_tune(cls, choice: Dict[str, Any], folder=None) -> Optional["RuleFallback"]:
        """From tune's step_rule.json (in ``folder``); None when the rule did not beat the fixed b there (it would
        only slow down)."""
        gain = adopted_gain(choice)
        where = None if folder is None else str(folder)
        return None if gain is None else cls(choice["rule"], int(choice["max_block_size"]), gain, where)

    @property
    def min_gain(self) -> float:
        """The log speed ratio over the fallback b that a policy choice must beat to be worth leaving the rule."""
        return math.log1p(self.gain)

    def step_rule(self):
        return self._rule

    @cached_property
    def _rule(self):
        """Loaded once (the learned rule reads a file); cached_property writes the instance dict, which a frozen
        dataclass allows."""
        return load_rule(self.rule, self.folder)


def adopted_gain(choice: Dict[str, Any]) -> Optional[float]:
    """The gain of tune's rule (step_rule.json's body, or its line at a load c) when adaptive adopts it, else None:
    its cross-fitted gain when that is above 0 at its lower 5 % bound (pipeline.evaluation.rule_search
    .cross_fitted_gain); a file written before that check (no ``adoption``) by its point gain above 0."""
    adoption = choice.get("adoption")
    if adoption is not None:
        return float(adoption["gain"]) if adoption["adopt"] else None
    gain = float(choice.get("gain") or 0.0)
    return gain if gain > 0 else None


@dataclass
class AdaptiveResult:
    block_size: int  # what was decoded: the policy's b, or a rule's b_max (the policy's rule action, or tune's)
    policy_seconds: float  # the MLP's latency, to compare with the prefill's
    prefill_seconds: float
    decode: DecodeResult
    policy_block_size: int = 0  # the policy's answer (its fallback b when it did not deviate; a rule action's b_max)
    step_rule: Optional[str] = None  # the rule decoded with, or None (every step verifies the whole block)
    policy_action: str = ""  # the policy's answer by name: "b=8", "threshold:0.01@10" (Action.name)


class AdaptiveDecoder:
    def __init__(self, engine: Engine, policy: BlockSizePolicy, rule_fallback: Optional[RuleFallback] = None):
        self.engine = engine
        self.policy = policy
        # A rule replaces only a speed policy's fallback b; a classifier (objective paper/hard/soft) has none.
        self.rule_fallback = rule_fallback if policy.fallback_block_size is not None else None
        if policy.device != engine.device:
            policy.model.to(engine.device)

    def choose(self, state: PrefillState) -> tuple:
        """(the policy's action, its latency in seconds)."""
        t0 = self.engine.now()
        # A folded policy reads the final hidden state (H values), the plain one the logits (V values).
        min_gain = self.rule_fallback.min_gain if self.rule_fallback else 0.0
        a = self.policy.choose_action(state.hidden if self.policy.reads_hidden else state.logits, min_gain=min_gain)
        return a, self.engine.now() - t0

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: Optional[int] = 0, state: Optional[PrefillState] = None) -> AdaptiveResult:
        """One request; pass ``state`` to reuse a prefill already made for the same prompt."""
        state = state if state is not None else self.engine.prefill(input_ids)
        a, policy_seconds = self.choose(state)
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        rf, b = self.rule_fallback, a.block_size
        if a.rule is not None:  # the policy's own rule action
            res = self.engine.decode(state, block_size=b, step_rule=parse_rule(a.rule), **kw)
            return AdaptiveResult(b, policy_seconds, state.prefill_seconds, res, b, a.rule, a.name)
        if rf is not None and b == self.policy.fallback_block_size:
            res = self.engine.decode(state, block_size=rf.max_block_size, step_rule=rf.step_rule(), **kw)
            return AdaptiveResult(rf.max_block_size, policy_seconds, state.prefill_seconds, res, b, rf.rule, a.name)
        res = self.engine.decode(state, block_size=b, **kw)
        return AdaptiveResult(b, policy_seconds, state.prefill_seconds, res, b, None, a.name)
