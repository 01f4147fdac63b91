"""Batched replay labelling (T = 0): many prompts per forward; every candidate's tau from two batched passes.

Replay (pipeline.labelling.replay) needs, per prompt, the target's greedy continuation g and the target's context features
along prompt + g; everything else is draft work. Neither depends on b, so a label actor can do them for a whole
batch of prompts at once, which is where the speed comes from: a batch-1 decode leaves a GPU mostly idle
(memory-bound) and a CPU mostly paying per-call overhead.

1. **g**, by batched greedy decoding of the target with a static KV cache (:func:`greedy_continuations`): the
   prompts are prefilled PREFILL_GROUP at a time, grouped by length, their keys/values placed left-padded into one
   cache, then the batch decodes one token per forward with an attention mask and position ids per prompt, stopping
   per prompt at the stop tokens or max_new_tokens exactly as the engine does (the stop token is part of g, the
   budget counts the first token). Written out rather than Hugging Face ``generate``, which prefills the whole
   batch as one left-padded block: measured in one process on the 64 bench prompts, 3.57 s with generate at batch
   32, 3.11 s with this loop, 2.80 s at batch 64 (generate at 64: 3.50 s), the same tokens. A batched speculative
   decode would be ragged (every prompt accepts a different number of tokens per step): with one shared KV cache,
   rejected positions stay as masked holes, the cache grows by B per step and the batch runs as many steps as its
   slowest prompt, which on this CPU costs about what the 128 one-token steps cost (estimated from the measured
   step costs); at T = 0 plain batched greedy gives the same g. On CPU the target's attention is
   :func:`_sdpa_cpu_gqa_static` (torch's SDPA broadcasting the key/value heads instead of copying the KV cache per
   head group, -1/3 of the decode time; the unfilled cache slots left out).
2. **Features**: the hidden states of the draft's ``target_layer_ids`` at every position of prompt + g (what the
   engine's prefill and verify steps hand the draft) and the raw last-prompt-position logits (the policy's
   feature, what ``Engine.prefill`` returns). They are read from the forwards of step 1 themselves, which is the
   teacher-forced pass over prompt + g without running it a second time; :func:`target_features` is that
   teacher-forced pass (one forward for the batch, prompts left-padded so that every prompt ends at the same
   column), kept as the reference the tests compare with (measured here: ~12 % of a batch's time saved by not
   running it).
3. **The draft's walks**, lockstep AND batched across prompts: each round, ONE draft forward proposes for the
   current start of every candidate of every prompt still running (a row of blocks side by side per prompt, the
   block masks of pipeline.labelling.replay per prompt, padding rows that see only themselves). The bookkeeping of every
   step is :func:`pipeline.labelling.replay.step`, the engine's. The draft's row-wise work is done only where a result is
   read (:func:`_draft_forward_deferred`): a step reads proposals up to its first miss, so the last layer's output
   projection and MLP, the final norm and the lm_head run position by position on the blocks still matching
   (~44 % of the rows on the tiny pair), and no MLP runs on padding rows. Measured on this CPU with the masks built
   by a few tensor operations for all prompts (:func:`_batched_layout`) and the block keys written into
   preallocated key buffers (:class:`_BufferKeys`): 8.66 -> 8.0 s per 64 prompts at k = 2, identical labels.

Every candidate, b = B included, is replayed by the draft: there is no reference speculative decode.

Agreement. The arithmetic is the target's and the draft's own; only the shapes of the matrix products differ from
the batch-1 engine (padding, batch rows, features from one-token decode steps instead of verify blocks). A
target argmax that is a float near-tie can therefore resolve differently and change g (and so tau), and likewise a
draft near-tie can change one proposal. ``benchmarks/label_agreement.py`` measures how often, with each disagreement's first
diverging position and the target's top-1 - top-2 logit gap there.

Seconds (the ``decode_seconds`` / ``prefill_seconds`` columns): the batch's prefill, generation and draft replay
are shared equally by its prompts; a prompt's share of the batched prefill is its ``prefill_seconds``, its share of
the rest is split equally over its candidates (so a row's prefill + decode seconds sum to its share of the batch).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch
from dflash.model import _draft_value, _raw_input_embeddings, extract_context_feature

from pipeline.labelling.labels import PromptLabels, _labels
from pipeline.labelling.replay import _draft_forward, _DraftReader, replay_unsupported, step

# Bound on the teacher-forced forward's hidden-state outputs (all layers x rows x width x hidden elements): the
# batch is split into row chunks below it, so that a large batch at a long max_new_tokens does not hold every layer's
# hidden states at once (36 layers of an 8B target at 32 x 2,300 positions would be ~22 GB in bf16).
FEATURE_ELEMENTS = 1 << 28
# Draft proposal rows per lm_head call: at V = 151,936 a [rows, V] float32 logits block of 1,024 rows is ~600 MB.
HEAD_ROWS = 1024
# Prompts per prefill forward in greedy_continuations (grouped by length, so that little of it is padding).
PREFILL_GROUP = 8


def _as_list(ids) -> List[int]:
    if isinstance(ids, torch.Tensor):
        return [int(t) for t in ids.reshape(-1).tolist()]
    return [int(t) for t in ids]


def length_sorted_chunks(lengths: Sequence[int], batch_size: int) -> List[List[int]]:
    """Indices in chunks of batch_size, by ascending length: prompts of similar length share a batch, so that
    left padding wastes little. Deterministic (ties by index), so a rerun batches a shard the same way."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


