"""evaluate's result rows (pipeline.data.schemas.RESULTS_SCHEMA): one per prompt x method, and the modelled time
the summaries read beside the measured one.

speedup = mean time per output token of AR / mean time per output token of the method, per dataset (as DFlash's
benchmark computes it). Time per output token = decode seconds / new tokens (the prefill is the same for all).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import pyarrow as pa

MODELLED_TPOT = "modelled_time_per_output_token"


def modelled_seconds(cost_profile: Optional[Any], b: int, res: Any) -> Optional[float]:
    """Modelled decode seconds (pipeline.policy.cost.CostProfile.decode_seconds): per step, the draft's pass and
    the verify over what was sent (a plain step at b: cost(b), less at the max_new_tokens cut; a per-step rule's
    step: the draft at b_max, the rule's own work, the verify over what it sent), plus the first step's extra
    after this prompt. None without a profile."""
    if cost_profile is None:
        return None
    return cost_profile.decode_seconds(res.verified, b, rule=res.step_rule is not None,
                                       context=res.num_input_tokens)


def result_row(rec: Dict[str, Any], method: str, kind: str, b: int, res: Any, prefill_s: float,
               policy_s: Optional[float], reference: Any, worker: str, cost_profile: Optional[Any] = None
               ) -> Dict[str, Any]:
    """The row of one prompt (``rec``: its prompt shard row) decoded by one method (``res``: the decode result);
    ``reference`` is the output every method must equal."""
    return {"modelled_seconds": modelled_seconds(cost_profile, b, res), "step_rule": None,
            "policy_block_size": None, "policy_action": None, "prompt_id": rec["prompt_id"], "source": rec["source"],
            "method": method, "kind": kind, "block_size": b, "tau": res.tau, "steps": res.steps, "new_tokens": res.new_tokens,
            "decode_seconds": res.decode_seconds, "time_per_output_token": res.decode_seconds / max(1, res.new_tokens),
            "prefill_seconds": prefill_s, "policy_seconds": policy_s,
            "matches_autoregressive": bool(res.output_ids.equal(reference)), "worker": worker}


def with_modelled_time(results: pa.Table) -> pa.Table:
    """The results with the modelled time per output token (modelled seconds / new tokens) appended: steps x the
    profiled step costs, deterministic at T = 0 and free of the shared machine's noise."""
    modelled = [s / max(1, n) for s, n in zip(results.column("modelled_seconds").to_pylist(),
                                              results.column("new_tokens").to_pylist())]
    return results.append_column(MODELLED_TPOT, pa.array(modelled, pa.float64()))
