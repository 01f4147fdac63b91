"""The per-step trace of each prompt (label schema v3's ``trace_*`` columns): the draft at EVERY start of g.

At T = 0 every verify rule decodes g, and at a drafted block size b_max the draft's block at start s depends on s
alone (pipeline.policy.simulate), so one draft pass over every start s of g, at vs = min(b_max, max_length - s),
records what any rule needs: the matching prefix and the top-1 probability of every slot. This is
replay.AllStartsTable's idea at one block size, for a whole batch of prompts through the same DraftRunner as the
walks, in forwards of at most TRACE_MAX_ROWS query rows (a wave of starts per prompt, all prompts side by side),
so that memory stays bounded whatever the batch and the generation length.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from pipeline.labelling.runner import DraftRunner
from pipeline.labelling.walks import matched
from pipeline.policy.trace import Trace

# Query rows per trace forward: the all_starts proposer's chunk (replay.ALL_STARTS_MAX_QUERIES), whose masks and
# hidden states stay small on a CPU; the lm_head still runs HEAD_ROWS rows at a time.
TRACE_MAX_ROWS = 4096


def trace_blocks(g_len: int, n: int, max_new_tokens: int, b: int) -> List[tuple]:
    """The block (b, s, vs) of every start s that begins a step along g (len(g) = g_len, a prompt of n tokens):
    s = n .. g_len - 2; the last token of g never starts one (it ends the generation)."""
    max_length = n + max_new_tokens
    return [(b, s, min(b, max_length - s)) for s in range(n, g_len - 1)]


def record_traces(runner: DraftRunner, ns: Sequence[int], max_new_tokens: int, block_size: int,
                  stop_ids: Optional[Sequence[int]], max_rows: Optional[int] = None) -> List[Trace]:
    """One Trace per greedy sequence of ``runner`` (prompt p has ns[p] tokens). Each forward drafts a wave of up to
    ``per`` consecutive starts of every prompt that has them (similar starts, so the context padding is small), the
    prompts split over several forwards where a wave would exceed ``max_rows`` query rows."""
    if block_size < 2:
        raise ValueError(f"a trace needs a drafted block size >= 2, got {block_size}")
    max_rows = max_rows or TRACE_MAX_ROWS
    stops = set(stop_ids or ())
    gs = runner.gs
    blocks = [trace_blocks(len(g), n, max_new_tokens, block_size) for g, n in zip(gs, ns)]
    found: List[Dict[int, tuple]] = [{} for _ in gs]
    per = max(1, max_rows // (block_size * max(1, len(gs))))  # starts per prompt per wave
    group = max(1, max_rows // (block_size * per))  # prompts per forward
    for at in range(0, max([len(b) for b in blocks] + [0]), per):
        # A block the engine could not draft either is left out; simulate fails if a rule reaches it.
        wave = {p: [blk for blk in bl[at:at + per] if runner.can_draft(blk[2])] for p, bl in enumerate(blocks)}
        live = [p for p, bl in wave.items() if bl]
        for i in range(0, len(live), group):
            work = {p: wave[p] for p in live[i:i + group]}
            for p, results in runner.propose_with_confidence(work).items():
                for (_, s, vs), (tokens, conf) in zip(work[p], results):
                    found[p][s] = (matched(gs[p], s, tokens, vs - 1), conf)
    traces = []
    for p, (g, n) in enumerate(zip(gs, ns)):
        rows = [found[p].get(s, (0, [])) for _, s, _ in blocks[p]]
        traces.append(Trace(block_size, [m for m, _ in rows], [c for _, c in rows], g[-1] in stops))
    return traces
