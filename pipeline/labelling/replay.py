"""Exact greedy replay at batch 1: every candidate's tau from ONE target decode plus draft-only work (T = 0).

At T = 0 speculative decoding is lossless, so every block size produces the same greedy continuation g, and the
target's context features along g are the same for every b. Only the draft's proposals depend on b. So: decode once
at b_ref (= B) with the engine, keeping the context features of every committed position; then walk every other
candidate's trajectory without the target (pipeline.labelling.walks), the draft proposing from the features of
positions < s and the block [g_s, MASK ...] (pipeline.labelling.runner). Three ways to get the proposals, same
results:

* ``lockstep`` (default): all candidates walk together; each round ONE draft forward proposes for the current
  start of every candidate still running, blocks side by side. About as many draft forwards as the reference
  decode has steps, whatever the number of candidates.
* ``sequential``: one draft forward per visited start per candidate, each block alone, as the engine drafts it.
* ``all_starts``: proposals at EVERY start for EVERY candidate from a few large forwards, then pointer chases
  through that table (:class:`AllStartsTable`). It computes ~tau times more proposals than are visited: a loss on
  a CPU, a candidate on an accelerator where batch-1 forwards are launch-bound.

A draft replay does not model is refused before any work (pipeline.labelling.support). Exactness against the
engine is tested step by step (tests/unit/test_replay.py); the arithmetic is the same, only the shapes of the
matrix products differ, so a draft argmax that is a float near-tie could in principle resolve differently.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

from pipeline.labelling.runner import DraftRunner
from pipeline.labelling.support import replay_unsupported, replay_unsupported_config, require_replayable
from pipeline.labelling.trace import record_traces
from pipeline.labelling.walks import lockstep_walks, walk
from pipeline.policy.trace import Trace

__all__ = ["ALL_STARTS_MAX_QUERIES", "AllStartsTable", "DraftReplay", "PROPOSERS", "replay_candidates",
           "replay_unsupported", "replay_unsupported_config", "replay_with_trace"]

PROPOSERS = ("lockstep", "sequential", "all_starts")
ALL_STARTS_MAX_QUERIES = 4096  # query rows per all_starts forward


class DraftReplay(DraftRunner):
    """The draft's proposals along one greedy sequence g, at the engine's arithmetic; ``context`` = the target
    features of positions [0, N)."""

    def __init__(self, draft, target, g, context):
        super().__init__(draft, target, [g], context, fast=False)

    def __call__(self, s: int, vs: int) -> List[int]:
        return self.propose_many([(None, s, vs)])[0]

    def propose_many(self, blocks) -> List[List[int]]:
        """Proposals for blocks [(b, s, vs), ...] (vs >= 2) from ONE draft forward."""
        return self.propose({0: blocks})[0]

    def block_hidden(self, blocks):
        """The final hidden states of each block's proposal rows, [1, vs - 1, H] per block, from ONE forward."""
        return self.hidden({0: blocks})


class AllStartsTable:
    """Proposals for every (candidate, start) pair from a few draft forwards, then looked up by the walks."""

    def __init__(self, runner: DraftReplay, n: int, n_ctx: int, max_length: int, block_sizes: Sequence[int],
                 max_queries: Optional[int] = None):
        max_queries = max_queries or ALL_STARTS_MAX_QUERIES
        self.runner = runner
        # A pair the engine could not draft either is left out here and fails only if a walk reaches it.
        pairs = [(b, s, min(b, max_length - s)) for s in range(n, n_ctx) for b in block_sizes
                 if min(b, max_length - s) > 1 and runner.can_draft(min(b, max_length - s))]
        self.table: Dict[tuple, List[int]] = {}
        chunk: list = []
        for i, pair in enumerate(pairs):  # pairs are ordered by start, so a chunk's context prefix stays short
            chunk.append(pair)
            if sum(p[2] for p in chunk) >= max_queries or i == len(pairs) - 1:
                for (b, s, _), toks in zip(chunk, runner.propose_many(chunk)):
                    self.table[(b, s)] = toks
                chunk = []

    def for_block_size(self, b: int):
        def propose(s: int, vs: int) -> Sequence[int]:
            if (b, s) not in self.table:
                self.runner.fail(vs)
            return self.table[(b, s)]
        return propose


def replay_candidates(engine, state, candidates: Sequence[int], max_new_tokens: int, proposer: str = "lockstep",
                      reference_block_size: Optional[int] = None) -> Dict[int, dict]:
    """{b: {"committed", "new_tokens", "seconds"}} for every candidate, from one target decode at b_ref.

    proposer: one of PROPOSERS (module docstring). Raises ValueError, before any work, for a draft replay does not
    model (pipeline.labelling.support.replay_unsupported).
    """
    return replay_with_trace(engine, state, candidates, max_new_tokens, proposer, reference_block_size)[0]


def replay_with_trace(engine, state, candidates: Sequence[int], max_new_tokens: int, proposer: str = "lockstep",
                      reference_block_size: Optional[int] = None,
                      trace_block_size: Optional[int] = None) -> Tuple[Dict[int, dict], Optional[Trace], float]:
    """(:func:`replay_candidates`' answer, the per-step trace at ``trace_block_size`` (pipeline.labelling.trace;
    None without one), the trace's seconds), the trace drafted at the engine's arithmetic like the walks."""
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {PROPOSERS}, got {proposer!r}")
    require_replayable(engine.draft)
    b_ref = reference_block_size or engine.trained_block_size
    if b_ref < 2:
        raise ValueError("replay needs a reference decode at a block size >= 2")
    ref = engine.decode(state, block_size=b_ref, max_new_tokens=max_new_tokens, keep_context=True)
    g = ref.output_ids[0].tolist()
    n = state.num_input_tokens
    max_length = n + max_new_tokens
    stops = engine.stop_token_ids
    out = {b_ref: {"committed": ref.committed, "new_tokens": ref.new_tokens, "seconds": ref.decode_seconds}}
    others = [b for b in candidates if b != b_ref]
    t0 = time.perf_counter()
    walks: Dict[int, List[int]] = {}
    runner = DraftReplay(engine.draft, engine.target, g, ref.context) if others or trace_block_size else None
    if others:
        if proposer == "lockstep":
            walks = lockstep_walks([g], [n], max_new_tokens, others, runner.propose, stops)[0]
        elif proposer == "sequential":
            walks = {b: walk(g, n, max_length, b, runner, stops) for b in others}
        else:
            table = AllStartsTable(runner, n, ref.context.shape[1], max_length, others)
            walks = {b: walk(g, n, max_length, b, table.for_block_size(b), stops) for b in others}
    # The draft work is shared by the candidates: each is charged an equal share of it.
    share = (time.perf_counter() - t0) / max(1, len(others))
    for b in others:
        out[b] = {"committed": walks[b], "new_tokens": ref.new_tokens, "seconds": share}
    t1 = time.perf_counter()
    trace = record_traces(runner, [n], max_new_tokens, trace_block_size, stops)[0] if trace_block_size else None
    return out, trace, time.perf_counter() - t1
