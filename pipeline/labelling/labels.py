"""Measuring one prompt's labels with the engine: tau at every candidate block size from one shared prefill.

Ray-free (the label stage's actors call it; so can a notebook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from pipeline.decoding.engine import Engine
from pipeline.policy.labels import speed_label, tau_label


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

    @property
    def label_block_size(self) -> int:
        return self.candidates[self.label_index]


def _labels(state, candidates: Sequence[int], per_b: Dict[int, dict],
            step_cost: Optional[Dict[int, float]]) -> PromptLabels:
    """Assemble one prompt's labels from {b: {"committed", "new_tokens", "seconds"}}."""
    committed = [per_b[b]["committed"] for b in candidates]
    tau = [sum(c) / len(c) if c else 1.0 for c in committed]  # as DecodeResult.tau
    speedup_index = None
    if step_cost:
        speedup_index = speed_label(tau, [step_cost[b] for b in candidates])
    return PromptLabels(
        logits=state.logits, candidates=list(candidates), tau=tau, steps=[len(c) for c in committed],
        new_tokens=[per_b[b]["new_tokens"] for b in candidates],
        decode_seconds=[per_b[b]["seconds"] for b in candidates], prefill_seconds=state.prefill_seconds,
        label_index=tau_label(tau), label_speedup_index=speedup_index,
    )


def label_prompt(engine: Engine, input_ids: torch.Tensor, candidates: Sequence[int], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 step_cost: Optional[Dict[int, float]] = None) -> PromptLabels:
    """Exhaustive labelling (any temperature): one prefill, then a full speculative decode at every candidate."""
    state = engine.prefill(input_ids)
    per_b = {}
    for b in candidates:
        r = engine.decode(state, block_size=b, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k, seed=seed)
        per_b[b] = {"committed": r.committed, "new_tokens": r.new_tokens, "seconds": r.decode_seconds}
    return _labels(state, candidates, per_b, step_cost)


def replay_label_prompt(engine: Engine, input_ids: torch.Tensor, candidates: Sequence[int], max_new_tokens: int,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                        step_cost: Optional[Dict[int, float]] = None, proposer: str = "lockstep") -> PromptLabels:
    """Exact greedy replay (T = 0 only): one target decode at B, draft-only work for the other candidates
    (pipeline.labelling.replay). Same tau, steps and labels as :func:`label_prompt`."""
    from pipeline.labelling.replay import replay_candidates

    if temperature > 0:
        raise ValueError("replay labelling is exact only at temperature 0; use exhaustive mode")
    state = engine.prefill(input_ids)
    b_ref = engine.trained_block_size if engine.trained_block_size in candidates else max(candidates)
    if b_ref < 2:
        b_ref = engine.trained_block_size
    per_b = replay_candidates(engine, state, candidates, max_new_tokens, proposer=proposer,
                              reference_block_size=b_ref)
    return _labels(state, candidates, per_b, step_cost)


def logits_to_numpy(logits: torch.Tensor) -> np.ndarray:
    return logits.detach().float().cpu().numpy().astype(np.float16)
