"""Batched replay labelling (T = 0): many prompts per forward; every candidate's tau from two batched passes.

Replay (pipeline.replay) needs, per prompt, the target's greedy continuation g and the target's context features
along prompt + g; everything else is draft work. Neither depends on b, so a label actor can do them for a whole
batch of prompts at once, which is where the speed comes from: a batch-1 decode leaves a GPU mostly idle
(memory-bound) and a CPU mostly paying per-call overhead.

1. **g**, by batched greedy decoding of the target with a KV cache: Hugging Face ``generate`` (library code), left
   padding with an attention mask and the position ids it derives from the mask, stopping per prompt at the stop
   tokens or max_new_tokens exactly as the engine does (the stop token is part of g, the budget counts the first
   token). A batched speculative decode would be ragged (every prompt accepts a different number of tokens per
   step): with one shared KV cache, rejected positions stay as masked holes, the cache grows by B per step and the
   batch runs as many steps as its slowest prompt, which on this CPU costs about what the 128 one-token steps cost
   (estimated from the measured step costs); plain batched greedy is what the library does well and, at T = 0,
   gives the same g. On CPU, generate runs with :func:`_sdpa_cpu_gqa` (transformers' sdpa attention without
   copying the KV cache per head group: -1/3 of the decode time, identical outputs).
2. **Features**: the hidden states of the draft's ``target_layer_ids`` at every position of prompt + g (what the
   engine's prefill and verify steps hand the draft) and the raw last-prompt-position logits (the policy's
   feature, what ``Engine.prefill`` returns). They are captured from the forwards of step 1 themselves (hooks, see
   :func:`greedy_continuations`), which is the teacher-forced pass over prompt + g without running it a second
   time; :func:`target_features` is that teacher-forced pass (one forward for the batch, prompts left-padded so
   that every prompt ends at the same column), kept as the reference the tests compare with (measured here: ~12 %
   of a batch's time saved by not running it).
3. **The draft's walks**, lockstep AND batched across prompts: each round, ONE draft forward proposes for the
   current start of every candidate of every prompt still running (a row of blocks side by side per prompt, the
   block masks of pipeline.replay per prompt, padding rows that see only themselves). The bookkeeping of every
   step is :func:`pipeline.replay.step`, the engine's.

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
from dflash.model import _raw_input_embeddings, extract_context_feature

from .labeling import PromptLabels, _labels
from .replay import _block_layout, _draft_forward, _DraftReader, _Keys, replay_unsupported, step

# Bound on the teacher-forced forward's hidden-state outputs (all layers x rows x width x hidden elements): the
# batch is split into row chunks below it, so that a large batch at a long max_new_tokens does not hold every layer's
# hidden states at once (36 layers of an 8B target at 32 x 2,300 positions would be ~22 GB in bf16).
FEATURE_ELEMENTS = 1 << 28
# Draft proposal rows per lm_head call: at V = 151,936 a [rows, V] float32 logits block of 1,024 rows is ~600 MB.
HEAD_ROWS = 1024


def _as_list(ids) -> List[int]:
    if isinstance(ids, torch.Tensor):
        return [int(t) for t in ids.reshape(-1).tolist()]
    return [int(t) for t in ids]


def length_sorted_chunks(lengths: Sequence[int], batch_size: int) -> List[List[int]]:
    """Indices in chunks of batch_size, by ascending length: prompts of similar length share a batch, so that
    left padding wastes little. Deterministic (ties by index), so a rerun batches a shard the same way."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


