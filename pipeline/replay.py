"""Exact greedy replay: every candidate's tau from ONE target decode plus draft-only work (T = 0).

At T = 0 speculative decoding is lossless, so every block size produces the same greedy continuation g, and the
target's context features along g are the same for every b. Only the draft's proposals depend on b. So:

1. decode once at b_ref (= B) with the engine, keeping the context features of every committed position;
2. for each other candidate b, walk its trajectory without the target: at start s the draft proposes
   verify_size - 1 tokens from the features of positions < s and the block [g_s, MASK ...]; accepted = the
   matching prefix against g; committed = accepted + 1, clipped at max_new_tokens and at a stop token exactly as
   the engine's loop clips; s += committed.

The draft's context keys/values are computed once per prompt (one forward over all context positions) and shared
by every start and every candidate. Three ways to get the proposals, same results:

* ``lockstep`` (default): all candidates walk together; each round ONE draft forward proposes for the current
  start of every candidate still running, blocks side by side with a block attention mask (each block sees the
  context strictly before its start and itself, as in DFlash training). About as many draft forwards as the
  reference decode has steps, whatever the number of candidates.
* ``sequential``: one draft forward per visited start per candidate.
* ``all_starts`` (the issue's stretch): proposals at EVERY start for EVERY candidate from a few large forwards,
  then pointer chases through that table. It computes ~tau times more proposals than are visited: a loss on a
  CPU, a candidate on an accelerator where batch-1 forwards are launch-bound.

Exactness against the engine is tested (tests/test_replay.py); the arithmetic is the same, only the shapes of the
matrix products differ, so a draft argmax that is an exact float tie could in principle resolve differently.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from dflash.model import _draft_value, _make_cache, _output_head, _raw_input_embeddings

Propose = Callable[[int, int], Sequence[int]]


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


def _block_layout(blocks, ctx_len: int, device):
    """Blocks [(b, s, vs), ...] laid side by side after ctx_len context keys: the boolean attention mask
    [Q, ctx_len + Q] (a block sees the context strictly before its start, and itself), the blocks' position ids,
    and which of the Q rows are proposals (every row but each block's first)."""
    sizes = [vs for _, _, vs in blocks]
    q = sum(sizes)
    mask = torch.zeros((q, ctx_len + q), dtype=torch.bool, device=device)
    positions, off = [], 0
    for (_, s, vs) in blocks:
        mask[off:off + vs, :s] = True
        mask[off:off + vs, ctx_len + off:ctx_len + off + vs] = True
        positions.append(torch.arange(s, s + vs, device=device))
        off += vs
    keep = torch.ones(q, dtype=torch.bool, device=device)
    keep[torch.tensor([0] + sizes[:-1], device=device).cumsum(0)] = False
    return mask[None, None], torch.cat(positions), keep


def _split_proposals(tokens: List[int], blocks) -> List[List[int]]:
    out, off = [], 0
    for (_, _, vs) in blocks:
        out.append(tokens[off:off + vs - 1])
        off += vs - 1
    return out


class _DraftRunner:
    """The draft's proposals along one greedy sequence; ``context`` = target features of positions [0, N)."""

    def __init__(self, draft, target, g: torch.Tensor, context: torch.Tensor):
        self.draft, self.target, self.g, self.context = draft, target, g, context
        self.head = _output_head(target)
        self.scale = float(_draft_value(draft.config, "input_embedding_scale", 1.0))
        self.mask_id = int(draft.mask_token_id)
        self.device = context.device

    def _block_tokens(self, starts_sizes):
        toks = []
        for s, vs in starts_sizes:
            toks.append(int(self.g[s]))
            toks.extend([self.mask_id] * (vs - 1))
        return torch.tensor([toks], dtype=torch.long, device=self.device)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self.draft.compute_logits(hidden, self.head), dim=-1)


class SequentialProposer(_DraftRunner):
    """One draft forward per start, on a cache holding the shared context keys/values of positions < s."""

    def __init__(self, draft, target, g, context):
        super().__init__(draft, target, g, context)
        n_ctx = context.shape[1]
        cache = _make_cache(draft.config)
        dummy = _raw_input_embeddings(target, torch.full((1, 1), self.mask_id, device=self.device), self.scale)
        with torch.inference_mode():
            draft(target_hidden=context, noise_embedding=dummy,
                  position_ids=torch.arange(n_ctx + 1, device=self.device)[None],
                  past_key_values=cache, use_cache=True)
        # Per layer [1, kv_heads, N, head_dim], RoPE applied: the context K/V of every position, computed once.
        self.kv = [(layer.keys[:, :, :n_ctx], layer.values[:, :, :n_ctx]) for layer in cache.layers]
        self.calls = 0

    @torch.inference_mode()
    def __call__(self, s: int, vs: int) -> List[int]:
        from transformers import DynamicCache

        self.calls += 1
        cache = DynamicCache(config=self.draft.config)
        for i, (k, v) in enumerate(self.kv):
            cache.update(k[:, :, :s], v[:, :, :s], i)
        hidden = self.draft(
            target_hidden=self.context[:, :0], noise_embedding=_raw_input_embeddings(
                self.target, self._block_tokens([(s, vs)]), self.scale),
            position_ids=torch.arange(s, s + vs, device=self.device)[None], past_key_values=cache, use_cache=True,
        )[:, 1 - vs:, :]
        return self._argmax(hidden)[0].tolist()