# ---- 1. g: batched greedy decoding ------------------------------------------------------------------------------

CPU_GQA_ATTENTION = "blockpilot_sdpa_cpu_gqa"


def _sdpa_cpu_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, except that on CPU with a padding mask torch's SDPA broadcasts the key/value
    heads itself (``enable_gqa``) instead of transformers' repeat_kv copying the whole KV cache every decode step:
    transformers enables GQA in SDPA only without a mask, because on CUDA a mask then forces the math kernel. On
    this 2-core CPU, one attention call of a batch-32 decode step takes 0.5 ms instead of 2.8 ms with identical
    outputs, ~1/3 of a batched greedy decode step of the tiny target. Anything else goes to transformers' own."""
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
    float rounding (measured: logits within 8e-6, g identical on the 64 bench prompts), as a dynamic cache would
    give. A decode step then reads ~1/5 fewer keys at 128 new tokens: with HF generate (which also prefilled
    through the static cache), 3.62 -> 3.36 s per 64 prompts on this CPU (interleaved runs)."""
    if attention_mask is not None and attention_mask.dtype == torch.bool and query.device.type == "cpu":
        width = _visible_width(attention_mask)
        if width < key.shape[-2]:
            key, value, attention_mask = key[:, :, :width], value[:, :, :width], attention_mask[..., :width]
    return _sdpa_cpu_gqa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)


@contextmanager
def _draft_cpu_gqa(device):
    """The same attention for the draft's forwards: dflash's draft attention calls ALL_ATTENTION_FUNCTIONS["sdpa"]
    by name, so that entry is overridden (the instance's local mapping) for the duration of one draft forward and
    restored after; nothing else runs in between in a label actor. A draft replay forward's attention (32 prompts x
    40 block rows x ~340 keys) takes 8 ms instead of 19 ms on this CPU, identical outputs (tests compare the labels
    with batch-1 replay's, which uses transformers' own)."""
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


def _cpu_gqa_attention(target):
    """The attention implementation the batched greedy decode runs with: ours for an sdpa target on CPU, else
    unchanged."""
    if target.device.type != "cpu" or getattr(target.config, "_attn_implementation", None) != "sdpa":
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if CPU_GQA_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(CPU_GQA_ATTENTION, _sdpa_cpu_gqa_static)
        AttentionMaskInterface.register(CPU_GQA_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks
    return CPU_GQA_ATTENTION


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

    Written out rather than Hugging Face ``generate`` (which a label actor used before): generate prefills the
    batch as one block left-padded to its longest prompt (23 % of the prefill rows were padding on the 64 bench
    prompts at batch 32, more at 64), and pays its per-step machinery every token. Here the prompts are prefilled
    PREFILL_GROUP at a time by length, their keys/values placed left-padded into one static KV cache, then the
    batch decodes one token per forward (measured: the module docstring)."""
    from transformers import StaticCache

    device = target.device
    clock = clock or time.perf_counter
    prompts = [list(p) for p in prompts]
    P, lens = len(prompts), [len(p) for p in prompts]
    n_max = max(lens)
    stops = [int(t) for t in (stop_token_ids or [])]
    layers = list(layer_ids) if layer_ids is not None else None
    attention = _cpu_gqa_attention(target)
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