# ---- 1. g: batched greedy decoding (Hugging Face generate) -----------------------------------------------------

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
    """The attention implementation generate should run with: ours for an sdpa target on CPU, else unchanged."""
    if target.device.type != "cpu" or getattr(target.config, "_attn_implementation", None) != "sdpa":
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if CPU_GQA_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(CPU_GQA_ATTENTION, _sdpa_cpu_gqa)
        AttentionMaskInterface.register(CPU_GQA_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks
    return CPU_GQA_ATTENTION


@torch.inference_mode()
def greedy_continuations(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         stop_token_ids: Optional[Sequence[int]], pad_token_id: int = 0,
                         layer_ids: Optional[Sequence[int]] = None, clock=None):
    """The target's greedy new tokens for every prompt: up to max_new_tokens, ending with the first stop token if
    one comes (as Engine.decode / greedy_reference end).

    With ``layer_ids`` (the draft's target_layer_ids), also what the draft needs, captured from the very forwards
    that produce g instead of a second, teacher-forced pass (:func:`target_features`): returns ``(new tokens,
    context [P, L, F] right-padded: the context features of positions 0 .. len(prompt + g) - 2, which is every
    position a block's context can reach; logits [P, V]: the raw last-prompt-position logits from the prefill;
    seconds of the prefill)``. A forward hook on the base model asks it for its hidden states (the engine's
    ``output_hidden_states=True``, read by the same ``extract_context_feature``) and keeps only the draft's
    layers: ``generate(output_hidden_states=True)`` would keep every layer of every step."""
    from transformers import GenerationConfig

    device = target.device
    P = len(prompts)
    n_max = max(len(p) for p in prompts)
    ids = torch.full((P, n_max), pad_token_id, dtype=torch.long)
    mask = torch.zeros((P, n_max), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n_max - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, n_max - len(p):] = 1
    stops = [int(t) for t in (stop_token_ids or [])]
    # eos_token_id=[] (not None) when there are no stop tokens: generate fills every None from the model's own
    # generation config, which would stop at the model's eos, and could add its sampling or penalty settings.
    # A static KV cache (allocated once at prompt + max_new_tokens): the default dynamic cache concatenates every
    # layer's keys and values each step, a copy of the whole cache per token (~11 % of generate here, measured by
    # benchmarks/label_throughput.py). Attention then spans the masked unfilled slots too; same greedy tokens.
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=stops,
                              pad_token_id=pad_token_id, cache_implementation="static")
    saved = target.generation_config
    # The same fill-in, for every other field (repetition_penalty, min_new_tokens, ...): generate reads only ours.
    target.generation_config = GenerationConfig()
    feats, first_logits, prefill_done = [], [], []
    hooks = []
    if layer_ids is not None:
        base = target.base_model
        clock = clock or time.perf_counter
        t_start = clock()

        def ask_hidden(module, args, kwargs):
            return args, {**kwargs, "output_hidden_states": True}

        def keep_features(module, args, kwargs, output):
            feats.append(extract_context_feature(output.hidden_states, list(layer_ids)))
            output.hidden_states = None  # every layer's states are not needed past this point

        def keep_logits(module, args, output):
            if not first_logits:
                first_logits.append(output.logits[:, -1])
                prefill_done.append(clock() - t_start)

        hooks = [base.register_forward_pre_hook(ask_hidden, with_kwargs=True),
                 base.register_forward_hook(keep_features, with_kwargs=True),
                 target.register_forward_hook(keep_logits)]
    attention = _cpu_gqa_attention(target)
    try:
        if attention:
            target.set_attn_implementation(attention)
        out = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    finally:
        target.generation_config = saved
        if attention:
            target.set_attn_implementation("sdpa")
        for h in hooks:
            h.remove()
    stop_set = set(stops)
    result = []
    for row in out[:, n_max:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_set), len(row))
        result.append(row[:cut])
    if layer_ids is None:
        return result
    # feats: the prefill's [P, n_max, F] (left-padded), then [P, 1, F] per step: left-padded -> right-padded, row
    # i's position j at column n_max - len(prompt_i) + j.
    allf = torch.cat(feats, dim=1)
    L = max(len(p) + len(c) for p, c in zip(prompts, result)) - 1
    offset = torch.tensor([n_max - len(p) for p in prompts], device=allf.device)
    cols = (offset[:, None] + torch.arange(L, device=allf.device)[None]).clamp(max=allf.shape[1] - 1)
    context = torch.gather(allf, 1, cols[:, :, None].expand(-1, -1, allf.shape[-1]))
    return result, context, first_logits[0], prefill_done[0]


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
        # Left-padded -> right-padded: row i's position j sits at column n_max - len(prompt_i) + j.
        offset = torch.tensor([n_max - len(prompts[i]) for i in range(lo, hi)], device=device)
        cols = (offset[:, None] + torch.arange(L, device=device)[None]).clamp(max=width - 1)
        contexts.append(torch.gather(feats, 1, cols[:, :, None].expand(-1, -1, feats.shape[-1])))
        logits.append(out.logits[:, -1])
        del out, feats
    return torch.cat(contexts), torch.cat(logits), lengths


# ---- 3. the draft, over many prompts' rows of blocks ---------------------------------------------------------------

