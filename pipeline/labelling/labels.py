"""Measuring one prompt's labels with the engine: tau at every candidate block size from one shared prefill.

Ray-free (the label stage's actors call it; so can a notebook).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from pipeline.decoding.engine import Engine
from pipeline.labelling.replay import DraftReplay, replay_unsupported, replay_with_trace
from pipeline.labelling.trace import record_traces
from pipeline.policy.labels import speed_label, tau_label
from pipeline.policy.trace import Trace


def candidate_block_sizes(trained_block_size: int, k: int) -> List[int]:
    if trained_block_size - k < 1:
        raise ValueError(f"candidates B-k..B+k need B - k >= 1 (B={trained_block_size}, k={k})")
    return list(range(trained_block_size - k, trained_block_size + k + 1))


@dataclass
class PromptLabels:
    logits: torch.Tensor  # [V] raw last-position prefill logits
    candidates: List[int]
    tau: List[float]
    steps: List[int]
    new_tokens: List[int]
    decode_seconds: List[float]
    prefill_seconds: float
    label_index: int
    label_speedup_index: Optional[int]
    # The per-step trace along g at a drafted b_max (pipeline.labelling.trace) and its seconds; None without one.
    trace: Optional[Trace] = None
    trace_seconds: Optional[float] = None
    # tau with each step's committed tokens replaced by their expectation over its acceptance draws (T > 0;
    # pipeline.decoding.expected); None where the steps are deterministic (it equals tau).
    tau_expected: Optional[List[float]] = None

    @property
    def label_block_size(self) -> int:
        return self.candidates[self.label_index]


def assemble_labels(state, candidates: Sequence[int], per_b: Dict[int, dict],
                    step_cost: Optional[Dict[int, float]], trace: Optional[Trace] = None,
                    trace_seconds: Optional[float] = None) -> PromptLabels:
    """Assemble one prompt's labels from {b: {"committed", "new_tokens", "seconds"}} (``state``: anything with the
    prefill's ``logits`` and ``prefill_seconds``; our engines' and vLLM's alike)."""
    committed = [per_b[b]["committed"] for b in candidates]
    tau = [sum(c) / len(c) if c else 1.0 for c in committed]  # as DecodeResult.tau
    speedup_index = None
    if step_cost:
        speedup_index = speed_label(tau, [step_cost[b] for b in candidates])
    return PromptLabels(
        logits=state.logits, candidates=list(candidates), tau=tau, steps=[len(c) for c in committed],
        new_tokens=[per_b[b]["new_tokens"] for b in candidates],
        decode_seconds=[per_b[b]["seconds"] for b in candidates], prefill_seconds=state.prefill_seconds,
        label_index=tau_label(tau), label_speedup_index=speedup_index, trace=trace,
        trace_seconds=trace_seconds if trace is not None else None,
        tau_expected=[per_b[b]["expected"] for b in candidates] if all("expected" in per_b[b] for b in candidates)
        else None,
    )


def label_prompt(engine: Engine, input_ids: torch.Tensor, candidates: Sequence[int], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 step_cost: Optional[Dict[int, float]] = None,
                 trace_block_size: Optional[int] = None) -> PromptLabels:
    """Exhaustive labelling (any temperature): one prefill, then a full speculative decode at every candidate.

    The trace (``trace_block_size``) needs one continuation g and a draft the runner models: at T = 0 with a
    replayable draft it is drafted along the largest candidate's decode (kept context, no extra target work), at
    the engine's arithmetic; otherwise (sampling: no single g; a draft replay does not model) there is none."""
    state = engine.prefill(input_ids)
    traced = trace_block_size is not None and temperature == 0 and max(candidates) >= 2 \
        and replay_unsupported(engine.draft) is None
    per_b, trace, trace_seconds = {}, None, None
    for b in candidates:
        keep = traced and b == max(candidates)
        r = engine.decode(state, block_size=b, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k, seed=seed, keep_context=keep)
        per_b[b] = {"committed": r.committed, "new_tokens": r.new_tokens, "seconds": r.decode_seconds,
                    "expected": r.tau_expected}
        if keep:
            t0 = time.perf_counter()
            runner = DraftReplay(engine.draft, engine.target, r.output_ids[0], r.context)
            trace = record_traces(runner, [state.num_input_tokens], max_new_tokens, trace_block_size,
                                  engine.stop_token_ids)[0]
            trace_seconds = time.perf_counter() - t0
    return assemble_labels(state, candidates, per_b, step_cost, trace, trace_seconds)


def replay_label_prompt(engine: Engine, input_ids: torch.Tensor, candidates: Sequence[int], max_new_tokens: int,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                        step_cost: Optional[Dict[int, float]] = None, proposer: str = "lockstep",
                        trace_block_size: Optional[int] = None) -> PromptLabels:
    """Exact greedy replay (T = 0 only): one target decode at B, draft-only work for the other candidates
    (pipeline.labelling.replay), and the trace at ``trace_block_size`` if given. Same tau, steps and labels as
    :func:`label_prompt`."""

    if temperature > 0:
        raise ValueError("replay labelling is exact only at temperature 0; use exhaustive mode")
    state = engine.prefill(input_ids)
    b_ref = engine.trained_block_size if engine.trained_block_size in candidates else max(candidates)
    if b_ref < 2:
        b_ref = engine.trained_block_size
    per_b, trace, trace_seconds = replay_with_trace(engine, state, candidates, max_new_tokens, proposer=proposer,
                                                    reference_block_size=b_ref, trace_block_size=trace_block_size)
    return assemble_labels(state, candidates, per_b, step_cost, trace, trace_seconds)


def logits_to_numpy(logits: torch.Tensor, precision: str = "fp16") -> np.ndarray:
    """The prefill logits as the label shard stores them: float32 rounded once, from the model's float32 values, to
    ``precision`` (label.logits_precision; pipeline.data.schemas.round_logits)."""
    from pipeline.data.schemas import round_logits

    return round_logits(logits.detach().float().cpu().numpy(), precision)


def per_step_check(engine, ids, decoded: Dict[str, tuple], b_max: int, max_new_tokens: int, cost_profile):
    """Evaluate's check of the simulator on one prompt at T = 0: the prompt's trace at ``b_max`` (labelling's own
    recorder, along the target's greedy continuation), then for each method of ``decoded`` ({method: (rule, the
    verified lengths its decode took)}) whether the simulator's lengths equal the decode's, and (``oracle``) the
    per-step oracle's modelled seconds."""
    from pipeline.policy.simulate import per_step_oracle, simulate

    trace = replay_label_prompt(engine, ids, [b_max], max_new_tokens, trace_block_size=b_max).trace
    out: Dict[str, Any] = {m: simulate(trace, rule)[0] == verified for m, (rule, verified) in decoded.items()}
    costs = [cost_profile.step_seconds(b_max, k) for k in range(1, b_max)]
    out["oracle"] = cost_profile.decode_seconds(per_step_oracle(trace, costs), b_max, rule=True,
                                                context=int(ids.shape[1]))
    return out