# ---- 2. the target's features: one teacher-forced forward --------------------------------------------------------

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


# ---- 3. the draft, over many prompts' rows of blocks ---------------------------------------------------------------

class BatchedDraftReplay(_DraftReader):
    """pipeline.labelling.replay.DraftReplay for many prompts: each prompt's g and context features (right-padded [P, L, F]),
    the draft's context keys/values of every prompt computed once, and proposals for every prompt's blocks from ONE
    draft forward (a batch row per prompt)."""

    def __init__(self, draft, target, gs: Sequence[Sequence[int]], context: torch.Tensor):
        self.gs = [list(g) for g in gs]
        # A padded position's keys are never visible: a block at start s sees context positions < s only, and s is
        # at most the prompt's own length.
        self._read_context(draft, target, context, attention=lambda: _draft_cpu_gqa(context.device))
        self._rows: List[int] = []  # the prompts the key buffers hold, in order
        self._buffers: List[tuple] = []
        # dflash's compute_logits multiplies by output_multiplier (1.0 unless configured) and softcaps only if
        # configured: x * 1.0 == x, so without either the lm_head's output is the logits (a pass over [rows, V]
        # less per read, ~1 % of a batch here).
        softcap = _draft_value(draft.config, "final_logit_softcapping")
        self._logits = ((lambda h, head: head(h))
                        if float(_draft_value(draft.config, "output_multiplier", 1.0)) == 1.0
                        and not (softcap is not None and float(softcap) > 0) else draft.compute_logits)

    def _keys_for(self, idx: List[int], ctx_len: int, q_len: int) -> "_BufferKeys":
        """Every layer's context keys/values of the prompts ``idx``, in buffers with room for a row of blocks after
        the context. The buffers are rebuilt only when the set of live prompts changes (it only shrinks as prompts
        finish) or more room is needed: a forward then copies its blocks' keys in, not every prompt's context."""
        width = ctx_len + q_len
        if idx != self._rows or self._buffers[0][0].shape[2] < width:
            sel = torch.tensor(idx, device=self.device)
            room = max(width, self.kv[0][0].shape[2])
            self._buffers = []
            for k, v in self.kv:
                bk = k.new_zeros((len(idx), k.shape[1], room + q_len, k.shape[3]))
                bv = v.new_zeros((len(idx), v.shape[1], room + q_len, v.shape[3]))
                bk[:, :, :k.shape[2]] = k.index_select(0, sel)
                bv[:, :, :v.shape[2]] = v.index_select(0, sel)
                self._buffers.append((bk, bv))
            self._rows = list(idx)
        return _BufferKeys(self._buffers, ctx_len)

    def _fail(self, vs: int):
        raise RuntimeError(f"dflash's DFlash2 convolution (kernel {self.min_block + 1}) cannot run on a block of "
                           f"{vs} tokens; the engine fails on this step too")

    @torch.inference_mode()
    def propose(self, work: Dict[int, list]) -> Dict[int, List[List[int]]]:
        """{prompt index: [(b, s, vs), ...]} (vs >= 2) -> {prompt index: [proposal tokens per block]}, from ONE
        draft forward."""
        for blocks in work.values():
            for _, _, vs in blocks:
                if vs < self.min_block:
                    self._fail(vs)
        self.forwards += 1
        idx = list(work)
        ctx_len = max(s for blocks in work.values() for _, s, _ in blocks)
        lay = _batched_layout([work[p] for p in idx], ctx_len, self.kinds, self.device)
        Pn, dev = len(idx), self.device
        tokens = torch.full((Pn * lay.q_len,), self.mask_id, dtype=torch.long, device=dev)
        tokens[lay.anchors] = torch.tensor([self.gs[p][s] for p in idx for _, s, _ in work[p]], dtype=torch.long,
                                           device=dev)
        tokens = tokens.view(Pn, lay.q_len)
        keys = self._keys_for(idx, ctx_len, lay.q_len)
        noise = _raw_input_embeddings(self.target, tokens, self.scale)
        masks = [lay.masks[kind] for kind in self.kinds]
        sizes = [vs - 1 for p in idx for _, _, vs in work[p]]
        if self.dflash2:
            with _draft_cpu_gqa(dev), keys:
                hidden = _draft_forward(self.draft, noise, self.no_context[:Pn], lay.positions, keys, masks,
                                        lay.local)
            # Each block's proposal rows (its rows after the first), prompt by prompt, block by block; the
            # candidate selector (T = 0: its argmax path) one block at a time, as the engine calls it.
            rows = hidden[lay.local > 0]
            anchors = [self.gs[p][s] for p in idx for _, s, _ in work[p]]
            flat = [self.draft.propose(h[None], torch.tensor([a], device=dev), self.head, 0.0)[0][0].tolist()
                    for h, a in zip(rows.split(sizes), anchors)]
        else:
            with _draft_cpu_gqa(dev), keys:
                read = _draft_forward_deferred(self.draft, noise, self.no_context[:Pn], lay.positions, keys, masks,
                                               lay.real)
            starts = [s for p in idx for _, s, _ in work[p]]
            refs = [self.gs[p] for p in idx for _ in work[p]]
            flat = self._proposals_up_to_first_miss(read, (lay.anchors + 1).tolist(), sizes, starts, refs)
        out, k = {}, 0
        for p in idx:
            out[p] = flat[k:k + len(work[p])]
            k += len(work[p])
        return out

    def _proposals_up_to_first_miss(self, read, first_rows, sizes, starts, refs) -> List[List[int]]:
        """Each block's proposals, read position by position and only as far as they match g: a step accepts the
        matching prefix and never reads a proposal after the first miss (replay.step), so the rows after it never
        reach the lm_head, nor the last layer's row-wise work (:func:`_draft_forward_deferred`); about half of the
        rows at tau ~ 4, and the lm_head is the largest matrix product of a draft row at a real vocabulary.
        ``read(rows)`` gives the final hidden states of flat row indices; block i's proposal j is row
        ``first_rows[i] + j``. Unread positions are -1, never a token id."""
        flat = [[-1] * n for n in sizes]
        active = [i for i, n in enumerate(sizes) if n > 0]
        j = 0
        while active:
            picked = torch.tensor([first_rows[i] + j for i in active], device=self.device)
            toks = torch.cat([torch.argmax(self._logits(read(chunk), self.head), dim=-1)
                              for chunk in picked.split(HEAD_ROWS)]).tolist()
            still = []
            for i, tok in zip(active, toks):
                flat[i][j] = tok
                pos = starts[i] + 1 + j
                if j + 1 < sizes[i] and pos < len(refs[i]) and tok == refs[i][pos]:
                    still.append(i)
            active, j = still, j + 1
        return flat


