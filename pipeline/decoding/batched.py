"""Batched exact DFlash decoding: c requests at once, each with its own block size (or per-step rule), its own
accepted length and its own cache length, and a freed slot takes the next request (continuous batching).

What a serving engine computes, in the layout vLLM and SGLang use: **ragged**. Every forward packs the tokens of
all its rows into one sequence (the linear layers and MLPs run over exactly the sum of the rows' tokens, no
padding), and only attention is per row: each row's queries read that row's keys, gathered into a padded
``[rows, heads, q_max, width]`` view with a mask. So a step costs what its rows' tokens cost, and one request's
larger block does not make the others pay for padding (which is what makes a per-request block size worth
choosing under load).

The KV caches are slot tensors ``[slots, kv_heads, width, head_dim]`` per layer (the target's, and the draft's
context keys), indexed by absolute position: a verify writes its block at the row's positions, and "cropping"
after acceptance is only the row's length moving to its new start; a rejected position is overwritten by the next
block before anything can read it (a query at position p reads keys <= p, and every one of those is written). A row
that ends frees its slot; a new request's prefill writes its own positions 0..n-1 over the old ones.

The target runs through its own ``forward`` with one registered attention function (:data:`RAGGED`, reading the
row layout from the mask argument); the draft's forward is dflash's ``DFlashDraftModel.forward`` written out for the
packed layout (its modules, in dflash's order). Each step mirrors :meth:`pipeline.decoding.engine.Engine._decode`
row by row, so at T = 0 every request's tokens equal its batch-1 decode (tests/unit/test_batched_decode.py). At
T > 0 each row's rejection sampling is dflash's, drawing from the global RNG (the distribution is the target's;
the draws are not batch-1's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from dflash.model import (DFlash2DraftModel, _draft_value, _output_head, _raw_input_embeddings,
                          _rejection_sample, _sample_probs, _sampling_probs, _validate_sampling,
                          extract_context_feature, sample)
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from pipeline.decoding.engine import DecodeResult, Engine
from pipeline.decoding.packed import RAGGED, Rows, SlotCache, TargetPass, attend, register
from pipeline.policy.step_rules import draft_confidence


def require_batchable(engine: Engine) -> None:
    """What the packed forwards assume, refused before any work: a plain DFlash draft (DFlash2's convolutions would
    need cutting at row edges) whose layers attend fully, and a target whose layers do too."""
    draft, target = engine.draft, engine.target
    if isinstance(draft, DFlash2DraftModel):
        raise ValueError("batched decoding supports DFlashDraftModel drafts, not DFlash2 (convolutions across rows)")
    for name, cfg in (("draft", draft.config), ("target", target.config)):
        kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"} or getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window",
                                                                                            False):
            raise ValueError(f"batched decoding needs full-attention layers; the {name} has {sorted(kinds)}")


# ---- requests and the run ---------------------------------------------------------------------------------------------

Choice = Tuple[int, object]  # (block size, a per-step rule or None)


@dataclass
class BatchStep:
    """One batched decode step (or a prefill, ``kind == "prefill"``): its rows, the tokens its draft and verify ran
    over, the largest block, seconds."""

    kind: str
    rows: int
    drafting: int  # rows that drafted (b >= 2)
    draft_tokens: int
    verify_tokens: int
    max_block: int
    draft_seconds: float
    verify_seconds: float
    at: float  # seconds since the run started, at the step's end
    width: int = 0  # keys per row its attention read: the longest row's end (attention is padded to it per row)
    committed: int = 0  # tokens the step committed over its rows (bonus tokens included)


@dataclass
class RequestResult:
    """One request of a batched run: its decode (as the batch-1 engine reports it) and when it ran."""

    index: int
    decode: DecodeResult
    choice: Choice
    admitted_at: float  # seconds since the run started: its prefill began
    finished_at: float
    prefill_seconds: float  # its share of the prefill forward it was admitted in (by tokens)
    choose_seconds: float = 0.0

    @property
    def latency(self) -> float:
        return self.finished_at - self.admitted_at


@dataclass
class BatchRun:
    requests: List[RequestResult]
    steps: List[BatchStep] = field(default_factory=list)
    wall_seconds: float = 0.0
    slots: int = 1

    @property
    def new_tokens(self) -> int:
        return sum(r.decode.new_tokens for r in self.requests)

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole run."""
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


