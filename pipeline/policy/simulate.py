"""Any per-step verify rule replayed offline from a label row's trace, exactly as the engine decodes it at T = 0.

At T = 0 every rule decodes the same greedy continuation g (lossless decoding), and at a drafted block size b_max
the draft's block at start s is [g_s, MASK x (vs - 1)], vs = min(b_max, max_length - s), over the target's features
along g: its proposals and per-slot confidences depend on s alone, never on the rule or the path that led to s. So
a :class:`Trace` that holds, for every start of g, how many leading proposals equal g (``match``) and the draft's
top-1 probabilities (``confidence``, as pipeline.policy.step_rules.draft_confidence computes them in the engine)
replays any rule: at start s the rule picks k of the vs - 1 drafted tokens, the step accepts min(match, k) and
commits one more (the bonus), cut at the end of g (the stop token, or the max_new_tokens cut: Engine._decode's
bookkeeping, and pipeline.labelling.walks.step's).

:func:`simulate` walks one trace with any rule object; :func:`simulate_many` walks many traces in lockstep with
numpy for the rules of pipeline.policy.step_rules (packed once by :func:`pack_traces`, then any number of rules)
and falls back to :func:`simulate` for any other rule. Pure numpy/torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from pipeline.policy.step_rules import ConfidenceThreshold, Full, LearnedVerify, RunningAcceptance
from pipeline.policy.trace import Trace

__all__ = ["Packed", "Simulated", "Trace", "pack_traces", "per_step_oracle", "simulate", "simulate_many"]
_LOCKSTEP = (Full, ConfidenceThreshold, RunningAcceptance, LearnedVerify)


def _undraftable(i: int, trace: Trace):
    return RuntimeError(f"the draft cannot draft the block at offset {i} of this trace (DFlash2's convolution is "
                        f"longer than the block); the engine fails on this step too")


def simulate(trace: Trace, rule, max_new_tokens: Optional[int] = None) -> Tuple[List[int], List[int]]:
    """(drafted tokens verified per step, tokens committed per step) of ``rule`` at b_max = trace.block_size: the
    engine's ``DecodeResult.verified`` and ``.committed`` of ``Engine.decode(state, block_size=b_max,
    step_rule=rule)`` at T = 0. ``max_new_tokens`` (the label set's, in its metadata) is checked against the trace."""
    trace.check(max_new_tokens)
    verified: List[int] = []
    committed: List[int] = []
    end = trace.new_tokens - 1  # the offset of g's last token: a step never commits past it
    i = 0
    while i < end:  # the engine's `start + 1 < max_length and not stopped`, in offsets along g
        conf = trace.confidence[i]
        if not len(conf):
            raise _undraftable(i, trace)
        k = int(rule.verify_length(torch.tensor(conf, dtype=torch.float32), committed))
        if not 1 <= k <= len(conf):
            raise ValueError(f"step rule {rule.describe()} chose {k} of {len(conf)} tokens")
        produced = min(min(trace.match[i], k) + 1, end - i)
        verified.append(k)
        committed.append(produced)
        i += produced
    return verified, committed


@dataclass
class Simulated:
    """:func:`simulate_many`'s answer, one entry per trace."""

    verified: List[List[int]]
    committed: List[List[int]]

    @property
    def steps(self) -> np.ndarray:
        return np.array([len(c) for c in self.committed], dtype=np.int64)


def _static_lengths(rule, conf: np.ndarray, width: np.ndarray) -> Optional[np.ndarray]:
    """k at every start [P, S] for a rule that reads only the confidences; None for any other rule. Same arithmetic
    as the rule's verify_length (float64 cumulative product of the float32 values, left to right)."""
    if isinstance(rule, Full):
        return width.copy()
    if isinstance(rule, ConfidenceThreshold):
        kept = (np.cumprod(conf.astype(np.float64), axis=-1) >= rule.threshold).sum(axis=-1)  # padding is 0.0
        return np.maximum(np.minimum(rule.min_tokens, width), np.minimum(kept, width))
    return None


@dataclass
class Packed:
    """Traces checked once and laid out as arrays [P, S(, W)], zero-padded, for :func:`simulate_many` to run any
    number of rules over (a tune grid packs its traces once)."""

    traces: List[Trace]
    match: np.ndarray  # [P, S] int64
    width: np.ndarray  # [P, S] int64: drafted tokens at each start (0: undraftable, or past the trace's end)
    conf: np.ndarray  # [P, S, W] float32
    end: np.ndarray  # [P] int64: offset of g's last token


def pack_traces(traces: Sequence[Trace], max_new_tokens: Optional[int] = None) -> Packed:
    for t in traces:
        t.check(max_new_tokens)
    P = len(traces)
    S = max([len(t.match) for t in traces] + [1])
    W = max([len(c) for t in traces for c in t.confidence] + [1])
    match, width = np.zeros((P, S), dtype=np.int64), np.zeros((P, S), dtype=np.int64)
    conf = np.zeros((P, S, W), dtype=np.float32)
    for p, t in enumerate(traces):
        match[p, :len(t.match)] = t.match
        for i, c in enumerate(t.confidence):
            width[p, i] = len(c)
            conf[p, i, :len(c)] = c
    return Packed(list(traces), match, width, conf, np.array([t.new_tokens - 1 for t in traces], dtype=np.int64))


def simulate_many(traces, rule, max_new_tokens: Optional[int] = None) -> Simulated:
    """:func:`simulate` of one rule on every trace (a list, or :func:`pack_traces`' answer; any mix of b_max), in
    lockstep with numpy for the rules of pipeline.policy.step_rules; any other rule goes trace by trace through
    :func:`simulate`."""
    packed = traces if isinstance(traces, Packed) else None
    if not isinstance(rule, _LOCKSTEP):
        pairs = [simulate(t, rule, max_new_tokens) for t in (packed.traces if packed else traces)]
        return Simulated([v for v, _ in pairs], [c for _, c in pairs])
    packed = packed or pack_traces(traces, max_new_tokens)
    match, width, end = packed.match, packed.width, packed.end
    static = _static_lengths(rule, packed.conf, width)
    P = len(end)
    at = np.zeros(P, dtype=np.int64)
    ema = np.zeros(P, dtype=np.float64)  # RunningAcceptance's average of committed - 1 (after the first step)
    prev = np.full(P, -1, dtype=np.int64)  # LearnedVerify's previous accepted count (-1 before the first step)
    verified: List[List[int]] = [[] for _ in range(P)]
    committed: List[List[int]] = [[] for _ in range(P)]
    live = np.flatnonzero(at < end)
    seen = False  # every live trace steps in every round, so after the first round all have a history
    while live.size:
        i = at[live]
        w = width[live, i]
        if (w == 0).any():
            p = int(live[np.flatnonzero(w == 0)[0]])
            raise _undraftable(int(at[p]), packed.traces[p])
        if static is not None:
            k = static[live, i]
        elif isinstance(rule, LearnedVerify):
            k = rule.lengths(packed.conf[live, i, :int(w.max())], w, prev[live])
        elif seen:  # RunningAcceptance: ceil(ema + slack) in 1..w
            k = np.maximum(1, np.minimum(w, np.ceil(ema[live] + rule.slack).astype(np.int64)))
        else:  # RunningAcceptance: the whole block on the first step
            k = w
        produced = np.minimum(np.minimum(match[live, i], k) + 1, end[live] - i)
        if isinstance(rule, RunningAcceptance):
            c1 = (produced - 1).astype(np.float64)
            ema[live] = rule.alpha * c1 + (1 - rule.alpha) * ema[live] if seen else c1
        prev[live] = produced - 1
        for p, kk, c in zip(live.tolist(), k.tolist(), produced.tolist()):
            verified[p].append(kk)
            committed[p].append(c)
        at[live] = i + produced
        live = live[at[live] < end[live]]
        seen = True
    return Simulated(verified, committed)


def per_step_oracle(trace: Trace, step_seconds: Sequence[float]) -> List[int]:
    """The verify lengths of the per-step oracle at b_max = trace.block_size: the path along g that hindsight makes
    cheapest, ``step_seconds[k - 1]`` a step verifying k drafted tokens (a dynamic programme over the offsets of g:
    from offset i a step sending k commits min(match_i, k) + 1, cut at g's end). What no rule can beat under the same
    cost model, since every rule's path is one of those it searches."""
    trace.check()
    end = trace.new_tokens - 1
    best = np.zeros(end + 1)  # seconds from offset i to the end
    choice = np.zeros(end + 1, dtype=np.int64)
    for i in range(end - 1, -1, -1):
        w = len(trace.confidence[i])
        if not w:
            best[i], choice[i] = np.inf, 0  # undraftable here, as simulate
            continue
        ks = np.arange(1, w + 1)
        nxt = np.minimum(i + np.minimum(trace.match[i], ks) + 1, end)
        total = np.asarray(step_seconds[:w], dtype=np.float64) + best[nxt]
        choice[i] = int(ks[int(np.argmin(total))])  # ties: the smaller k
        best[i] = float(total.min())
    if not np.isfinite(best[0]):
        raise _undraftable(int(np.flatnonzero([not len(c) for c in trace.confidence])[0]), trace)
    verified, i = [], 0
    while i < end:
        k = int(choice[i])
        verified.append(k)
        i = min(i + min(trace.match[i], k) + 1, end)
    return verified