class _BufferKeys:
    """pipeline.labelling.replay._Keys over preallocated buffers: a layer's block keys/values are written in place right
    after its ``ctx_len`` context columns and the attention gets a view, instead of a concatenation that copies
    every prompt's context each forward. The columns overwritten are the context of positions >= ctx_len, which no
    block of this forward can see (a block sees positions before its start, and every start is <= ctx_len); leaving
    the ``with`` block puts them back for the next forward."""

    def __init__(self, buffers, ctx_len: int):
        self.buffers, self.ctx_len, self.saved = buffers, ctx_len, []

    def update(self, k, v, layer_idx, *args, **kwargs):
        bk, bv = self.buffers[layer_idx]
        lo, hi = self.ctx_len, self.ctx_len + k.shape[-2]
        self.saved.append((bk, bv, lo, hi, bk[:, :, lo:hi].clone(), bv[:, :, lo:hi].clone()))
        bk[:, :, lo:hi] = k
        bv[:, :, lo:hi] = v
        return bk[:, :, :hi], bv[:, :, :hi]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for bk, bv, lo, hi, old_k, old_v in reversed(self.saved):
            bk[:, :, lo:hi] = old_k
            bv[:, :, lo:hi] = old_v
        self.saved = []
        return False


def _batched_layout(rows_of_blocks: Sequence[Sequence[tuple]], ctx_len: int, kinds, device) -> SimpleNamespace:
    """pipeline.labelling.replay._block_layout for many prompts at once, built with a few tensor operations instead of a
    loop over prompts: prompt r's blocks [(b, s, vs), ...] side by side in batch row r, rows padded to the
    longest row of blocks (q_len). Returns ``masks`` {kind: [P, 1, q_len, ctx_len + q_len] bool} (a real row sees
    the context strictly before its block's start and its own block, as that kind restricts it; a padding row sees
    only itself, so that softmax has a key, and is never read), ``positions`` and ``local`` [P, q_len] (a row's
    position; its index within its block, 0 = the block's first token), ``anchors`` (flat index into [P * q_len]
    of every block's first row, prompt by prompt, block by block), ``real`` (flat indices of the real rows) and
    ``q_len``."""
    P = len(rows_of_blocks)
    row_of = [r for r, blocks in enumerate(rows_of_blocks) for _ in blocks]
    starts = [s for blocks in rows_of_blocks for _, s, _ in blocks]
    sizes = [vs for blocks in rows_of_blocks for _, _, vs in blocks]
    offsets = []  # each block's first slot within its batch row
    for blocks in rows_of_blocks:
        at = 0
        for _, _, vs in blocks:
            offsets.append(at)
            at += vs
    q_len = max(sum(vs for _, _, vs in blocks) for blocks in rows_of_blocks)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    size_t = as_t(sizes)
    block = torch.repeat_interleave(torch.arange(len(sizes), device=device), size_t)  # every real row's block
    first = torch.cumsum(size_t, 0) - size_t
    local_real = torch.arange(block.numel(), device=device) - first[block]
    real = (as_t(row_of) * q_len + as_t(offsets))[block] + local_real
    n = P * q_len
    positions = torch.zeros(n, dtype=torch.long, device=device).index_put_((real,), as_t(starts)[block] + local_real)
    local = torch.zeros(n, dtype=torch.long, device=device).index_put_((real,), local_real)
    start = torch.zeros(n, dtype=torch.long, device=device).index_put_((real,), as_t(starts)[block])
    # A padding row is a block of its own (a negative id no real block has).
    block_id = (-1 - torch.arange(n, device=device)).index_put_((real,), block)
    positions, local, start, block_id = (t.view(P, q_len) for t in (positions, local, start, block_id))
    ctx = torch.arange(ctx_len, device=device)
    seen = torch.cat([ctx[None, None] < start[:, :, None], block_id[:, None, :] == block_id[:, :, None]], dim=-1)
    k_pos = torch.cat([ctx[None].expand(P, -1), positions], dim=1)
    masks = {}
    for is_causal, window in set(kinds):
        q, k = positions[:, :, None], k_pos[:, None, :]
        visible = seen
        if is_causal:
            visible = visible & (k <= q)
        if window is not None:
            visible = visible & (q - k < window)
            if not is_causal:
                visible = visible & (k - q < window)
        masks[(is_causal, window)] = visible[:, None]
    return SimpleNamespace(masks=masks, positions=positions, local=local, anchors=(real[first]), real=real,
                           q_len=q_len)


