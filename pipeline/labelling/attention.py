"""CPU attention for the batched forwards: torch's SDPA broadcasts the key/value heads instead of copying them.

transformers' sdpa attention copies the whole KV cache per head group (repeat_kv) whenever there is a mask, because
on CUDA a mask with ``enable_gqa`` forces the math kernel. On CPU that copy is a large share of a batched decode
step, so the batched greedy decode of the target (:func:`target_cpu_gqa`) and the draft's batched forwards
(:func:`draft_cpu_gqa`) run with SDPA's own GQA there, same outputs; anything else goes to transformers' own.
Measured: benchmarks/results/labelling-target-gqa-attention.md, labelling-draft-gqa-attention.md.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

CPU_GQA_ATTENTION = "blockpilot_sdpa_cpu_gqa"


def _sdpa_cpu_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, except on CPU with a padding mask and grouped key/value heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.device.type != "cpu" or attention_mask is None or getattr(module, "num_key_value_groups", 1) <= 1
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


_VISIBLE = [None, 0]  # (the last mask seen, its visible width): one reduction per forward, not one per layer


def _visible_width(mask: torch.Tensor) -> int:
    """1 + the last key column any query of ``mask`` sees. The mask object itself is held, so the same object is
    recognised (every layer of one forward gets the same mask) and a new one never mistaken for it."""
    if _VISIBLE[0] is not mask:
        seen = mask.reshape(-1, mask.shape[-1]).any(0).nonzero()
        _VISIBLE[:] = [mask, int(seen[-1]) + 1 if seen.numel() else mask.shape[-1]]
    return _VISIBLE[1]


def _sdpa_cpu_gqa_static(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         **kwargs):
    """:func:`_sdpa_cpu_gqa` for a static KV cache, whose attention spans every slot up to prompt +
    max_new_tokens, filled or not: the columns after the last one any query sees (the unfilled slots) are left
    out. Their weights are zeros, so only the kernel's blocking of the keys changes: the same g and features up to
    float rounding, as a dynamic cache would give, from fewer keys read per decode step.
    Measured: benchmarks/results/labelling-static-cache-width.md."""
    # Not under torch.compile (engine.compile=on): the width is data-dependent, a graph break per layer.
    if (attention_mask is not None and attention_mask.dtype == torch.bool and query.device.type == "cpu"
            and not torch.compiler.is_compiling()):
        width = _visible_width(attention_mask)
        if width < key.shape[-2]:
            key, value, attention_mask = key[:, :, :width], value[:, :, :width], attention_mask[..., :width]
    return _sdpa_cpu_gqa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)


@contextmanager
def draft_cpu_gqa(device):
    """The same attention for the draft's forwards: dflash's draft attention calls ALL_ATTENTION_FUNCTIONS["sdpa"]
    by name, so that entry is overridden (the instance's local mapping) for the duration of one draft forward and
    restored after; nothing else runs in between in a label actor."""
    if device.type != "cpu":
        yield
        return
    import dflash.model

    table = dflash.model.ALL_ATTENTION_FUNCTIONS
    had = "sdpa" in table._local_mapping
    saved = table._local_mapping.get("sdpa")
    table["sdpa"] = _sdpa_cpu_gqa
    try:
        yield
    finally:
        if had:
            table["sdpa"] = saved
        else:
            del table["sdpa"]


def target_cpu_gqa(target):
    """The attention implementation the batched greedy decode runs with: ours for an sdpa target on CPU, else
    None (unchanged)."""
    if target.device.type != "cpu" or getattr(target.config, "_attn_implementation", None) != "sdpa":
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if CPU_GQA_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(CPU_GQA_ATTENTION, _sdpa_cpu_gqa_static)
        AttentionMaskInterface.register(CPU_GQA_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks
    return CPU_GQA_ATTENTION
