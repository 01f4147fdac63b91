"""Measuring one prompt's labels with the engine: tau at every candidate block size from one shared prefill.

Ray-free (the label stage's actors call it; so can a notebook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .engine import Engine


def candidate_block_sizes(trained_block_size: int, k: int) -> List[int]:
    if trained_block_size - k < 1:
        raise ValueError(f"candidates B-k..B+k need B - k >= 1 (B={trained_block_size}, k={k})")
    return list(range(trained_block_size - k, trained_block_size + k + 1))


def argmax_smallest(values: Sequence[float]) -> int:
    """Index of the maximum; ties go to the first (the smaller block size, candidates being ascending)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


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


def label_prompt(engine: Engine, input_ids: torch.Tensor, candidates: Sequence[int], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 step_cost: Optional[Dict[int, float]] = None) -> PromptLabels:
    """Exhaustive labelling: one prefill, then a full speculative decode at every candidate."""
    state = engine.prefill(input_ids)
    results = [engine.decode(state, block_size=b, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_p=top_p, top_k=top_k, seed=seed) for b in candidates]
    tau = [r.tau for r in results]
    speedup_index = None
    if step_cost:
        speedup_index = argmax_smallest([t / step_cost[b] for t, b in zip(tau, candidates)])
    return PromptLabels(
        logits=state.logits, candidates=list(candidates), tau=tau, steps=[r.steps for r in results],
        new_tokens=[r.new_tokens for r in results], decode_seconds=[r.decode_seconds for r in results],
        prefill_seconds=state.prefill_seconds, label_index=argmax_smallest(tau), label_speedup_index=speedup_index,
    )


def measure_step_costs(engine: Engine, block_sizes: Sequence[int], vocab_size: int, prompt_tokens: int = 64,
                       steps: int = 8, repeats: int = 2, seed: int = 0) -> Dict[int, float]:
    """Seconds per decode step (draft forward + target verify) at each block size on this worker's hardware.

    A fixed synthetic prompt; no stop tokens so every probe runs its steps; the first repeat warms up and the
    fastest of the rest is kept (the least disturbed by other load).
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(2, vocab_size - 8), (1, prompt_tokens), generator=g)
    saved, engine.stop_token_ids = engine.stop_token_ids, None
    try:
        state = engine.prefill(ids)
        costs = {}
        for b in block_sizes:
            per_step = []
            for _ in range(repeats + 1):
                # At most `steps` steps: each commits >= 1 token, so steps + 1 new tokens bound it.
                r = engine.decode(state, block_size=b, max_new_tokens=steps + 1)
                per_step.append((r.draft_seconds + r.verify_seconds) / max(1, r.steps))
            costs[int(b)] = float(min(per_step[1:]))
        return costs
    finally:
        engine.stop_token_ids = saved


def logits_to_numpy(logits: torch.Tensor) -> np.ndarray:
    return logits.detach().float().cpu().numpy().astype(np.float16)