@contextmanager
def _deferred_output_projection(attention):
    """dflash's attention forward without its output projection (o_proj, a row-wise linear map) for the duration
    of one call: the caller applies it later, only to the rows it reads. dflash's own forward stays the authority
    for the projections, norms, RoPE and masks before it."""
    o_proj = attention.o_proj
    attention.o_proj = torch.nn.Identity()
    try:
        yield o_proj
    finally:
        attention.o_proj = o_proj


def _draft_forward_deferred(draft, noise, target_hidden, position_ids, keys, masks, real):
    """pipeline.labelling.replay._draft_forward for a draft without convolutions (DFlashDraftModel), with its row-wise work
    done only where a result is read: every layer's MLP on the real rows only (``real``, flat indices into
    [P * q_len]; padding rows are seen by nobody but themselves, so their stale values change nothing), and the
    last layer's output projection, MLP and the final norm only on the rows the caller asks for. Attention sees
    every row of every block, as in the engine. Returns ``read(flat row indices) -> final hidden states``, the
    rows the full forward would give (row-wise maps: the same operations on fewer rows)."""
    hidden = noise
    target_hidden = draft.hidden_norm(draft.fc(target_hidden))
    position_embeddings = draft.rotary_emb(hidden, position_ids)
    width = hidden.shape[-1]

    def attend(layer, mask, x):
        return layer.self_attn(hidden_states=x, target_hidden=target_hidden, attention_mask=mask,
                               position_ids=position_ids, past_key_values=keys,
                               position_embeddings=position_embeddings)[0]

    def mlp_half(layer, h):  # the second half of Qwen3DFlashDecoderLayer.forward
        return h + layer.mlp(layer.post_attention_layernorm(h))

    *first, (last, last_mask) = zip(draft.layers, masks)
    for layer, mask in first:
        hidden = hidden + attend(layer, mask, layer.input_layernorm(hidden))
        flat = hidden.view(-1, width)
        flat.index_copy_(0, real, mlp_half(layer, flat.index_select(0, real)))
    with _deferred_output_projection(last.self_attn) as o_proj:
        before_o = attend(last, last_mask, last.input_layernorm(hidden))
    before_o = before_o.reshape(-1, before_o.shape[-1])
    residual = hidden.view(-1, width)

    def read(rows: torch.Tensor) -> torch.Tensor:
        h = residual.index_select(0, rows) + o_proj(before_o.index_select(0, rows))
        return draft.norm(mlp_half(last, h))

    return read


