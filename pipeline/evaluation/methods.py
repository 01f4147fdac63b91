"""What evaluate compares, per prompt, all from one shared prefill:

* ``AR``: b = 1, plain autoregressive decoding (the speedup reference);
* ``b=N``: each fixed block size (default: the paper's DFlash(4/8/16/32) scaled to B, i.e. {B/4, B/2, B, 2B},
  plus every candidate in C);
* ``adaptive``: the product's adaptive decoder (pipeline.decoding.adaptive): the policy's choice from the prefill
  logits (its latency is measured and recorded), whose fallback b is replaced by the per-step rule ``blockpilot
  tune`` chose on held-out label prompts when it gained there out of fold (pipeline.decoding.adaptive.adopted_gain);
* with a tuned rule, its two parts apart: ``policy`` (the policy alone, every step verifying the whole block) and
  ``per-step`` (the rule alone at its b_max); beside it ``threshold`` and ``learned``, tune's best rule of each of
  those families where it is not the tuned rule (the learned rule against the threshold rule);
* ``oracle``: the candidate this prompt's own label names, read from the fixed-b decodes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from pipeline.policy.labels import speed_label, tau_label

PER_STEP, POLICY_ONLY = "per-step", "policy"


def default_fixed_block_sizes(B: int, candidates: List[int]) -> List[int]:
    """The paper compares DFlash at b = 4, 8, 16, 32 with B = 16: {B/4, B/2, B, 2B}, plus every candidate."""
    scaled = {max(2, B // 4), max(2, B // 2), B, 2 * B}
    return sorted(scaled | set(candidates))


def fixed_block_sizes(configured: Optional[Sequence[int]], B: int, candidates: List[int]) -> List[int]:
    """evaluate.fixed_block_sizes resolved: None = the paper's set and every candidate (:func:`default_fixed_block_sizes`),
    a list = those and every candidate (decoded anyway: the oracle reads them), so [] = the candidates alone."""
    if configured is None:
        return default_fixed_block_sizes(B, candidates)
    return sorted({int(b) for b in configured} | {int(b) for b in candidates})


def methods_for(fixed: List[int], per_step: bool = False, rule_families: Sequence[str] = ()) -> List[str]:
    return ["AR", *[f"b={b}" for b in fixed], "adaptive", *([POLICY_ONLY, PER_STEP, *rule_families] if per_step else []),
            "oracle"]


def rule_methods(step_rule: Optional[Dict[str, Any]]) -> Dict[str, str]:
    """{method: rule} of the per-step rules evaluate decodes apart, from tune's step_rule.json: ``per-step`` (tune's
    choice) and, beside it, tune's best rule of the threshold and learned families where that is another rule
    (method = the family); {} without one."""
    if step_rule is None:
        return {}
    out = {PER_STEP: step_rule["rule"]}
    for fam, line in (step_rule.get("families") or {}).items():
        if fam in ("threshold", "learned") and line["rule"] != step_rule["rule"]:
            out[fam] = line["rule"]
    return out


def fixed_methods(methods: Sequence[str]) -> List[str]:
    return [m for m in methods if m.startswith("b=")]


def oracle_block_size(candidates: Sequence[int], fixed: Dict[int, Any], cost_profile: Optional[Any] = None) -> int:
    """The per-prompt best candidate from its fixed-b decodes (``fixed[b].tau``), as the labels define it
    (pipeline.policy.labels): the speed label (tau / the profiled step cost) when the policy came with a cost
    profile, else the paper's tau label; ties go to the smaller b."""
    tau = [fixed[b].tau for b in candidates]
    best = tau_label(tau) if cost_profile is None else speed_label(tau, [cost_profile.cost(b) for b in candidates])
    return int(candidates[best])