class BatchedDraftReplay(_DraftReader):
    """pipeline.replay.DraftReplay for many prompts: each prompt's g and context features (right-padded [P, L, F]),
    the draft's context keys/values of every prompt computed once, and proposals for every prompt's blocks from ONE
    draft forward (a batch row per prompt)."""

    def __init__(self, draft, target, gs: Sequence[Sequence[int]], context: torch.Tensor):
        self.gs = [list(g) for g in gs]
        # A padded position's keys are never visible: a block at start s sees context positions < s only, and s is
        # at most the prompt's own length.
        self._read_context(draft, target, context, attention=lambda: _draft_cpu_gqa(context.device))

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
        q_len = max(sum(vs for _, _, vs in blocks) for blocks in work.values())
        kinds = set(self.kinds)
        Pn, dev = len(idx), self.device
        masks = {kind: torch.zeros((Pn, 1, q_len, ctx_len + q_len), dtype=torch.bool, device=dev) for kind in kinds}
        positions = torch.zeros((Pn, q_len), dtype=torch.long, device=dev)
        local = torch.zeros((Pn, q_len), dtype=torch.long, device=dev)
        tokens = torch.full((Pn, q_len), self.mask_id, dtype=torch.long, device=dev)
        pad_rows = torch.arange(q_len, device=dev)
        for r, p in enumerate(idx):
            blocks = work[p]
            layout, pos, loc = _block_layout(blocks, ctx_len, kinds, dev)
            q = pos.numel()
            for kind in kinds:
                masks[kind][r, 0, :q, :ctx_len + q] = layout[kind][0, 0]
                # Padding rows see only themselves (a row that sees nothing would make softmax NaN); never read.
                masks[kind][r, 0, pad_rows[q:], ctx_len + pad_rows[q:]] = True
            positions[r, :q], local[r, :q] = pos, loc
            toks = []
            for _, s, vs in blocks:
                toks += [self.gs[p][s]] + [self.mask_id] * (vs - 1)
            tokens[r, :q] = torch.tensor(toks, dtype=torch.long)
        sel = torch.tensor(idx, device=dev)
        whole = Pn == self.kv[0][0].shape[0] and idx == list(range(Pn))
        keys = _Keys([((k if whole else k.index_select(0, sel))[:, :, :ctx_len],
                       (v if whole else v.index_select(0, sel))[:, :, :ctx_len]) for k, v in self.kv])
        noise = _raw_input_embeddings(self.target, tokens, self.scale)
        with _draft_cpu_gqa(dev):
            hidden = _draft_forward(self.draft, noise, self.no_context[:Pn], positions, keys,
                                    [masks[kind] for kind in self.kinds], local)
        # Each block's proposal rows (its rows after the first), prompt by prompt, block by block.
        proposal_rows = (local > 0)
        rows = hidden[proposal_rows]  # [R, H], row-major: prompt r's blocks in order
        sizes = [vs - 1 for p in idx for _, _, vs in work[p]]
        if self.dflash2:
            # The candidate selector (T = 0: its argmax path), one block at a time, as the engine calls it.
            anchors = [self.gs[p][s] for p in idx for _, s, _ in work[p]]
            flat = [self.draft.propose(h[None], torch.tensor([a], device=dev), self.head, 0.0)[0][0].tolist()
                    for h, a in zip(rows.split(sizes), anchors)]
        else:
            starts = [s for p in idx for _, s, _ in work[p]]
            refs = [self.gs[p] for p in idx for _ in work[p]]
            flat = self._proposals_up_to_first_miss(rows, sizes, starts, refs)
        out, k = {}, 0
        for p in idx:
            out[p] = flat[k:k + len(work[p])]
            k += len(work[p])
        return out

    def _proposals_up_to_first_miss(self, rows, sizes, starts, refs) -> List[List[int]]:
        """Each block's proposals, read through the lm_head position by position and only as far as they match g:
        a step accepts the matching prefix and never reads a proposal after the first miss (replay.step), so the
        rows after it are left out of the lm_head (about half of them at tau ~ 4; the lm_head is the largest
        matrix product of a draft row at a real vocabulary). Unread positions are -1, never a token id."""
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        flat = [[-1] * n for n in sizes]
        active = [i for i, n in enumerate(sizes) if n > 0]
        j = 0
        while active:
            picked = rows[torch.tensor([offsets[i] + j for i in active], device=rows.device)]
            toks = torch.cat([torch.argmax(self.draft.compute_logits(chunk, self.head), dim=-1)
                              for chunk in picked.split(HEAD_ROWS)]).tolist()
            still = []
            for i, tok in zip(active, toks):
                flat[i][j] = tok
                pos = starts[i] + 1 + j
                if j + 1 < sizes[i] and pos < len(refs[i]) and tok == refs[i][pos]:
                    still.append(i)
            active, j = still, j + 1
        return flat


def batched_lockstep_walks(gs: Sequence[Sequence[int]], ns: Sequence[int], max_new_tokens: int,
                           block_sizes: Sequence[int], propose, stop_ids: Optional[Sequence[int]]):
    """pipeline.replay.lockstep_walks for many prompts at once: each round, ONE ``propose({p: blocks})`` call for
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
    # g, the draft's context features and the prefill logits from one batched generate (see greedy_continuations);
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