def batched_lockstep_walks(gs: Sequence[Sequence[int]], ns: Sequence[int], max_new_tokens: int,
                           block_sizes: Sequence[int], propose, stop_ids: Optional[Sequence[int]]):
    """pipeline.labelling.replay.lockstep_walks for many prompts at once: each round, ONE ``propose({p: blocks})`` call for
    the current start of every live candidate of every prompt. Returns [{b: committed per step}] per prompt."""
    stops = set(stop_ids or ())
    P = len(gs)
    max_len = [n + max_new_tokens for n in ns]
    start = [{b: ns[p] for b in block_sizes} for p in range(P)]
    done = [{b: gs[p][ns[p]] in stops for b in block_sizes} for p in range(P)]
    committed = [{b: [] for b in block_sizes} for _ in range(P)]
    while True:
        rounds = {}
        for p in range(P):
            live = [b for b in block_sizes if not done[p][b] and start[p][b] + 1 < max_len[p]]
            if live:
                rounds[p] = [(b, start[p][b], min(b, max_len[p] - start[p][b])) for b in live]
        if not rounds:
            return committed
        work = {p: [blk for blk in blocks if blk[2] > 1] for p, blocks in rounds.items()}
        work = {p: blocks for p, blocks in work.items() if blocks}
        proposals = propose(work) if work else {}
        for p, blocks in rounds.items():
            mine = dict(zip([blk[0] for blk in work.get(p, [])], proposals.get(p, [])))
            for b, s, _ in blocks:
                produced, done[p][b] = step(gs[p], s, max_len[p], b, mine.get(b), stops)
                start[p][b] += produced
                committed[p][b].append(produced)


# ---- all together ------------------------------------------------------------------------------------------------

