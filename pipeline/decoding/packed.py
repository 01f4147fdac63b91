"""The packed (ragged) layout of one batched forward and the slot KV caches it reads and writes, with the attention
function registered with transformers (:data:`RAGGED`) that runs the target's own forward over them: each row's
queries read only that row's keys, gathered into a padded ``[rows, heads, q_max, width]`` view with a mask, while
every other layer runs over exactly the rows' tokens. Used by pipeline.decoding.batched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

RAGGED = "blockpilot_ragged"


class Rows:
    """One forward's packed layout: ``slots[r]`` and ``positions[r]`` (the absolute positions of row r's queries,
    contiguous). ``token_slot`` / ``token_pos`` per packed token; ``cell`` maps every padded query cell
    [rows * q_max] to its packed token (padding cells to token 0, never read back); ``real`` the cells that are
    tokens; ``causal`` the mask of a causal row over its slot's first ``width`` keys."""

    def __init__(self, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int], device):
        self.n_rows, self.q_max = len(slots), max(lengths)
        self.width = max(s + n for s, n in zip(starts, lengths))
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        self.slots, self.starts, self.lengths = t(slots), t(starts), t(lengths)
        n = self.lengths
        first = torch.cumsum(n, 0) - n
        local = torch.arange(self.q_max, device=device)
        valid = local[None] < n[:, None]  # [R, q_max]
        self.real = valid.reshape(-1).nonzero()[:, 0]
        self.cell = torch.where(valid, first[:, None] + local[None], 0).reshape(-1)
        pos = self.starts[:, None] + local[None]  # [R, q_max]
        self.token_pos = pos.reshape(-1)[self.real]
        self.token_slot = self.slots[:, None].expand(-1, self.q_max).reshape(-1)[self.real]
        keys = torch.arange(self.width, device=device)
        # A padding cell sees key 0 only, so that softmax has a key; its output is never read.
        self.causal = (keys[None, None] <= torch.where(valid, pos, 0)[:, :, None])[:, None]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """packed [1, heads, Q, d] -> padded [rows, heads, q_max, d]."""
        h, d = x.shape[1], x.shape[3]
        return x[0].index_select(1, self.cell).view(h, self.n_rows, self.q_max, d).transpose(0, 1)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """padded [rows, heads, q_max, d] -> packed [1, Q, heads, d] (what transformers' attention returns)."""
        h, d = y.shape[1], y.shape[3]
        return y.transpose(1, 2).reshape(-1, h, d).index_select(0, self.real)[None]


class SlotCache:
    """Per layer keys/values [slots, kv_heads, width, head_dim], by absolute position."""

    def __init__(self, n_layers: int, slots: int, kv_heads: int, width: int, head_dim: int, dtype, device):
        self.k = [torch.zeros((slots, kv_heads, width, head_dim), dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v packed [1, kv_heads, Q, d] at (slots[i], positions[i])."""
        self.k[layer][slots, :, positions] = k[0].transpose(0, 1)
        self.v[layer][slots, :, positions] = v[0].transpose(0, 1)

    def rows(self, layer: int, slots: torch.Tensor, width: int):
        return self.k[layer].index_select(0, slots)[:, :, :width], self.v[layer].index_select(0, slots)[:, :, :width]


@dataclass
class TargetPass:
    """What the target's attention reads from the mask argument during one packed forward."""

    rows: Rows
    cache: SlotCache


def attend(q, k, v, mask, scaling, broadcast_gqa=None):
    """SDPA over grouped key/value heads, with a mask. On CPU the key/value heads are broadcast (``enable_gqa``: no
    copy; benchmarks/results/labelling-target-gqa-attention.md). On CUDA a mask with ``enable_gqa`` leaves only the
    math kernel (it materialises the scores; transformers' sdpa_attention.use_gqa_in_sdpa says the same), so there
    the heads are repeated and the memory-efficient kernel, which takes a mask, runs: one copy of the row's keys
    per group against the scores matrix. Which kernels accept each call on a device: benchmarks/sdpa_kernels.py.
    ``broadcast_gqa`` forces either way (tests)."""
    groups = q.shape[1] // k.shape[1]
    if broadcast_gqa is None:
        broadcast_gqa = q.device.type != "cuda" or mask is None
    if groups > 1 and not broadcast_gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                                            enable_gqa=groups > 1 and broadcast_gqa)


def _ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface for a packed target forward: write this forward's keys into the slot cache,
    then each row's queries attend causally to its slot."""
    p: TargetPass = attention_mask
    r = p.rows
    p.cache.write(module.layer_idx, r.token_slot, r.token_pos, key, value)
    k, v = p.cache.rows(module.layer_idx, r.slots, r.width)
    return r.scatter(attend(r.gather(query), k, v, r.causal, scaling)), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if RAGGED not in AttentionInterface._global_mapping:
        AttentionInterface.register(RAGGED, _ragged_attention)
        AttentionMaskInterface.register(RAGGED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # unused: the mask is ours
