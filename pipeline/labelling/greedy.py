"""The target's greedy continuation g of many prompts at once, with the features the draft needs read on the way.

Replay needs, per prompt, only g and the target's context features along prompt + g; neither depends on the block
size, so the target runs once for a whole batch of prompts: a batch-1 decode leaves a GPU mostly idle
(memory-bound) and a CPU mostly paying per-call overhead. At T = 0 plain batched greedy decoding gives the same g
as any speculative decode, without the ragged batch (every prompt accepting a different number of tokens per step)
that a batched speculative decode would be. Why the loop is written out rather than Hugging Face ``generate``, and
what reading the features during the decode saves over :func:`target_features` (the teacher-forced pass, kept as
the reference the tests compare with): benchmarks/results/labelling-greedy-decode.md,
labelling-features-from-decode.md.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
from dflash.model import extract_context_feature

from pipeline.labelling.attention import target_cpu_gqa

# Bound on the teacher-forced forward's hidden-state outputs (all layers x rows x width x hidden elements): the
# batch is split into row chunks below it, so that a large batch at a long max_new_tokens does not hold every layer's
# hidden states at once (36 layers of an 8B target at 32 x 2,300 positions would be ~22 GB in bf16).
FEATURE_ELEMENTS = 1 << 28
# Prompts per prefill forward in greedy_continuations (grouped by length, so that little of it is padding).
PREFILL_GROUP = 8


@torch.inference_mode()
def greedy_continuations(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         stop_token_ids: Optional[Sequence[int]], pad_token_id: int = 0,
                         layer_ids: Optional[Sequence[int]] = None, clock=None):
    """The target's greedy new tokens for every prompt: up to max_new_tokens, ending with the first stop token if
    one comes (as Engine.decode / greedy_reference end).

    With ``layer_ids`` (the draft's target_layer_ids), also what the draft needs, read from the very forwards that
    produce g instead of a second, teacher-forced pass (:func:`target_features`): returns ``(new tokens, context
    [P, L, F] right-padded: the context features of positions 0 .. len(prompt + g) - 2, which is every position a
    block's context can reach; logits [P, V]: the raw last-prompt-position logits from the prefill; seconds of the
    prefill)``, the features extracted from each forward's hidden states as the engine extracts them
    (``extract_context_feature``).

    The prompts are prefilled PREFILL_GROUP at a time by length (``generate`` would prefill the batch as one block
    left-padded to its longest prompt), their keys/values placed left-padded into one static KV cache, then the
    batch decodes one token per forward with an attention mask and position ids per prompt, stopping per prompt
    exactly as the engine does (the stop token is part of g, the budget counts the first token). On CPU the
    target's attention is :func:`pipeline.labelling.attention.target_cpu_gqa`'s.
    Measured: benchmarks/results/labelling-greedy-decode.md."""
    from transformers import StaticCache

    device = target.device
    clock = clock or time.perf_counter
    prompts = [list(p) for p in prompts]
    P, lens = len(prompts), [len(p) for p in prompts]
    n_max = max(lens)
    stops = [int(t) for t in (stop_token_ids or [])]
    layers = list(layer_ids) if layer_ids is not None else None
    attention = target_cpu_gqa(target)
    t_start = clock()
    try:
        if attention:
            target.set_attn_implementation(attention)
        first, keys, features = _grouped_prefill(target, prompts, n_max, pad_token_id, layers)
        # One static cache for the batch, prompts right-aligned at column n_max (left padding: zero keys, masked).
        cache = StaticCache(config=target.config, max_cache_len=n_max + max_new_tokens)
        for i, (k, v) in enumerate(keys):
            cache.update(k, v, i)
        del keys
        prefill_seconds = clock() - t_start
        mask = torch.ones((P, n_max + max_new_tokens), dtype=torch.long, device=device)
        for i, n in enumerate(lens):
            mask[i, :n_max - n] = 0
        last = torch.tensor([n - 1 for n in lens], device=device)
        token = first.argmax(-1)
        tokens, feats = [token], [features]
        stop_t = torch.tensor(stops, device=device) if stops else None
        done = torch.isin(token, stop_t) if stops else None
        for t in range(1, max_new_tokens):
            if done is not None and bool(done.all()):
                break
            out = target(input_ids=token[:, None], attention_mask=mask[:, :n_max + t],
                         position_ids=(last + t)[:, None], past_key_values=cache, use_cache=True,
                         output_hidden_states=layers is not None)
            if layers is not None:
                feats.append(extract_context_feature(out.hidden_states, layers))
            token = out.logits[:, -1].argmax(-1)
            tokens.append(token)
            if done is not None:
                done |= torch.isin(token, stop_t)
            del out
    finally:
        if attention:
            target.set_attn_implementation("sdpa")
    stop_set = set(stops)
    result = []
    for row in torch.stack(tokens, 1).tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_set), len(row))
        result.append(row[:cut])
    if layers is None:
        return result
    # feats: the prefill's [P, n_max, F] (left-padded), then [P, 1, F] per step.
    L = max(len(p) + len(c) for p, c in zip(prompts, result)) - 1
    context = _right_aligned(torch.cat(feats, dim=1), [n_max - n for n in lens], L)
    return result, context, first, prefill_seconds


def _right_aligned(feats: torch.Tensor, offsets: Sequence[int], length: int) -> torch.Tensor:
    """Left-padded [P, W, F] -> right-padded [P, length, F]: row i's position j sits at column offsets[i] + j
    (columns past W repeat the last one: padding, never read)."""
    offset = torch.tensor(list(offsets), device=feats.device)
    cols = (offset[:, None] + torch.arange(length, device=feats.device)[None]).clamp(max=feats.shape[1] - 1)
    return torch.gather(feats, 1, cols[:, :, None].expand(-1, -1, feats.shape[-1]))


def _grouped_prefill(target, prompts: List[List[int]], n_max: int, pad_token_id: int, layers):
    """The prefill of every prompt, PREFILL_GROUP prompts of similar length per forward (each group left-padded to
    its own longest): (last-position logits [P, V]; per layer (keys, values) [P, kv heads, n_max, head dim], each
    prompt right-aligned at column n_max, zeros before it; the draft's context features [P, n_max, F] likewise, or
    None without ``layers``)."""
    from transformers import DynamicCache

    device = target.device
    P, lens = len(prompts), [len(p) for p in prompts]
    order = sorted(range(P), key=lambda i: (lens[i], i))
    first = keys = features = None
    for lo in range(0, P, PREFILL_GROUP):
        rows = order[lo:lo + PREFILL_GROUP]
        n = max(lens[i] for i in rows)
        ids = torch.full((len(rows), n), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, n - lens[i]:] = torch.tensor(prompts[i], dtype=torch.long)
            mask[r, n - lens[i]:] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        group_cache = DynamicCache(config=target.config)
        out = target(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                     past_key_values=group_cache, use_cache=True, logits_to_keep=1,
                     output_hidden_states=layers is not None)
        sel = torch.tensor(rows, device=device)
        if first is None:
            first = out.logits.new_empty((P, out.logits.shape[-1]))
            keys = [(layer.keys.new_zeros((P, *layer.keys.shape[1:2], n_max, layer.keys.shape[3])),
                     layer.values.new_zeros((P, *layer.values.shape[1:2], n_max, layer.values.shape[3])))
                    for layer in group_cache.layers]
        first[sel] = out.logits[:, -1]
        for (k, v), layer in zip(keys, group_cache.layers):
            k[sel, :, n_max - n:] = layer.keys
            v[sel, :, n_max - n:] = layer.values
        if layers is not None:
            f = extract_context_feature(out.hidden_states, layers)
            if features is None:
                features = f.new_zeros((P, n_max, f.shape[-1]))
            features[sel, n_max - n:] = f
        del out, group_cache
    return first, keys, features


@torch.inference_mode()
def target_features(target, layer_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                    continuations: Sequence[Sequence[int]], pad_token_id: int = 0):
    """(context [P, L, F] right-padded: the draft's context features of positions 0 .. len(prompt + g) - 1 of each
    prompt, as Engine.prefill / verify extract them; logits [P, V]: the raw last-prompt-position logits)."""
    device = target.device
    P = len(prompts)
    n_max = max(len(p) for p in prompts)
    t_max = max(len(c) for c in continuations)
    width = n_max + t_max
    ids = torch.full((P, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((P, width), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        # Prompts end at column n_max - 1 (so one logits column serves all); g follows; padding on both sides.
        ids[i, n_max - len(p):n_max + len(c)] = torch.tensor(list(p) + list(c), dtype=torch.long)
        mask[i, n_max - len(p):] = 1  # trailing padding lies after every real position: causal, never seen
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    cfg = target.config
    per_row = (cfg.num_hidden_layers + 1) * width * cfg.hidden_size
    rows = max(1, FEATURE_ELEMENTS // max(1, per_row))
    lengths = [len(p) + len(c) for p, c in zip(prompts, continuations)]
    L = max(lengths)
    contexts, logits = [], []
    for lo in range(0, P, rows):
        hi = min(P, lo + rows)
        out = target(ids[lo:hi], attention_mask=mask[lo:hi], position_ids=positions[lo:hi], use_cache=False,
                     output_hidden_states=True, logits_to_keep=torch.tensor([n_max - 1], device=device))
        feats = extract_context_feature(out.hidden_states, list(layer_ids))
        contexts.append(_right_aligned(feats, [n_max - len(prompts[i]) for i in range(lo, hi)], L))
        logits.append(out.logits[:, -1])
        del out, feats
    return torch.cat(contexts), torch.cat(logits), lengths
