"""The engine's verify-step bookkeeping without the target, and the walks of every candidate along g.

At T = 0 every block size decodes the same greedy continuation g, so a candidate's steps need no target: at start s
the draft proposes verify_size - 1 tokens, the accepted ones are the prefix that matches g, and the step commits
them plus one, clipped as the engine's loop clips. :func:`lockstep_walks` walks every candidate of every prompt at
once, so that one draft call per round proposes for all of them; batch-1 and batched replay both walk with it.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

Block = tuple  # (b, s, vs): candidate b's block at start s, verify_size vs
Work = Dict[int, List[Block]]  # {prompt index: its blocks to draft this round}


def step(g: Sequence[int], s: int, max_length: int, b: int, proposal: Optional[Sequence[int]],
         stops: set) -> tuple:
    """One verify step at start s: (tokens committed, stopped). Mirrors Engine._decode's bookkeeping:
    verify_size = min(b, max_length - s); produced = min(accepted + 1, max_length - s - 1), cut at the first stop
    token among the committed tokens."""
    vs = min(b, max_length - s)
    accepted = matched(g, s, proposal, vs - 1) if vs > 1 else 0
    produced = min(accepted + 1, max_length - s - 1)
    for j in range(1, produced + 1):
        if s + j < len(g) and g[s + j] in stops:
            return j, True
    return produced, False


def matched(g: Sequence[int], s: int, proposal: Sequence[int], drafted: int) -> int:
    """How many of the first ``drafted`` proposals of the block at start s equal g: the tokens a step accepts."""
    for j in range(drafted):
        pos = s + 1 + j
        # Past the end of g only after a stop token, where the step is cut at the stop anyway.
        if pos >= len(g) or int(proposal[j]) != g[pos]:
            return j
    return drafted


def lockstep_walks(gs: Sequence[Sequence[int]], ns: Sequence[int], max_new_tokens: int, block_sizes: Sequence[int],
                   propose: Callable[[Work], Dict[int, List[Sequence[int]]]],
                   stop_ids: Optional[Sequence[int]]) -> List[Dict[int, List[int]]]:
    """Tokens committed per step, [{b: [...]}] per prompt, along each greedy sequence gs[p] (prompt of ns[p]
    tokens included). Each round ONE ``propose({p: [(b, s, vs), ...]}) -> {p: [tokens per block]}`` call drafts
    the current start of every live candidate of every prompt (vs >= 2 only: a 1-token step drafts nothing)."""
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


def walk(g: Sequence[int], n: int, max_length: int, b: int, propose: Callable[[int, int], Sequence[int]],
         stop_ids: Sequence[int]) -> List[int]:
    """One candidate's walk (len(g) > n) with a proposer per start, ``propose(s, vs) -> tokens``."""
    def one_block(work: Work):
        return {p: [propose(s, vs) for _, s, vs in blocks] for p, blocks in work.items()}
    return lockstep_walks([g], [n], max_length - n, [b], one_block, stop_ids)[0][b]
