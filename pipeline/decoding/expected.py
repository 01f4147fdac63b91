"""The expected accepted length of one sampled speculative step (T > 0), from what the step already computed.

Under rejection sampling the target accepts drafted token x_i ~ q_i with probability min(1, p_i(x_i) / q_i(x_i)),
given the slots before it were accepted; p_i is the target's distribution at slot i conditioned on the block's
tokens before it (one verify pass gives every p_i), q_i the draft's (DFlash drafts every slot of a block in one
pass, so q_i depends on the context and the block, never on the other slots' draws). With A the accepted count of
a step drafting K tokens,

    P(A >= k) = E_x [ prod_{i<k} min(1, p_i(x_i) / q_i(x_i)) * alpha_k(x_<k) ],   alpha_k = sum_x min(p_k(x), q_k(x))

(integrate out the uniforms of slots 1..k, then x_k ~ q_k), so on the step's own drafted tokens x

    E[A | x_<K] estimate = sum_{k=1}^{K} prod_{i<k} min(1, p_i(x_i) / q_i(x_i)) * alpha_k

is unbiased for E[A] and has less variance than the sampled A (each term is the conditional expectation of the
acceptance indicator 1{A >= k} given x_<k). The step commits min(A + 1, room) tokens, room the tokens left before
max_new_tokens; a stop token's cut is not modelled. At T = 0 the step is deterministic and this is what it
committed. Used by pipeline.decoding.engine.Engine (``DecodeResult.expected_committed``).
"""

from __future__ import annotations

from typing import Optional

import torch


def dense_draft_probs(draft_probs: torch.Tensor, draft_indices: Optional[torch.Tensor], vocab: int) -> torch.Tensor:
    """[K, V] draft distributions: as given, or scattered from a top-k draft's (indices, probs) (DFlash2)."""
    if draft_indices is None:
        return draft_probs
    return torch.zeros((*draft_probs.shape[:-1], vocab), dtype=draft_probs.dtype,
                       device=draft_probs.device).scatter_add(-1, draft_indices, draft_probs)


def expected_committed(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafted: torch.Tensor,
                       room: int) -> float:
    """1 + E[min(A, room - 1)] for one step: ``target_probs`` [K (+1), V] the target's p_1..p_K (a trailing bonus
    row is ignored), ``draft_probs`` [K, V] the draft's q_1..q_K, ``drafted`` [K] the drafted tokens, ``room`` the
    tokens the step may commit at most (>= 1)."""
    k = int(drafted.shape[0])
    n = min(k, int(room) - 1)
    if n <= 0:
        return 1.0
    p, q = target_probs[:k].float(), draft_probs[:k].float()  # float32 already: no [K, V] copies on a decode step
    alpha = torch.minimum(p, q).sum(-1)  # [K] P(slot i accepted | the slots before accepted, x_<i)
    idx = drafted[:, None].long()
    ratio = (p.gather(-1, idx)[:, 0] / q.gather(-1, idx)[:, 0].clamp_min(torch.finfo(q.dtype).tiny)).clamp(max=1.0)
    prefix = torch.cat([torch.ones(1, dtype=ratio.dtype, device=ratio.device), torch.cumprod(ratio, 0)[:-1]])
    return float(1.0 + (prefix * alpha)[:n].sum())