def batched_replay_label_prompts(engine, prompts: Sequence, candidates: Sequence[int], max_new_tokens: int,
                                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                                 step_cost: Optional[Dict[int, float]] = None,
                                 pad_token_id: int = 0) -> List[PromptLabels]:
    """replay_label_prompt for a batch of prompts (token id lists or [1, n] tensors): one PromptLabels per prompt,
    in order, with the same fields. Raises ValueError before any work at T > 0 or for a draft replay does not
    model; any error inside the batch fails the whole batch (the caller retries its prompts alone)."""
    if temperature > 0:
        raise ValueError("replay labelling is exact only at temperature 0; use exhaustive mode")
    unsupported = replay_unsupported(engine.draft)
    if unsupported:
        raise ValueError(f"replay does not model {unsupported}; use exhaustive labelling")
    prompts = [_as_list(p) for p in prompts]
    if not prompts:
        return []
    if min(len(p) for p in prompts) < 1:
        raise ValueError("every prompt needs at least one token")
    P = len(prompts)
    t0 = engine.now()
    # g, the draft's context features and the prefill logits from one batched greedy decode (greedy_continuations);
    # target_features would give the same from a second, teacher-forced pass, at ~12 % more time here.
    news, context, logits, prefill_seconds = greedy_continuations(
        engine.target, prompts, max_new_tokens, engine.stop_token_ids, pad_token_id,
        layer_ids=engine.draft.target_layer_ids, clock=engine.now)
    gs = [p + c for p, c in zip(prompts, news)]
    runner = BatchedDraftReplay(engine.draft, engine.target, gs, context)
    walks = batched_lockstep_walks(gs, [len(p) for p in prompts], max_new_tokens, list(candidates), runner.propose,
                                   engine.stop_token_ids)
    t3 = engine.now()
    prefill_share = prefill_seconds / P
    decode_share = (t3 - t0 - prefill_seconds) / P / max(1, len(candidates))
    out = []
    for p in range(P):
        per_b = {b: {"committed": walks[p][b], "new_tokens": len(news[p]), "seconds": decode_share}
                 for b in candidates}
        state = SimpleNamespace(logits=logits[p], prefill_seconds=prefill_share)
        out.append(_labels(state, candidates, per_b, step_cost))
    return out


class ShardBatches:
    """A label shard's prompts labelled in length-sorted batches, handed out row by row in the shard's order.

    The label stage's per-row loop (stages.decoding.DecodingStage.each_prompt) asks for row 0, 1, 2, ...; the
    first request for a row labels its whole batch. A batch that raises is retried prompt by prompt, so that one
    bad prompt (an error, an out-of-memory at batch size) costs only itself: its own error is raised for its row
    alone, which each_prompt turns into a ``decode_error`` reject, and its batch-mates are labelled.
    """

    def __init__(self, prompt_ids: Sequence[str], input_ids: Sequence[Sequence[int]], batch_size: int,
                 label_batch):
        self.prompt_ids = list(prompt_ids)
        self.input_ids = [list(x) for x in input_ids]
        self.label_batch = label_batch  # [input ids, ...] -> [PromptLabels, ...]
        self.chunks = length_sorted_chunks([len(x) for x in self.input_ids], batch_size)
        self.chunk_of = {i: c for c, chunk in enumerate(self.chunks) for i in chunk}
        self.results: Dict[int, object] = {}
        self.next_row = 0
        self.batches = self.retried = 0

    def __call__(self, rec) -> PromptLabels:
        i = self.next_row
        if i >= len(self.prompt_ids) or rec["prompt_id"] != self.prompt_ids[i]:
            raise RuntimeError(f"rows must be asked for in the shard's order (row {i}: {rec.get('prompt_id')!r})")
        self.next_row += 1
        if i not in self.results:
            self._label(self.chunks[self.chunk_of[i]])
        result = self.results.pop(i)
        if isinstance(result, BaseException):
            raise result
        return result

    def _label(self, chunk: List[int]) -> None:
        self.batches += 1
        try:
            for i, out in zip(chunk, self.label_batch([self.input_ids[i] for i in chunk]), strict=True):
                self.results[i] = out
            return
        except Exception as err:  # noqa: BLE001 - retried below, prompt by prompt
            _free_cuda(err)
            if len(chunk) == 1:
                self.results[chunk[0]] = err
                return
        for i in chunk:
            self.retried += 1
            try:
                self.results[i] = self.label_batch([self.input_ids[i]])[0]
            except Exception as err:  # noqa: BLE001 - this prompt's own error, rejected for its row only
                _free_cuda(err)
                self.results[i] = err


def _free_cuda(err: BaseException) -> None:
    if "out of memory" in str(err).lower() and torch.cuda.is_available():
        torch.cuda.empty_cache()