class LockstepProposer(SequentialProposer):
    """Blocks at several starts in ONE draft forward: the shared context K/V up to the furthest start sit in
    the cache, each block sees the context strictly before its own start and itself (block attention mask)."""

    @torch.inference_mode()
    def propose_many(self, blocks) -> List[List[int]]:
        from transformers import DynamicCache

        self.calls += 1
        ctx_len = max(s for _, s, _ in blocks)
        mask, positions, keep = _block_layout(blocks, ctx_len, self.device)
        cache = DynamicCache(config=self.draft.config)
        for i, (k, v) in enumerate(self.kv):
            cache.update(k[:, :, :ctx_len], v[:, :, :ctx_len], i)
        hidden = self.draft(
            target_hidden=self.context[:, :0], noise_embedding=_raw_input_embeddings(
                self.target, self._block_tokens([(s, vs) for _, s, vs in blocks]), self.scale),
            position_ids=positions[None], attention_mask=mask, past_key_values=cache, use_cache=True,
        )
        return _split_proposals(self._argmax(hidden[:, keep])[0].tolist(), blocks)


class BatchedProposer(_DraftRunner):
    """Proposals for every (candidate, start) pair from a few draft forwards with a block attention mask."""

    def __init__(self, draft, target, g, context, n: int, max_length: int, block_sizes: Sequence[int],
                 max_queries: int = 4096):
        super().__init__(draft, target, g, context)
        n_ctx = context.shape[1]
        pairs = [(b, s, min(b, max_length - s)) for s in range(n, n_ctx) for b in block_sizes
                 if min(b, max_length - s) > 1]
        self.table: Dict[tuple, List[int]] = {}
        self.forwards = 0
        chunk: list = []
        for pair in pairs:  # pairs are ordered by start, so a chunk's context prefix stays short
            chunk.append(pair)
            if sum(p[2] for p in chunk) >= max_queries:
                self._run(chunk)
                chunk = []
        if chunk:
            self._run(chunk)

    @torch.inference_mode()
    def _run(self, chunk) -> None:
        self.forwards += 1
        ctx_len = max(s for _, s, _ in chunk)  # no block sees context at or beyond its start
        mask, positions, keep = _block_layout(chunk, ctx_len, self.device)
        noise = _raw_input_embeddings(self.target, self._block_tokens([(s, vs) for _, s, vs in chunk]), self.scale)
        hidden = self.draft(
            target_hidden=self.context[:, :ctx_len], noise_embedding=noise,
            position_ids=torch.cat([torch.arange(ctx_len, device=self.device), positions])[None],
            attention_mask=mask, use_cache=False,
        )
        tokens = _split_proposals(self._argmax(hidden[:, keep])[0].tolist(), chunk)
        for (b, s, _), toks in zip(chunk, tokens):
            self.table[(b, s)] = toks

    def for_block_size(self, b: int) -> Propose:
        return lambda s, vs: self.table[(b, s)]


PROPOSERS = ("lockstep", "sequential", "all_starts")


def replay_candidates(engine, state, candidates: Sequence[int], max_new_tokens: int, proposer: str = "lockstep",
                      reference_block_size: Optional[int] = None) -> Dict[int, dict]:
    """{b: {"committed", "new_tokens", "seconds"}} for every candidate, from one target decode at b_ref.

    proposer: ``lockstep`` (default; one draft forward per round for all candidates' current starts),
    ``sequential`` (one draft forward per start per candidate) or ``all_starts`` (every start x every candidate
    up front, then pointer chasing; compute-heavy, suited to accelerators rather than CPUs).
    """
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {PROPOSERS}, got {proposer!r}")
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
    if proposer == "lockstep":
        runner = LockstepProposer(engine.draft, engine.target, g_t, ref.context)
        walks = lockstep_walks(g, n, max_length, others, runner.propose_many, engine.stop_token_ids)
    elif proposer == "sequential":
        runner = SequentialProposer(engine.draft, engine.target, g_t, ref.context)
        walks = {b: walk(g, n, max_length, b, runner, engine.stop_token_ids) for b in others}
    else:
        table = BatchedProposer(engine.draft, engine.target, g_t, ref.context, n, max_length, others)
        walks = {b: walk(g, n, max_length, b, table.for_block_size(b), engine.stop_token_ids) for b in others}
    # The draft work is shared by the candidates: each is charged an equal share of it.
    share = (time.perf_counter() - t0) / max(1, len(others))
    for b in others:
        out[b] = {"committed": walks[b], "new_tokens": ref.new_tokens, "seconds": share}
    return out
