"""The draft's proposals for the blocks of many prompts, one draft forward per call.

Set up once per batch of greedy sequences from the target's features: the output head, the mask token, each layer's
attention kind and every prompt's context keys. Then each :meth:`DraftRunner.propose` lays the blocks out
(pipeline.labelling.draft), runs ONE forward and reads the proposals the way the engine does (argmax, or DFlash2's
candidate selector at T = 0). Batch-1 replay runs it for one prompt at the engine's arithmetic (``fast=False``);
batched replay for many, reading only what the walks read.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Sequence

import torch
from dflash.model import DFlash2DraftModel, _draft_value, _output_head, _raw_input_embeddings

from pipeline.labelling.attention import draft_cpu_gqa
from pipeline.labelling.draft import BlockKeys, context_keys, draft_forward, layout
from pipeline.labelling.walks import Work

# Draft proposal rows per lm_head call: at V = 151,936 a [rows, V] float32 logits block of 1,024 rows is ~600 MB.
HEAD_ROWS = 1024


class DraftRunner:
    """The draft along greedy sequences ``gs`` (prompt + g, one per prompt) from the target's context features
    ``context`` [P, N, F] (right-padded; a padded position's keys are never visible: a block at start s sees
    context positions < s only, and s is at most the prompt's own length).

    ``fast=False`` keeps the engine's arithmetic wherever it can: transformers' attention, dflash's own masks for a
    block drafted alone (its keys are then exactly the engine's) and every row through every layer. That is batch-1
    replay, the reference batched labels are tested against. ``fast=True`` (batched replay) uses the CPU attention
    of pipeline.labelling.attention and does a row's row-wise work only where a walk reads it."""

    def __init__(self, draft, target, gs: Sequence, context: torch.Tensor, fast: bool = True):
        self.draft, self.target, self.fast = draft, target, fast
        self.gs = [g.tolist() if isinstance(g, torch.Tensor) else list(g) for g in gs]
        self.head = _output_head(target)
        self.scale = float(_draft_value(draft.config, "input_embedding_scale", 1.0))
        self.mask_id = int(draft.mask_token_id)
        self.device = context.device
        self.kinds = [(bool(layer.self_attn.is_causal), layer.self_attn.sliding_window) for layer in draft.layers]
        self.dflash2 = isinstance(draft, DFlash2DraftModel)
        # dflash's convolution fails on a block shorter than kernel_size - 1 rows; the engine fails there too.
        self.min_block = max((layer.attention_conv.kernel_size - 1 for layer in draft.layers
                              if layer.attention_conv is not None), default=2)
        self.attention = (lambda: draft_cpu_gqa(self.device)) if fast else contextlib.nullcontext
        # compute_logits multiplies by output_multiplier (1.0 unless configured) and softcaps only if configured:
        # x * 1.0 == x, so without either the lm_head's output is the logits, one pass over [rows, V] less.
        softcap = _draft_value(draft.config, "final_logit_softcapping")
        self.logits = ((lambda h, head: head(h))
                       if float(_draft_value(draft.config, "output_multiplier", 1.0)) == 1.0
                       and not (softcap is not None and float(softcap) > 0) else draft.compute_logits)
        self.forwards = 0
        P = context.shape[0]
        dummy = _raw_input_embeddings(target, torch.full((P, 1), self.mask_id, device=self.device), self.scale)
        with torch.inference_mode(), self.attention():
            self.kv = context_keys(draft, dummy, context)
        self.no_context = context[:1, :0].expand(P, -1, -1)
        self._keys = None  # BlockKeys of the prompts the last forward drafted

    def can_draft(self, vs: int) -> bool:
        return vs >= self.min_block

    def fail(self, vs: int):
        raise RuntimeError(f"dflash's DFlash2 convolution (kernel {self.min_block + 1}) cannot run on a block of "
                           f"{vs} tokens; the engine fails on this step too")

    def _keys_for(self, idx: List[int], ctx_len: int, q_len: int) -> BlockKeys:
        """The context keys of the prompts ``idx`` with room for a row of blocks after ctx_len columns. Rebuilt only
        when the set of live prompts changes (it only shrinks as prompts finish) or more room is needed: a forward
        then copies its blocks' keys in, not every prompt's context."""
        if self._keys is None or not self._keys.holds(idx, ctx_len + q_len):
            self._keys = BlockKeys(self.kv, idx, max(ctx_len + q_len, self.kv[0][0].shape[2]) + q_len)
        return self._keys.after(ctx_len)

    def _forward(self, work: Work):
        """ONE draft forward over every block of ``work`` {prompt: [(b, s, vs), ...]} (vs >= 2): (read, layout,
        the prompts in batch-row order)."""
        for blocks in work.values():
            for _, _, vs in blocks:
                if not self.can_draft(vs):
                    self.fail(vs)
        self.forwards += 1
        idx = list(work)
        ctx_len = max(s for blocks in work.values() for _, s, _ in blocks)
        lay = layout([work[p] for p in idx], ctx_len, self.kinds, self.device)
        tokens = torch.full((len(idx) * lay.q_len,), self.mask_id, dtype=torch.long, device=self.device)
        tokens[lay.anchors] = torch.tensor([self.gs[p][s] for p in idx for _, s, _ in work[p]], dtype=torch.long,
                                           device=self.device)
        noise = _raw_input_embeddings(self.target, tokens.view(len(idx), lay.q_len), self.scale)
        alone = not self.fast and lay.anchors.numel() == 1
        masks = [None if alone else lay.masks[kind] for kind in self.kinds]
        real = lay.real if self.fast and not self.dflash2 else None
        with self.attention(), self._keys_for(idx, ctx_len, lay.q_len) as keys:
            read = draft_forward(self.draft, noise, self.no_context[:len(idx)], lay.positions, keys, masks,
                                 lay.local, real)
        return read, lay, idx

    @torch.inference_mode()
    def hidden(self, work: Work) -> List[torch.Tensor]:
        """The draft's final hidden states of each block's proposal rows ([1, vs - 1, H] per block, prompt by
        prompt, block by block) from ONE draft forward."""
        read, lay, idx = self._forward(work)
        rows = read(torch.nonzero(lay.local.view(-1) > 0).flatten())
        return [h[None] for h in rows.split([vs - 1 for p in idx for _, _, vs in work[p]])]

    @torch.inference_mode()
    def propose(self, work: Work) -> Dict[int, List[List[int]]]:
        """{prompt: [(b, s, vs), ...]} (vs >= 2) -> {prompt: [proposal tokens per block]}, from ONE draft forward."""
        read, lay, idx = self._forward(work)
        blocks = [(p, s, vs) for p in idx for _, s, vs in work[p]]
        if self.dflash2 or not self.fast:
            rows = read(torch.nonzero(lay.local.view(-1) > 0).flatten())
            if self.dflash2:
                flat = self._selected(rows, blocks)
            else:
                tokens = torch.argmax(self.logits(rows[None], self.head), dim=-1)[0].tolist()
                ends = torch.tensor([vs - 1 for _, _, vs in blocks]).cumsum(0).tolist()
                flat = [tokens[end - vs + 1:end] for end, (_, _, vs) in zip(ends, blocks)]
        else:
            flat = self._up_to_first_miss(read, (lay.anchors + 1).tolist(), blocks)
        out, k = {}, 0
        for p in idx:
            out[p] = flat[k:k + len(work[p])]
            k += len(work[p])
        return out

    def _selected(self, rows: torch.Tensor, blocks) -> List[List[int]]:
        """DFlash2's proposals: its candidate selector (T = 0: the argmax path), one block at a time as the engine
        runs it, on each block's proposal rows (``rows``, block after block)."""
        return [self.draft.propose(h[None], torch.tensor([self.gs[p][s]], device=self.device), self.head,
                                   0.0)[0][0].tolist()
                for h, (p, s, _) in zip(rows.split([vs - 1 for _, _, vs in blocks]), blocks)]

    @torch.inference_mode()
    def propose_with_confidence(self, work: Work) -> Dict[int, List[tuple]]:
        """{prompt: [(b, s, vs), ...]} (vs >= 2) -> {prompt: [(proposal tokens, top-1 probabilities) per block]},
        from ONE draft forward. Every proposal row reaches the lm_head (no first-miss shortcut): the probabilities
        are what the engine's step rules read at T = 0 (pipeline.policy.step_rules.draft_confidence: the softmax of
        the draft's logits, DFlash2's too, whose selector proposes no probabilities at T = 0)."""
        read, lay, idx = self._forward(work)
        blocks = [(p, s, vs) for p in idx for _, s, vs in work[p]]
        rows = read(torch.nonzero(lay.local.view(-1) > 0).flatten())
        tokens, conf = [], []
        for chunk in rows.split(HEAD_ROWS):  # a [HEAD_ROWS, V] logits block at a time
            logits = self.logits(chunk[None], self.head)[0]
            tokens += torch.argmax(logits, dim=-1).tolist()
            conf += torch.softmax(logits.float(), dim=-1).max(dim=-1).values.tolist()
        if self.dflash2:
            tokens = [t for block in self._selected(rows, blocks) for t in block]
        out: Dict[int, List[tuple]] = {p: [] for p in idx}
        at = 0
        for p, _, vs in blocks:
            out[p].append((tokens[at:at + vs - 1], conf[at:at + vs - 1]))
            at += vs - 1
        return out

    def _up_to_first_miss(self, read, first_rows: List[int], blocks) -> List[List[int]]:
        """Each block's proposals, read position by position and only as far as they match g: a step accepts the
        matching prefix and never reads a proposal after the first miss (walks.step), so the rows after it never
        reach the lm_head nor the last layer's row-wise work (draft_forward's ``read``); about half of the rows at
        tau ~ 4, and the lm_head is the largest matrix product of a draft row at a real vocabulary. Block i's
        proposal j is row ``first_rows[i] + j``. Unread positions are -1, never a token id."""
        flat = [[-1] * (vs - 1) for _, _, vs in blocks]
        active = list(range(len(blocks)))
        j = 0
        while active:
            picked = torch.tensor([first_rows[i] + j for i in active], device=self.device)
            toks = torch.cat([torch.argmax(self.logits(read(chunk), self.head), dim=-1)
                              for chunk in picked.split(HEAD_ROWS)]).tolist()
            still = []
            for i, tok in zip(active, toks):
                flat[i][j] = tok
                p, s, vs = blocks[i]
                if j + 2 < vs and s + 1 + j < len(self.gs[p]) and tok == self.gs[p][s + 1 + j]:
                    still.append(i)
            active, j = still, j + 1
        return flat
