"""Adaptive decoding: prefill -> policy.choose(logits) -> decode the whole request at the chosen block size.

Ray-free; the evaluate stage's actors use it and so can a serving loop or a notebook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .engine import DecodeResult, Engine, PrefillState
from .policy import BlockSizePolicy


@dataclass
class AdaptiveResult:
    block_size: int
    policy_seconds: float  # the MLP's latency, to compare with the prefill's
    prefill_seconds: float
    decode: DecodeResult


class AdaptiveDecoder:
    def __init__(self, engine: Engine, policy: BlockSizePolicy):
        self.engine = engine
        self.policy = policy
        if policy.device != engine.device:
            policy.model.to(engine.device)

    def choose(self, state: PrefillState) -> tuple:
        t0 = self.engine.now()
        # A folded policy reads the final hidden state (H values), the plain one the logits (V values).
        b = self.policy.choose(state.hidden if self.policy.reads_hidden else state.logits)
        return b, self.engine.now() - t0

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: Optional[int] = 0, state: Optional[PrefillState] = None) -> AdaptiveResult:
        """One request; pass ``state`` to reuse a prefill already made for the same prompt."""
        state = state if state is not None else self.engine.prefill(input_ids)
        b, policy_seconds = self.choose(state)
        res = self.engine.decode(state, block_size=b, max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, seed=seed)
        return AdaptiveResult(b, policy_seconds, state.prefill_seconds, res)