@dataclass
class _Row:
    index: int
    slot: int
    ids: List[int]  # positions 0 .. start (the token at start is known, not yet in the caches)
    n: int
    max_length: int
    choice: Choice
    result: DecodeResult
    admitted_at: float
    prefill_seconds: float
    choose_seconds: float
    context: Optional[torch.Tensor] = None  # [m, F]: features of positions ctx_from .. start - 1, not yet drafted on
    ctx_from: int = 0
    stopped: bool = False
    kept: Optional[List[torch.Tensor]] = None  # with keep_context: the features of positions 0 .. start - 1

    @property
    def start(self) -> int:
        return len(self.ids) - 1


class BatchedEngine:
    """Continuous batching over an :class:`Engine`'s models (same target, draft, stop tokens and clock)."""

    def __init__(self, engine: Engine, keep_context: bool = False):
        """``keep_context``: every request's DecodeResult also carries the target's context features of every committed
        position, prompt included ([1, start, F], as Engine.decode(keep_context=True) returns them): what labelling's
        replay reads when the target's continuation is decoded speculatively (pipeline.labelling.continuation)."""
        require_batchable(engine)
        self.keep_context = keep_context
        register()
        self.engine, self.target, self.draft = engine, engine.target, engine.draft
        self.device = engine.device
        self.layers = list(self.draft.target_layer_ids)
        self.head = _output_head(self.target)
        self.embed_scale = float(_draft_value(self.draft.config, "input_embedding_scale", 1.0))

    def run(self, prompts: Sequence, slots: int, max_new_tokens: int,
            choose: Callable[[int, torch.Tensor, torch.Tensor], Choice], temperature: float = 0.0,
            top_p: float = 1.0, top_k: int = 0) -> BatchRun:
        """Decode every prompt (token id lists or [1, n] tensors), ``slots`` at a time, in order; ``choose(i, logits
        [V], hidden [H])`` gives request i's (block size, rule) from its prefill. Requests are admitted, prefilled
        together, as slots free."""
        return lockstep([self.start(prompts, slots, max_new_tokens, choose, temperature, top_p, top_k)], self.target)[0]

    def run_lockstep(self, chooses: Sequence[Callable[[int, torch.Tensor, torch.Tensor], Choice]], prompts: Sequence,
                     slots: int, max_new_tokens: int, **sampling) -> List[BatchRun]:
        """One :meth:`run` per ``choose`` over the same prompts, driven in :func:`lockstep` (each on an engine of its
        own, since the caches are per engine); their BatchRuns in order."""
        return lockstep([BatchedEngine(self.engine).start(prompts, slots, max_new_tokens, ch, **sampling)
                         for ch in chooses], self.target)

    def start(self, prompts: Sequence, slots: int, max_new_tokens: int,
              choose: Callable[[int, torch.Tensor, torch.Tensor], Choice], temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0) -> Iterator[Optional[BatchRun]]:
        """:meth:`run` one forward at a time, for :func:`lockstep`: a generator that yields None after each prefill or
        step and the BatchRun last. Its clock stops while it is suspended, so a run's seconds are its own."""
        _validate_sampling(temperature, top_p, top_k)
        if slots < 1 or max_new_tokens < 1:
            raise ValueError(f"slots and max_new_tokens must be >= 1, got {slots}, {max_new_tokens}")
        prompts = [[int(t) for t in (p.reshape(-1).tolist() if isinstance(p, torch.Tensor) else p)] for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        return self._loop(prompts, slots, max_new_tokens, choose, (temperature, top_p, top_k))

    def _loop(self, prompts, slots: int, max_new_tokens: int, choose, sampling) -> Iterator[Optional[BatchRun]]:
        self.sampling = sampling
        width = max(len(p) for p in prompts) + max_new_tokens + 1
        self.tcache = self._cache(self.target.config, slots, width)
        self.dcache = self._cache(self.draft.config, slots, width)
        self.stops = set(self.engine.stop_token_ids or [])
        run = BatchRun([], slots=slots)
        self.t0 = self.engine.now()
        queue, active, free = list(range(len(prompts))), [], list(range(slots))[::-1]
        results = {}
        while queue or active:
            admit = [(queue.pop(0), free.pop()) for _ in range(min(len(free), len(queue)))]
            if admit:
                active += self._prefill(admit, prompts, max_new_tokens, choose, run)
                yield from self._pause()
            done = [r for r in active if r.stopped or r.start + 1 >= r.max_length]
            if len(done) < len(active):
                self._step([r for r in active if r not in done], run)
                done = [r for r in active if r.stopped or r.start + 1 >= r.max_length]
            for r in done:
                active.remove(r)
                free.append(r.slot)
                results[r.index] = self._finish(r)
            yield from self._pause()
        run.wall_seconds = self.engine.now() - self.t0
        run.requests = [results[i] for i in range(len(prompts))]
        yield run

    def _pause(self) -> Iterator[None]:
        """Yield to the other runs of a lockstep; the time spent away moves this run's clock origin forward."""
        paused = self.engine.now()
        yield None
        self.t0 += self.engine.now() - paused

    def _cache(self, cfg, slots: int, width: int) -> SlotCache:
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(self.target.parameters()).dtype
        return SlotCache(cfg.num_hidden_layers, slots, cfg.num_key_value_heads, width, hd, dtype, self.device)

    def _clock(self) -> float:
        return self.engine.now() - self.t0

    def _target(self, rows: Rows, ids: torch.Tensor):
        """The target's packed forward: (final hidden [Q, H], the draft's context features [Q, F])."""
        out = self.target.model(input_ids=ids[None], position_ids=rows.token_pos[None],
                                attention_mask={"full_attention": TargetPass(rows, self.tcache)},
                                use_cache=False, output_hidden_states=True)
        return out.last_hidden_state[0], extract_context_feature(out.hidden_states, self.layers)[0]

    def _prefill(self, admit, prompts, max_new_tokens, choose, run: BatchRun) -> List[_Row]:
        t0 = self._clock()
        lens = [len(prompts[i]) for i, _ in admit]
        rows = Rows([s for _, s in admit], [0] * len(admit), lens, self.device)
        ids = torch.tensor([t for i, _ in admit for t in prompts[i]], dtype=torch.long, device=self.device)
        hidden, feats = self._target(rows, ids)
        last = torch.cumsum(rows.lengths, 0) - 1
        logits = self.head(hidden.index_select(0, last))
        seconds = self._clock() - t0
        run.steps.append(BatchStep("prefill", len(admit), 0, 0, sum(lens), max(lens), 0.0, seconds, self._clock(),
                                   rows.width))
        out, at = [], 0
        for j, ((i, slot), n) in enumerate(zip(admit, lens)):
            tc = self.engine.now()
            block_size, rule = choose(i, logits[j], hidden[last[j]])
            chose = self.engine.now() - tc
            if block_size < 1 or (rule is not None and block_size < 2):
                raise ValueError(f"request {i}: block size {block_size} with rule {rule}")
            first = int(sample(logits[j][None], *self.sampling)[0])
            res = DecodeResult(None, n, int(block_size), step_rule=rule.describe() if rule is not None else None)
            row = _Row(i, slot, prompts[i] + [first], n, n + max_new_tokens, (int(block_size), rule), res, t0,
                       seconds * n / sum(lens), chose, feats[at:at + n] if block_size >= 2 else None, 0)
            row.stopped = first in self.stops
            if self.keep_context:
                row.kept = [feats[at:at + n]]
            out.append(row)
            at += n
        return out

    def _step(self, rows: List[_Row], run: BatchRun) -> None:
        """One speculative step for every active row: one packed draft forward (the rows with b >= 2), the rule's cut,
        one packed verify, then acceptance row by row as the batch-1 engine does it."""
        t0 = self.engine.now()
        sizes = [min(r.choice[0], r.max_length - r.start) for r in rows]
        blocks = [r.ids[r.start:r.start + 1] + [self.draft.mask_token_id] * (vs - 1) for r, vs in zip(rows, sizes)]
        drafting = [j for j, vs in enumerate(sizes) if vs > 1]
        probs = {}  # row index -> the draft's sampling probabilities (T > 0)
        if drafting:
            drafted = self._draft([rows[j] for j in drafting], [sizes[j] for j in drafting])
            for j, (prop, p, conf) in zip(drafting, drafted):
                blocks[j][1:] = prop
                rule = rows[j].choice[1]
                k = len(prop)
                if rule is not None:
                    k = int(rule.verify_length(conf, rows[j].result.committed))
                    if not 1 <= k <= sizes[j] - 1:
                        raise ValueError(f"step rule {rule.describe()} chose {k} of {sizes[j] - 1} tokens")
                    blocks[j] = blocks[j][:k + 1]
                probs[j] = p[:, :k] if p is not None else None
        t1 = self.engine.now()
        lengths = [len(b) for b in blocks]
        layout = Rows([r.slot for r in rows], [r.start for r in rows], lengths, self.device)
        ids = torch.tensor([t for b in blocks for t in b], dtype=torch.long, device=self.device)
        hidden, feats = self._target(layout, ids)
        logits = self.head(hidden)
        at = 0
        for j, (r, block) in enumerate(zip(rows, blocks)):
            self._accept(r, block, logits[at:at + len(block)], feats[at:at + len(block)], probs.get(j))
            at += len(block)
        t2 = self.engine.now()
        run.steps.append(BatchStep("decode", len(rows), len(drafting), sum(sizes[j] for j in drafting), sum(lengths),
                                   max(sizes), t1 - t0, t2 - t1, self._clock(), layout.width,
                                   sum(r.result.committed[-1] for r in rows)))

    def _accept(self, r: _Row, block: List[int], logits: torch.Tensor, feats: torch.Tensor, draft_probs) -> None:
        """Engine._decode's acceptance for one row: the matching prefix (T = 0) or rejection sampling, the bonus token,
        the max_new_tokens cut and the stop token; then the row's new start and its new context features."""
        vs, start = len(block), r.start
        temperature, top_p, top_k = self.sampling
        if temperature > 0:
            target_probs = _sampling_probs(logits[None], temperature, top_p, top_k)
            if vs > 1:
                drafted = torch.tensor([block[1:]], dtype=torch.long, device=self.device)
                accepted, bonus = _rejection_sample(drafted, target_probs, draft_probs, None)
            else:
                accepted, bonus = 0, _sample_probs(target_probs[:, -1])[0]
            bonus = int(bonus)
        else:
            posterior = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < vs - 1 and block[1 + accepted] == posterior[accepted]:
                accepted += 1
            bonus = posterior[accepted]
        new = block[1:accepted + 1] + [bonus]
        produced = min(accepted + 1, r.max_length - start - 1)
        for p, t in enumerate(new[:produced]):
            if t in self.stops:
                produced, r.stopped = p + 1, True
                break
        r.ids = r.ids[:start + 1] + new[:produced]
        r.result.committed.append(int(produced))
        r.result.verified.append(vs - 1)
        if r.choice[0] >= 2:
            kept = feats[:produced]
            r.context = kept if r.context is None else torch.cat([r.context, kept])
        if r.kept is not None:
            r.kept.append(feats[:produced])

    def _draft(self, rows: List[_Row], sizes: List[int]):
        """One packed draft forward: each row's pending context features (written into the draft's slot cache) and its
        block [token_s, MASK x (b - 1)], which attends to the row's context keys before s and to itself, in full.
        Returns per row (the b - 1 proposals, the sampling probabilities [1, b - 1, V] at T > 0 or None, the draft's
        confidences)."""
        d = self.draft
        ctx_rows = Rows([r.slot for r in rows], [r.ctx_from for r in rows], [len(r.context) for r in rows],
                        self.device)
        blk = Rows([r.slot for r in rows], [r.start for r in rows], sizes, self.device)
        context = torch.cat([r.context for r in rows])[None]
        token_ids = torch.tensor([t for r, vs in zip(rows, sizes) for t in
                                  r.ids[r.start:r.start + 1] + [d.mask_token_id] * (vs - 1)], device=self.device)
        noise = _raw_input_embeddings(self.target, token_ids[None], self.embed_scale)
        hidden = self._draft_layers(noise, d.hidden_norm(d.fc(context)), ctx_rows, blk)
        for r in rows:
            r.ctx_from, r.context = r.start, None
        # Every row's last b - 1 block positions, as dflash reads them ([:, 1 - verify_size:]).
        first = torch.cumsum(blk.lengths, 0) - blk.lengths
        pick = torch.cat([torch.arange(f + 1, f + vs, device=self.device) for f, vs in zip(first.tolist(), sizes)])
        draft_logits = d.compute_logits(hidden[0].index_select(0, pick), self.head)
        temperature, top_p, top_k = self.sampling
        out, at = [], 0
        for r, vs in zip(rows, sizes):
            lg = draft_logits[at:at + vs - 1][None]
            if temperature > 0:
                p = _sampling_probs(lg, temperature, top_p, top_k)
                tokens = _sample_probs(p)[0].tolist()
            else:
                p, tokens = None, lg[0].argmax(-1).tolist()
            # The confidences (a softmax over V per slot) only where a rule reads them.
            conf = draft_confidence(p, lg) if r.choice[1] is not None else None
            out.append((tokens, p, conf))
            at += vs - 1
        return out

    def _draft_layers(self, noise, ctx_hidden, ctx_rows: Rows, blk: Rows) -> torch.Tensor:
        """DFlashDraftModel.forward over the packed layout (Qwen3DFlashDecoderLayer / Qwen3DFlashAttention in
        dflash's order: norm, q/k/v projections, q/k norms, RoPE at each token's position, attention, o_proj,
        residual, MLP); the context keys go to the slot cache, the block's keys live for this forward only."""
        d = self.draft
        cos_c, sin_c = d.rotary_emb(ctx_hidden, ctx_rows.token_pos[None])
        cos_b, sin_b = d.rotary_emb(noise, blk.token_pos[None])
        width = int(blk.starts.max())  # each row's context keys are positions < its start
        cache_keys = torch.arange(max(width, 1), device=self.device)
        seen_ctx = (cache_keys[None] < blk.starts[:, None])[:, None, None, :].expand(-1, 1, blk.q_max, -1)
        seen_blk = (torch.arange(blk.q_max, device=self.device)[None] < blk.lengths[:, None])[:, None, None, :]
        mask = torch.cat([seen_ctx, seen_blk.expand(-1, 1, blk.q_max, -1)], dim=-1)
        hidden = noise
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            x = layer.input_layernorm(hidden)
            heads = lambda t, n: t.view(1, n, -1, a.head_dim)  # noqa: E731
            q = a.q_norm(heads(a.q_proj(x), x.shape[1])).transpose(1, 2)
            kb = a.k_norm(heads(a.k_proj(x), x.shape[1])).transpose(1, 2)
            vb = heads(a.v_proj(x), x.shape[1]).transpose(1, 2)
            n_ctx = ctx_hidden.shape[1]
            kc = a.k_norm(heads(a.k_proj(ctx_hidden), n_ctx)).transpose(1, 2)
            vc = heads(a.v_proj(ctx_hidden), n_ctx).transpose(1, 2)
            q, kb = apply_rotary_pos_emb(q, kb, cos_b, sin_b)
            kc = kc * cos_c[:, None] + _rotate_half(kc) * sin_c[:, None]
            self.dcache.write(i, ctx_rows.token_slot, ctx_rows.token_pos, kc, vc)
            k_ctx, v_ctx = self.dcache.rows(i, blk.slots, max(width, 1))
            k = torch.cat([k_ctx, blk.gather(kb)], dim=2)
            v = torch.cat([v_ctx, blk.gather(vb)], dim=2)
            attn = blk.scatter(attend(blk.gather(q), k, v, mask, a.scaling))
            hidden = hidden + a.o_proj(attn.reshape(1, attn.shape[1], -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return d.norm(hidden)

    def _finish(self, r: _Row) -> RequestResult:
        res = r.result
        res.output_ids = torch.tensor([r.ids[:min(r.start + 1, r.max_length)]], dtype=torch.long)
        res.stopped = bool(r.stopped)
        if r.kept is not None:
            res.context = torch.cat(r.kept)[None]
        return RequestResult(r.index, res, r.choice, r.admitted_at, self._clock(), r.prefill_seconds,
                             r.choose_seconds)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


@torch.inference_mode()
def lockstep(runs: Sequence[Iterator[Optional[BatchRun]]], target, rotate: bool = True) -> List[BatchRun]:
    """Drive several :meth:`BatchedEngine.start` runs (one engine each, the caches are per engine; ``target`` their
    one target model, switched to the ragged attention meanwhile) one forward at a
    time in turn, and return their BatchRuns in order. Why: on a shared machine the speed drifts by +-10 % within
    minutes, so two methods timed one after the other differ by more than they differ; timed forward by forward in
    turn, each run's seconds are still only its own (its clock stops while another runs), but a drift lasting longer
    than a few steps hits both alike, and their paired ratio resolves (benchmarks/results/default-run-load.md). Who
    goes first rotates round by round (``rotate``): in a fixed order the first run of every round measured 2-4 %
    slower than identical runs after it (benchmarks/lockstep_noise.py)."""
    out: List[Optional[BatchRun]] = [None] * len(runs)
    live = list(enumerate(runs))
    saved = target.config._attn_implementation
    target.set_attn_implementation(RAGGED)
    try:
        turn = 0
        while live:
            turn += 1
            k = turn % len(live) if rotate else 0
            for j, it in live[k:] + live[:k]:
                got = next(it)
                if got is not None:
                    out[j] = got
                    live.remove((j, it))
    finally:
        target.set_attn_implementation(saved)
    return out  # type: ignore[return-value]


def fixed(block_size: int, rule=None) -> Callable[[int, torch.Tensor, torch.Tensor], Choice]:
    """A ``choose`` that gives every request the same block size (and rule)."""
    return lambda i, logits, hidden: (int(block_size), rule)
