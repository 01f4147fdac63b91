"""The DFlash draft's forward over blocks laid side by side: one forward drafts many blocks of many prompts.

The engine drafts one block per forward, after a key sequence of contiguous positions ending at the block. Replay
drafts the current block of every candidate, and batched replay those of every prompt, in ONE forward: a batch row
per prompt, its blocks side by side after the prompt's context keys. Three things give each block what it gets
alone: a mask per attention kind (:func:`layout`), DFlash2's causal convolutions cut at block edges
(:func:`_convolve`) and every prompt's context keys, computed once, served from one buffer (:class:`BlockKeys`).
:func:`draft_forward` is DFlashDraftModel.forward with these in place: what replay assumes of dflash's draft
forward is written here and nowhere else.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace
from typing import Sequence

import torch
from torch.nn import functional as F


def layout(rows_of_blocks: Sequence[Sequence[tuple]], ctx_len: int, kinds, device) -> SimpleNamespace:
    """Prompt r's blocks [(b, s, vs), ...] side by side in batch row r after ctx_len context keys, rows padded to
    the longest row of blocks (q_len). Returns ``masks`` {(is_causal, sliding_window): [P, 1, q_len, ctx_len +
    q_len] bool} for every attention kind in ``kinds`` (a real row sees the context strictly before its block's
    start and its own block, as that kind restricts it; a padding row sees only itself, so that softmax has a key,
    and is never read), ``positions`` and ``local`` [P, q_len] (a row's position; its index within its block, 0 =
    the block's first token, not a proposal), ``anchors`` (flat index into [P * q_len] of every block's first row,
    prompt by prompt, block by block), ``real`` (flat indices of the real rows) and ``q_len``."""
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
    # dflash's _attention_mask, on positions: dflash measures a query's and a key's position by their index in the
    # layer's key sequence; in the engine that sequence is contiguous positions ending at the block's last (a
    # sliding layer's cache keeps the last window - 1 context positions), so index differences there are position
    # differences here.
    q, k = positions[:, :, None], torch.cat([ctx[None].expand(P, -1), positions], dim=1)[:, None, :]
    masks = {}
    for is_causal, window in set(kinds):
        visible = seen
        if is_causal:
            visible = visible & (k <= q)
        if window is not None:
            visible = visible & (q - k < window)
            if not is_causal:
                visible = visible & (k - q < window)
        masks[(is_causal, window)] = visible[:, None]
    return SimpleNamespace(masks=masks, positions=positions, local=local, anchors=real[first], real=real,
                           q_len=q_len)


# ---- DFlash2's convolutions, every block on its own ---------------------------------------------------------------

def _convolve(hidden, dynamic, base, group_size, local):
    """dflash's _grouped_dynamic_convolve with every block on its own: a row's causal window stops at its block's
    first row (``local`` [P, length]: each row's index within its block), as when the engine drafts one block per
    forward. Same operations; the values dflash reads from before the block (its zero padding) are zeros here too."""
    batch, length, hidden_size = hidden.shape
    groups = hidden_size // group_size
    blocks = hidden.view(batch, length, groups, group_size)
    dynamic = dynamic.view(batch, length, base.shape[0], groups, 1)
    output = torch.zeros_like(blocks)
    for offset in range(min(base.shape[0], length)):  # a larger offset reads only padding: adds zeros
        values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        values = values.masked_fill((local < offset).view(-1, length, 1, 1), 0)
        kernel = base[offset].view(1, 1, groups, group_size).to(hidden.dtype)
        output = output + kernel * values
        output = torch.addcmul(output, dynamic[:, :, offset], values)
    return output.view_as(hidden)


def _conv_prepare(conv, hidden, local):  # GroupedDynamicCausalConv.prepare, blocks kept apart
    dynamic = conv.kernel_projection(hidden).view(*hidden.shape[:-1], 2, conv.kernel_size,
                                                  hidden.shape[-1] // conv.group_size)
    return (_convolve(hidden, dynamic[..., 0, :, :], conv.base_kernel[0], conv.group_size, local),
            dynamic[..., 1, :, :])


def _conv_finish(conv, hidden, dynamic, local):  # GroupedDynamicCausalConv.finish, blocks kept apart
    return _convolve(hidden, dynamic, conv.base_kernel[1], conv.group_size, local)


# ---- the KV cache's stand-ins ---------------------------------------------------------------------------------------

class BlockKeys:
    """Stands in for the draft's KV cache: every layer's context keys/values (RoPE applied) of the prompts
    ``rows``, in buffers ``width`` columns wide. A forward's block keys are written in place right after its
    ctx_len context columns (:meth:`after`) and the attention gets a view, instead of a concatenation that copies
    every prompt's context each forward. The columns overwritten hold the context of positions >= ctx_len, which no
    block of that forward can see (a block sees positions before its start, and every start is <= ctx_len);
    leaving the ``with`` block puts them back for the next forward."""

    def __init__(self, kv, rows: Sequence[int], width: int):
        sel = torch.tensor(list(rows), device=kv[0][0].device)
        self.rows, self.ctx_len, self.saved, self.buffers = list(rows), 0, [], []
        for k, v in kv:
            bk = k.new_zeros((len(self.rows), k.shape[1], width, k.shape[3]))
            bv = v.new_zeros((len(self.rows), v.shape[1], width, v.shape[3]))
            bk[:, :, :k.shape[2]] = k.index_select(0, sel)
            bv[:, :, :v.shape[2]] = v.index_select(0, sel)
            self.buffers.append((bk, bv))

    def holds(self, rows: Sequence[int], width: int) -> bool:
        return list(rows) == self.rows and self.buffers[0][0].shape[2] >= width

    def after(self, ctx_len: int) -> "BlockKeys":
        self.ctx_len = ctx_len
        return self

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


class _Recorder:
    """Stands in for the draft's KV cache of the one forward that reads the context keys: keeps what each layer
    hands it."""

    def __init__(self):
        self.seen = {}

    def update(self, k, v, layer_idx, *args, **kwargs):
        self.seen[layer_idx] = (k, v)
        return k, v


# ---- the forward ----------------------------------------------------------------------------------------------------

def _sublayer(norm, conv, fn, hidden, local):
    """One half of Qwen3DFlashDecoderLayer.forward: residual + fn(norm(hidden)), inside the layer's causal
    convolution if it has one (DFlash2)."""
    x, kernel = norm(hidden), None
    if conv is not None:
        x, kernel = _conv_prepare(conv, x, local)
    x = fn(x)
    if kernel is not None:
        x = _conv_finish(conv, x, kernel, local)
    return hidden + x


def _mlp_half(layer, hidden, local, rows=None):
    """The layer's second half; with ``rows`` (flat indices into [P * q_len]), on those rows only, in place."""
    if rows is None:
        return _sublayer(layer.post_attention_layernorm, layer.mlp_conv, layer.mlp, hidden, local)
    flat = hidden.view(-1, hidden.shape[-1])
    flat.index_copy_(0, rows, _mlp_half(layer, flat.index_select(0, rows), None))
    return hidden


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


def draft_forward(draft, noise, target_hidden, position_ids, keys, masks, local, real=None):
    """DFlashDraftModel.forward with its layers' forward written out, so that every layer gets its own mask (None:
    dflash builds it from the key sequence) and DFlash2's convolutions stay within each block. Returns
    ``read(flat row indices into [P * q_len]) -> final hidden states [rows, H]``.

    With ``real`` (the flat indices of the rows that are not padding; a draft without convolutions only), the
    row-wise work is done only where a result is read: every layer's MLP on the real rows (a padding row is seen by
    nobody but itself, so its stale values change nothing), and the last layer's output projection, MLP and the
    final norm inside ``read``, on the rows asked for: the same operations on fewer rows. Attention sees every row.
    """
    target_hidden = draft.hidden_norm(draft.fc(target_hidden))
    position_embeddings = draft.rotary_emb(noise, position_ids)
    width = noise.shape[-1]

    def attend(layer, mask, x):
        return layer.self_attn(hidden_states=x, target_hidden=target_hidden, attention_mask=mask,
                               position_ids=position_ids, past_key_values=keys,
                               position_embeddings=position_embeddings)[0]

    hidden = noise
    *first, (last, last_mask) = zip(draft.layers, masks)
    for layer, mask in first:
        hidden = _sublayer(layer.input_layernorm, layer.attention_conv, partial(attend, layer, mask), hidden, local)
        hidden = _mlp_half(layer, hidden, local, real)
    if real is None:
        hidden = _sublayer(last.input_layernorm, last.attention_conv, partial(attend, last, last_mask), hidden, local)
        out = draft.norm(_mlp_half(last, hidden, local)).view(-1, width)
        return lambda rows: out.index_select(0, rows)
    with _deferred_output_projection(last.self_attn) as o_proj:
        before_o = attend(last, last_mask, last.input_layernorm(hidden))
    before_o = before_o.reshape(-1, before_o.shape[-1])
    residual = hidden.view(-1, width)

    def read(rows: torch.Tensor) -> torch.Tensor:
        h = residual.index_select(0, rows) + o_proj(before_o.index_select(0, rows))
        return draft.norm(_mlp_half(last, h, None))

    return read


def context_keys(draft, noise, context):
    """Every layer's context keys/values [P, kv_heads, N, head_dim] of every prompt, from its target features
    ``context`` [P, N, F]. They depend on those features only, so one forward with a throw-away 1-token block per
    prompt (``noise`` [P, 1, H]) gives them all."""
    P, n_ctx = context.shape[:2]
    recorder = _Recorder()
    positions = torch.arange(n_ctx + 1, device=context.device)[None].expand(P, -1)
    draft_forward(draft, noise, context, positions, recorder, [None] * len(draft.layers),
                  torch.zeros(1, dtype=torch.long, device=context.device))
    return [(k[:, :, :n_ctx], v[:, :, :n_ctx]) for k, v in (recorder.seen[i] for i in range(len(draft.layers)))]
