"""Exact greedy replay: every candidate's tau from ONE target decode plus draft-only work (T = 0).

At T = 0 speculative decoding is lossless, so every block size produces the same greedy continuation g, and the
target's context features along g are the same for every b. Only the draft's proposals depend on b. So:

1. decode once at b_ref (= B) with the engine, keeping the context features of every committed position;
2. for each other candidate b, walk its trajectory without the target: at start s the draft proposes
   verify_size - 1 tokens from the features of positions < s and the block [g_s, MASK ...]; accepted = the
   matching prefix against g; committed = accepted + 1, clipped at max_new_tokens and at a stop token exactly as
   the engine's loop clips; s += committed.

The draft's context keys/values are computed once per prompt (they depend on the target features only, not on
the blocks) and shared by every start and every candidate. Three ways to get the proposals, same results:

* ``lockstep`` (default): all candidates walk together; each round ONE draft forward proposes for the current
  start of every candidate still running, blocks side by side with a block attention mask (each block sees the
  context strictly before its start and itself, as in DFlash training). About as many draft forwards as the
  reference decode has steps, whatever the number of candidates.
* ``sequential``: one draft forward per visited start per candidate; dflash builds the masks itself.
* ``all_starts`` (the issue's stretch): proposals at EVERY start for EVERY candidate from a few large forwards,
  then pointer chases through that table. It computes ~tau times more proposals than are visited: a loss on a
  CPU, a candidate on an accelerator where batch-1 forwards are launch-bound.

Draft variants (dflash 0.1.0): full, causal (``is_causal``) and sliding-window (``layer_types`` /
``sliding_window``) attention layers get, per layer, the mask dflash's attention applies when the engine decodes;
DFlash2DraftModel's causal convolutions are cut at block boundaries and its candidate selector proposes, as in
the engine. Anything else is refused before any work (:func:`replay_unsupported`, and
:func:`replay_unsupported_config` from the config alone, for the label stage's driver).

Exactness against the engine is tested step by step (tests/unit/test_replay.py); the arithmetic is the same,
only the shapes of the matrix products differ, so a draft argmax that is a float near-tie could in principle
resolve differently.
"""

from __future__ import annotations

import contextlib

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from dflash.model import (
    CandidateSelector,
    DFlash2DraftModel,
    DFlashDraftModel,
    GroupedDynamicCausalConv,
    Qwen3DFlashAttention,
    Qwen3DFlashDecoderLayer,
    _draft_value,
    _output_head,
    _raw_input_embeddings,
)
from torch.nn import functional as F

Propose = Callable[[int, int], Sequence[int]]

# ---- what replay models (everything else is refused) -------------------------------------------------------------

DRAFT_CLASSES = {cls.__name__: cls for cls in (DFlashDraftModel, DFlash2DraftModel)}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _as_draft_config(config):
    """The config as the draft model sees it: its config class (Qwen3Config), which e.g. drops sliding_window
    unless use_sliding_window is set; a plain PretrainedConfig or a dict is converted."""
    cls = DFlashDraftModel.config_class
    if isinstance(config, cls):
        return config
    return cls.from_dict(config if isinstance(config, dict) else config.to_dict())


def _layers_unsupported(config) -> Optional[str]:
    """Layer types and sliding windows, read as Qwen3DFlashAttention.__init__ reads them."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if len(layer_types) < config.num_hidden_layers:
        return f"a layer_types list shorter than num_hidden_layers ({len(layer_types)} < {config.num_hidden_layers})"
    for i, kind in enumerate(layer_types[:config.num_hidden_layers]):
        if kind not in LAYER_TYPES:
            return f"the attention layer type {kind!r} (draft layer {i})"
        window = config.sliding_window
        if kind == "sliding_attention" and not (isinstance(window, int) and window >= 1):
            return f"a sliding_attention layer without a positive sliding_window (draft layer {i}: {window!r})"
    return None


def replay_unsupported_config(config) -> Optional[str]:
    """None if replay is exact for a draft with this config, else what it does not model. Reads the config only
    (class from ``architectures``; absent = DFlashDraftModel, what the loader builds), no weights."""
    config = _as_draft_config(config)
    archs = list(getattr(config, "architectures", None) or ["DFlashDraftModel"])
    if len(archs) != 1 or archs[0] not in DRAFT_CLASSES:
        return f"the draft architecture {archs} (known: {sorted(DRAFT_CLASSES)})"
    return _layers_unsupported(config)


def replay_unsupported(draft) -> Optional[str]:
    """None if replay is proven exact for this loaded draft, else what it does not model. Exact classes only: a
    subclass may change forward or propose, which replay re-implements around."""
    if type(draft) not in DRAFT_CLASSES.values():
        return f"the draft class {type(draft).__name__!r} (known: {sorted(DRAFT_CLASSES)})"
    for i, layer in enumerate(draft.layers):
        parts = [(layer, Qwen3DFlashDecoderLayer), (layer.self_attn, Qwen3DFlashAttention)]
        parts += [(conv, GroupedDynamicCausalConv) for conv in (layer.attention_conv, layer.mlp_conv)
                  if conv is not None]
        for module, cls in parts:
            if type(module) is not cls:
                return f"the draft module {type(module).__name__!r} (draft layer {i}; known: {cls.__name__})"
    if isinstance(draft, DFlash2DraftModel) and type(draft.candidate_selector) is not CandidateSelector:
        return f"the candidate selector {type(draft.candidate_selector).__name__!r}"
    return _layers_unsupported(draft.config)


# ---- the walks: the engine's bookkeeping without the target ----------------------------------------------------

def step(g: Sequence[int], s: int, max_length: int, b: int, proposal: Optional[Sequence[int]],
         stops: set) -> tuple:
    """One verify step at start s: (tokens committed, stopped). Mirrors Engine._decode's bookkeeping:
    verify_size = min(b, max_length - s); produced = min(accepted + 1, max_length - s - 1), cut at the first stop
    token among the committed tokens."""
    vs = min(b, max_length - s)
    accepted = 0
    if vs > 1:
        for j in range(vs - 1):
            pos = s + 1 + j
            # Past the end of g only after a stop token, where the step is cut at the stop anyway.
            if pos >= len(g) or int(proposal[j]) != g[pos]:
                break
            accepted += 1
    produced = min(accepted + 1, max_length - s - 1)
    for j in range(1, produced + 1):
        if s + j < len(g) and g[s + j] in stops:
            return j, True
    return produced, False


def walk(g: Sequence[int], n: int, max_length: int, b: int, propose: Propose, stop_ids: Sequence[int]) -> List[int]:
    """Tokens committed per step at block size b along the greedy sequence g (prompt included, len(g) > n)."""
    stops = set(stop_ids or ())
    committed: List[int] = []
    s = n
    stopped = g[n] in stops
    while s + 1 < max_length and not stopped:
        vs = min(b, max_length - s)
        produced, stopped = step(g, s, max_length, b, propose(s, vs) if vs > 1 else None, stops)
        s += produced
        committed.append(produced)
    return committed


def lockstep_walks(g: Sequence[int], n: int, max_length: int, block_sizes: Sequence[int], propose_many,
                   stop_ids: Sequence[int]) -> Dict[int, List[int]]:
    """Every candidate's walk at once: each round, ONE draft call proposes for the current start of every
    candidate still running (``propose_many([(b, s, vs), ...]) -> [tokens, ...]``)."""
    stops = set(stop_ids or ())
    start = {b: n for b in block_sizes}
    done = {b: g[n] in stops for b in block_sizes}
    committed: Dict[int, List[int]] = {b: [] for b in block_sizes}
    while True:
        live = [b for b in block_sizes if not done[b] and start[b] + 1 < max_length]
        if not live:
            return committed
        blocks = [(b, start[b], min(b, max_length - start[b])) for b in live]
        drafted = [blk for blk in blocks if blk[2] > 1]
        proposals = dict(zip([blk[0] for blk in drafted], propose_many(drafted) if drafted else []))
        for b, s, _ in blocks:
            produced, done[b] = step(g, s, max_length, b, proposals.get(b), stops)
            start[b] += produced
            committed[b].append(produced)


# ---- the draft, re-run over blocks laid side by side --------------------------------------------------------------

def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, is_causal: bool, window: Optional[int]) -> torch.Tensor:
    """dflash's _attention_mask on positions. dflash measures a query's and a key's position by their index in
    the layer's key sequence; in the engine that sequence is contiguous positions ending at the block's last (a
    sliding layer's cache keeps the last window - 1 context positions), so index differences there are position
    differences here."""
    q, k = q_pos[:, None], k_pos[None, :]
    visible = torch.ones((q_pos.numel(), k_pos.numel()), dtype=torch.bool, device=q_pos.device)
    if is_causal:
        visible &= k <= q
    if window is not None:
        visible &= q - k < window
        if not is_causal:
            visible &= k - q < window
    return visible


def _block_layout(blocks, ctx_len: int, kinds, device):
    """Blocks [(b, s, vs), ...] laid side by side after ctx_len context keys. Returns the boolean attention mask
    [1, 1, Q, ctx_len + Q] of every attention kind (is_causal, sliding_window) in ``kinds`` (a row sees the context
    strictly before its block's start and its own block, restricted as that kind restricts it), the rows'
    positions, and each row's index within its block (0 = the block's first token, not a proposal)."""
    q_pos = torch.cat([torch.arange(s, s + vs, device=device) for _, s, vs in blocks])
    q_start = torch.cat([torch.full((vs,), s, device=device) for _, s, vs in blocks])
    q_block = torch.cat([torch.full((vs,), i, device=device) for i, (_, _, vs) in enumerate(blocks)])
    k_pos = torch.cat([torch.arange(ctx_len, device=device), q_pos])
    k_block = torch.cat([torch.full((ctx_len,), -1, device=device), q_block])
    seen = (k_block[None] == q_block[:, None]) | ((k_block[None] < 0) & (k_pos[None] < q_start[:, None]))
    masks = {kind: (seen & _visible(q_pos, k_pos, *kind))[None, None] for kind in kinds}
    return masks, q_pos, q_pos - q_start


def _convolve(hidden, dynamic, base, group_size, local):
    """dflash's _grouped_dynamic_convolve with every block on its own: a row's causal window stops at its block's
    first row (``local`` = each row's index within its block), as when the engine drafts one block per forward.
    Same operations; the values dflash reads from before the block (its zero padding) are zeros here too."""
    batch, length, hidden_size = hidden.shape
    groups = hidden_size // group_size
    blocks = hidden.view(batch, length, groups, group_size)
    dynamic = dynamic.view(batch, length, base.shape[0], groups, 1)
    output = torch.zeros_like(blocks)
    for offset in range(min(base.shape[0], length)):  # a larger offset reads only padding: adds zeros
        values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        # local is [length] (one row of blocks) or [batch, length] (pipeline.labelling.batched: a row of blocks per prompt).
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


class _Keys:
    """Stands in for the draft's KV cache: puts each layer's context keys/values (``prefix``, RoPE applied)
    before the ones the layer computes, and remembers what it handed out (``seen``)."""

    def __init__(self, prefix=None):
        self.prefix, self.seen = prefix, {}

    def update(self, k, v, layer_idx, *args, **kwargs):
        if self.prefix is not None:
            pk, pv = self.prefix[layer_idx]
            k, v = torch.cat([pk, k], dim=-2), torch.cat([pv, v], dim=-2)
        self.seen[layer_idx] = (k, v)
        return k, v


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


def _draft_forward(draft, noise, target_hidden, position_ids, keys: _Keys, masks, local):
    """DFlashDraftModel.forward with its layers' forward written out, so that every layer gets its own mask
    (None: dflash builds it from the key sequence) and DFlash2's convolutions stay within each block."""
    hidden = noise
    target_hidden = draft.hidden_norm(draft.fc(target_hidden))
    position_embeddings = draft.rotary_emb(hidden, position_ids)
    for layer, mask in zip(draft.layers, masks):
        def attend(x, layer=layer, mask=mask):
            return layer.self_attn(hidden_states=x, target_hidden=target_hidden, attention_mask=mask,
                                   position_ids=position_ids, past_key_values=keys,
                                   position_embeddings=position_embeddings)[0]
        hidden = _sublayer(layer.input_layernorm, layer.attention_conv, attend, hidden, local)
        hidden = _sublayer(layer.post_attention_layernorm, layer.mlp_conv, layer.mlp, hidden, local)
    return draft.norm(hidden)


class _DraftReader:
    """What every replay of the draft sets up once from the target's context features ``context`` [P, N, F] (one
    row per prompt; P = 1 for :class:`DraftReplay`): the output head, the mask token, each layer's attention kind
    and every prompt's context keys/values. Those depend on the target features only, so one forward with a
    throw-away 1-token block per prompt gives them all (per layer [P, kv_heads, N, head_dim]). ``attention`` wraps
    that forward (batched replay's CPU attention, pipeline.labelling.batched._draft_cpu_gqa)."""

    def _read_context(self, draft, target, context: torch.Tensor, attention=contextlib.nullcontext) -> None:
        self.draft, self.target = draft, target
        self.head = _output_head(target)
        self.scale = float(_draft_value(draft.config, "input_embedding_scale", 1.0))
        self.mask_id = int(draft.mask_token_id)
        self.device = context.device
        self.kinds = [(bool(layer.self_attn.is_causal), layer.self_attn.sliding_window) for layer in draft.layers]
        self.dflash2 = isinstance(draft, DFlash2DraftModel)
        # dflash's convolution fails on a block shorter than kernel_size - 1 rows; the engine fails there too.
        self.min_block = max((layer.attention_conv.kernel_size - 1 for layer in draft.layers
                              if layer.attention_conv is not None), default=2)
        self.forwards = 0
        P, n_ctx = context.shape[:2]
        keys = _Keys()
        dummy = _raw_input_embeddings(target, torch.full((P, 1), self.mask_id, device=self.device), self.scale)
        with torch.inference_mode(), attention():
            _draft_forward(draft, dummy, context, torch.arange(n_ctx + 1, device=self.device)[None].expand(P, -1),
                           keys, [None] * len(draft.layers), torch.zeros(1, dtype=torch.long, device=self.device))
        self.kv = [(k[:, :, :n_ctx], v[:, :, :n_ctx]) for k, v in (keys.seen[i] for i in range(len(draft.layers)))]
        self.no_context = context[:1, :0].expand(P, -1, -1)


class DraftReplay(_DraftReader):
    """The draft's proposals along one greedy sequence g; ``context`` = target features of positions [0, N)."""

    def __init__(self, draft, target, g: torch.Tensor, context: torch.Tensor):
        self.g = g
        self._read_context(draft, target, context)

    def fails(self, vs: int) -> bool:
        return vs < self.min_block

    def _fail(self, vs: int):
        raise RuntimeError(f"dflash's DFlash2 convolution (kernel {self.min_block + 1}) cannot run on a block of "
                           f"{vs} tokens; the engine fails on this step too")

    def __call__(self, s: int, vs: int) -> List[int]:
        return self.propose_many([(None, s, vs)])[0]

    @torch.inference_mode()
    def hidden(self, blocks) -> List[torch.Tensor]:
        """The draft's final hidden states of each block's proposal rows ([1, vs - 1, H] per block), blocks
        [(b, s, vs), ...] (vs >= 2) side by side in ONE draft forward."""
        for _, _, vs in blocks:
            if self.fails(vs):
                self._fail(vs)
        self.forwards += 1
        ctx_len = max(s for _, s, _ in blocks)
        masks, positions, local = _block_layout(blocks, ctx_len, set(self.kinds), self.device)
        # One block: its keys are exactly the engine's, so dflash builds its own masks, as in the engine.
        layer_masks = [None if len(blocks) == 1 else masks[kind] for kind in self.kinds]
        toks = []
        for _, s, vs in blocks:
            toks += [int(self.g[s])] + [self.mask_id] * (vs - 1)
        noise = _raw_input_embeddings(self.target, torch.tensor([toks], device=self.device), self.scale)
        keys = _Keys([(k[:, :, :ctx_len], v[:, :, :ctx_len]) for k, v in self.kv])
        rows = _draft_forward(self.draft, noise, self.no_context, positions[None], keys, layer_masks, local)
        return list(rows[:, local > 0].split([vs - 1 for _, _, vs in blocks], dim=1))

    @torch.inference_mode()
    def propose_many(self, blocks) -> List[List[int]]:
        """Proposals for blocks [(b, s, vs), ...] (vs >= 2) from ONE draft forward."""
        hidden = self.hidden(blocks)
        if self.dflash2:
            # The candidate selector (T = 0: its argmax path), one block at a time, as the engine calls it.
            return [self.draft.propose(h, self.g[s:s + 1].to(self.device), self.head, 0.0)[0][0].tolist()
                    for h, (_, s, _) in zip(hidden, blocks)]
        tokens = torch.argmax(self.draft.compute_logits(torch.cat(hidden, dim=1), self.head), dim=-1)[0].tolist()
        out, off = [], 0
        for _, _, vs in blocks:
            out.append(tokens[off:off + vs - 1])
            off += vs - 1
        return out


ALL_STARTS_MAX_QUERIES = 4096  # query rows per all_starts forward


class BatchedProposer:
    """Proposals for every (candidate, start) pair from a few draft forwards, then looked up by the walks."""

    def __init__(self, runner: DraftReplay, n: int, n_ctx: int, max_length: int, block_sizes: Sequence[int],
                 max_queries: Optional[int] = None):
        max_queries = max_queries or ALL_STARTS_MAX_QUERIES
        self.runner = runner
        # A pair the engine could not draft either is left out here and fails only if a walk reaches it.
        pairs = [(b, s, min(b, max_length - s)) for s in range(n, n_ctx) for b in block_sizes
                 if min(b, max_length - s) > 1 and not runner.fails(min(b, max_length - s))]
        self.table: Dict[tuple, List[int]] = {}
        chunk: list = []
        for i, pair in enumerate(pairs):  # pairs are ordered by start, so a chunk's context prefix stays short
            chunk.append(pair)
            if sum(p[2] for p in chunk) >= max_queries or i == len(pairs) - 1:
                for (b, s, _), toks in zip(chunk, runner.propose_many(chunk)):
                    self.table[(b, s)] = toks
                chunk = []

    def for_block_size(self, b: int) -> Propose:
        def propose(s: int, vs: int) -> Sequence[int]:
            if (b, s) not in self.table:
                self.runner._fail(vs)
            return self.table[(b, s)]
        return propose


PROPOSERS = ("lockstep", "sequential", "all_starts")


def replay_candidates(engine, state, candidates: Sequence[int], max_new_tokens: int, proposer: str = "lockstep",
                      reference_block_size: Optional[int] = None) -> Dict[int, dict]:
    """{b: {"committed", "new_tokens", "seconds"}} for every candidate, from one target decode at b_ref.

    proposer: ``lockstep`` (default; one draft forward per round for all candidates' current starts),
    ``sequential`` (one draft forward per start per candidate) or ``all_starts`` (every start x every candidate
    up front, then pointer chasing; compute-heavy, suited to accelerators rather than CPUs). Raises ValueError,
    before any work, for a draft replay does not model (:func:`replay_unsupported`).
    """
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {PROPOSERS}, got {proposer!r}")
    unsupported = replay_unsupported(engine.draft)
    if unsupported:
        raise ValueError(f"replay does not model {unsupported}; use exhaustive labelling")
    b_ref = reference_block_size or engine.trained_block_size
    if b_ref < 2:
        raise ValueError("replay needs a reference decode at a block size >= 2")
    ref = engine.decode(state, block_size=b_ref, max_new_tokens=max_new_tokens, keep_context=True)
    g_t = ref.output_ids[0]
    g = g_t.tolist()
    n = state.num_input_tokens
    max_length = n + max_new_tokens
    out = {b_ref: {"committed": ref.committed, "new_tokens": ref.new_tokens, "seconds": ref.decode_seconds}}
    others = [b for b in candidates if b != b_ref]
    t0 = time.perf_counter()
    walks: Dict[int, List[int]] = {}
    if others:
        runner = DraftReplay(engine.draft, engine.target, g_t, ref.context)
        if proposer == "lockstep":
            walks = lockstep_walks(g, n, max_length, others, runner.propose_many, engine.stop_token_ids)
        elif proposer == "sequential":
            walks = {b: walk(g, n, max_length, b, runner, engine.stop_token_ids) for b in others}
        else:
            table = BatchedProposer(runner, n, ref.context.shape[1], max_length, others)
            walks = {b: walk(g, n, max_length, b, table.for_block_size(b), engine.stop_token_ids) for b in others}
    # The draft work is shared by the candidates: each is charged an equal share of it.
    share = (time.perf_counter() - t0) / max(1, len(others))
    for b in others:
        out[b] = {"committed": walks[b], "new_tokens": ref.new_tokens, "seconds": share}
    return out
