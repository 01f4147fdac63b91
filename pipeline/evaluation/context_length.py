"""Acceptance by prompt length: does tau(b), and the best fixed block size b, change with the prompt's length?

Rows are bucketed by ``prompt_tokens`` at quantiles (:func:`length_buckets`); per bucket :func:`context_table`
gives the mean tau at every b with a 95 % interval and the bucket's best fixed b (argmin of mean cost(b) / tau(b)
with a cost model, else argmax of mean tau; ties to the smaller b; b = 1 always a candidate at tau = 1).

Interval: the normal approximation, mean +- 1.96 * sd / sqrt(rows), not a bootstrap: it is exact enough for means of
bounded tau at tens of rows, costs nothing at 10^5 rows (a bootstrap index array would be reps x rows) and needs no
seed. "Varies" rule: a bucket counts when its best b differs from the base b (the 3-item schedule's b at that c,
else the overall best b of all rows) AND, over that bucket's rows, the mean per-row advantage of its b over the base
b (seconds per token saved, or tau gained without a cost) is above 0 at a one-sided level corrected for every
bucket and block size tested (:func:`decide`: Holm over every bucket of MIN_ROWS rows or more and every other b it
could have picked, across every load deploy tabulates: uncorrected, 4 buckets at 5 loads with no length effect at
all said "varies" in 47 of 60 simulated runs, tests/unit/test_context_length.py). Below MIN_ROWS rows the normal
approximation is not trusted and the bucket never counts. ``varies`` = any bucket counts. Without a cost the largest
b nearly always wins every bucket (tau grows with b), so length matters for the choice only through a cost.

Export form (:func:`context_ranges`): vLLM PR #48944 (open, not merged; github.com/vllm-project/vllm/pull/48944,
"Context-length-aware K in DSD", RFC issue #48627) extends `num_speculative_tokens_per_batch_size` (Dynamic SD,
merged PR #32374, whose batch ranges are inclusive) with 5-item entries `[bs_lo, bs_hi, ctx_lo, ctx_hi, K]`; a
3-item `[bs_lo, bs_hi, K]` keeps meaning all contexts. The RFC's example splits one batch range into ctx
`0..768` and `769..32768`, but the validator in the PR's code (vllm-project/vllm vllm/v1/spec_decode/dynamic/utils.py
at 14b450ca) requires positive bounds, the first context range starting at 1, contiguous ranges and a rectangular
grid, and reads the last range as unbounded: the ranges here follow the code. ctx there is the request's context
length, which grows while it decodes, whereas our buckets are of the prompt length: an approximation. RFC #54749 and issue #52258 named in the brief were not found by our search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import erfc, sqrt
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

Z95 = 1.96
ALPHA = 0.05  # the family's error rate for "varies" (decide: Holm)
MIN_ROWS = 30  # a bucket with fewer rows never counts as varying: its normal interval is not trusted
BS_MAX = 1024  # the last concurrency grid point holds batch sizes up to this
CTX_MAX = 1 << 20  # last ctx_hi: past any model's context window, so a long decode never falls outside every range


@dataclass
class Bucket:
    ctx_lo: int  # prompt tokens, inclusive
    ctx_hi: int  # inclusive
    rows: int
    mean_tau: List[float]  # one per ContextTable.block_sizes
    tau_low: List[float]
    tau_high: List[float]
    best_b: int
    gain: Tuple[float, float, float] = (0.0, 0.0, 0.0)  # mean, low, high advantage of best_b over the base b
    p: Optional[float] = None  # one-sided p of that advantage (normal approximation); None where best_b is the base
    beyond_noise: bool = False

    def chosen_b(self, base_b: int) -> int:
        """The b to deploy for this bucket: its own best only when that beats the base b beyond noise."""
        return self.best_b if self.beyond_noise else base_b


@dataclass
class ContextTable:
    block_sizes: List[int]
    buckets: List[Bucket]
    overall_b: int  # the base b each bucket is compared with (the schedule's b at this c, else the best of all rows)
    by: str  # "tau/cost" or "tau"
    varies: bool = False
    why: str = ""
    chosen: List[int] = field(default_factory=list)  # chosen_b per bucket
    tests: int = 0  # (bucket, other b) pairs in the corrected family (decide)
    best_all: int = 0  # the best b over all rows (the 3-item schedule's b*(c) when both weigh the same costs)


def _interval(x: np.ndarray) -> Tuple[float, float, float]:
    """(mean, low, high) along axis 0 by the normal approximation; zero width with one row."""
    m = x.mean(axis=0)
    half = Z95 * x.std(axis=0, ddof=1) / np.sqrt(len(x)) if len(x) > 1 else np.zeros_like(m)
    return m, m - half, m + half


def length_buckets(prompt_tokens: Sequence[int], n: int = 4) -> np.ndarray:
    """Edges e (ints, strictly increasing): bucket i holds e[i] <= length < e[i + 1]. Inner edges are quantiles
    taken as data values ("higher"), so every bucket starts at a length some row has and is never empty; repeated
    lengths merge quantiles, giving fewer than n buckets."""
    x = np.asarray(prompt_tokens, dtype=np.int64)
    if x.size == 0:
        raise ValueError("no rows to bucket")
    inner = np.quantile(x, np.arange(1, n) / n, method="higher") if n > 1 else np.array([], dtype=np.int64)
    return np.unique(np.concatenate([[x.min()], inner.astype(np.int64), [x.max() + 1]]))


def _with_b1(tau: np.ndarray, candidates: Sequence[int], with_ar: bool = True) -> Tuple[np.ndarray, List[int]]:
    """Sorted block sizes with b = 1 added (tau = 1 by definition) when the labels lack it (and ``with_ar``: a cost
    profile that never timed b = 1 cannot weigh it)."""
    tau, cands = np.asarray(tau, dtype=np.float64), [int(b) for b in candidates]
    if tau.ndim != 2 or tau.shape[1] != len(cands):
        raise ValueError(f"tau has shape {tau.shape}, expected [rows, {len(cands)}]")
    if 1 not in cands and with_ar:
        tau, cands = np.hstack([np.ones((len(tau), 1)), tau]), [1] + cands
    order = np.argsort(cands, kind="stable")
    return tau[:, order], [cands[i] for i in order]


def context_table(prompt_tokens: np.ndarray, tau: np.ndarray, candidates: Sequence[int],
                  cost: Optional[Callable[[int], float]] = None, n: int = 4, with_ar: bool = True,
                  base_b: Optional[int] = None) -> ContextTable:
    """Per length bucket: mean tau per b with 95 % intervals, the best b, and whether the best b varies with length
    beyond noise (module docstring; corrected over this table's buckets; :func:`decide` again over several).
    ``cost``: seconds per step at b for one concurrency. ``base_b``: the b each bucket is compared with (the 3-item
    schedule's at this c); None: the best b over all rows."""
    tau, bs = _with_b1(tau, candidates, with_ar)
    x = np.asarray(prompt_tokens, dtype=np.int64)
    # score: higher is better per row; with a cost, minus seconds per committed token (argmin of cost / tau)
    score = -np.array([cost(b) for b in bs])[None, :] / np.maximum(tau, 1e-6) if cost else tau
    if base_b is not None and int(base_b) not in bs:
        raise ValueError(f"base b={base_b} is not among the block sizes {bs}")
    # argmax returns the first: ties go to the smaller b
    best_all = int(np.argmax(score.mean(axis=0)))
    base = bs.index(int(base_b)) if base_b is not None else best_all
    t = ContextTable(bs, [], bs[base], "tau/cost" if cost else "tau", best_all=bs[best_all])
    edges = length_buckets(x, n)
    for lo, hi in zip(edges[:-1], edges[1:]):
        rows = (x >= lo) & (x < hi)
        m, low, high = _interval(tau[rows])
        best = int(np.argmax(score[rows].mean(axis=0)))
        b = Bucket(int(lo), int(hi) - 1, int(rows.sum()), m.tolist(), low.tolist(), high.tolist(), bs[best])
        if best != base:  # paired per-row advantage of the bucket's b over the base b, same rows
            adv = score[rows, best] - score[rows, base]
            b.gain = tuple(float(v) for v in _interval(adv))
            sd = float(adv.std(ddof=1)) if len(adv) > 1 else 0.0
            z = float(adv.mean()) / (sd / sqrt(len(adv))) if sd > 0 else (np.inf if adv.mean() > 0 else -np.inf)
            b.p = 0.5 * erfc(z / sqrt(2))  # one-sided: P(N(0, 1) > z)
        t.buckets.append(b)
    decide([t])
    return t


def decide(tables: Sequence[ContextTable], alpha: float = ALPHA) -> None:
    """Which buckets beat their table's base b beyond noise, over every table at once: Holm's step-down correction
    (family-wise error ``alpha``, one-sided) over every (bucket, other block size) pair of the buckets of MIN_ROWS
    rows or more in ``tables``, tested or not (a bucket whose best b is the base is a test that found nothing). Sets
    each bucket's ``beyond_noise`` and each table's ``chosen``, ``varies``, ``tests`` and ``why``."""
    family = [b for t in tables for b in t.buckets if b.rows >= MIN_ROWS]
    # each bucket's best b was picked from every other block size before it was tested: each of those counts as a
    # test (a bucket of a population with no length effect otherwise passed as the best of 5 about twice as often)
    m = sum(len(t.block_sizes) - 1 for t in tables for b in t.buckets if b.rows >= MIN_ROWS)
    ranked = sorted((b for b in family if b.p is not None), key=lambda b: b.p)
    passed = set()
    for i, b in enumerate(ranked):
        if b.p > alpha / (m - i):
            break
        passed.add(id(b))
    for t in tables:
        for b in t.buckets:
            b.beyond_noise = id(b) in passed
        t.chosen = [b.chosen_b(t.overall_b) for b in t.buckets]
        t.varies = any(b.beyond_noise for b in t.buckets)
        t.tests = m
        unit = "s/token saved" if t.by == "tau/cost" else "tau gained"
        parts = [f"prompts {b.ctx_lo}-{b.ctx_hi}: b={b.best_b} over b={t.overall_b} by {b.gain[0]:.3g} {unit} "
                 f"[{b.gain[1]:.3g}, {b.gain[2]:.3g}], p {b.p:.2g}" +
                 ("" if b.beyond_noise else " (within noise)" if b.rows >= MIN_ROWS else
                  f" ({b.rows} rows < {MIN_ROWS})")
                 for b in t.buckets if b.best_b != t.overall_b]
        t.why = ("; ".join(parts) if parts else f"the best b is {t.overall_b} in every bucket") + \
            f" (by mean {t.by}, 95 % normal intervals; Holm over {m} test(s) at family-wise {alpha:g})"


def render_table(t: ContextTable) -> List[str]:
    """Markdown: one row per bucket (mean tau [95 % interval] at each b, best b; * = beyond noise), then verdict."""
    lines = ["| prompt tokens | rows | " + " | ".join(f"tau b={b}" for b in t.block_sizes) + f" | best b ({t.by}) |",
             "|---|---:|" + "---:|" * len(t.block_sizes) + "---:|"]
    for b in t.buckets:
        cells = [f"{m:.2f} [{lo:.2f}, {hi:.2f}]" for m, lo, hi in zip(b.mean_tau, b.tau_low, b.tau_high)]
        lines.append(f"| {b.ctx_lo}-{b.ctx_hi} | {b.rows} | " + " | ".join(cells) +
                     f" | {b.best_b}{'*' if b.beyond_noise else ''} |")
    lines.append(f"Best b {'varies' if t.varies else 'does not vary'} with prompt length "
                 f"(overall best b={t.overall_b}): {t.why}.")
    return lines


def context_ranges(t_by_c: Dict[int, ContextTable], bs_max: int = BS_MAX, ctx_max: int = CTX_MAX,
                   no_speculation_from: Optional[int] = None,
                   served: Optional[Dict[int, int]] = None,
                   no_speculation_at: Optional[Sequence[int]] = None) -> List[List[int]]:
    """The 5-item entries [bs_lo, bs_hi, ctx_lo, ctx_hi, K] (K = chosen b - 1), all bounds inclusive, in the form
    vLLM's 5-item validator takes (vllm/v1/spec_decode/dynamic/utils.py at 14b450ca, the PR's code:
    validate_and_normalize_dynamic_sd_schedule): a rectangular (batch size x context) grid, every batch range over
    the same context ranges, those starting at 1 and contiguous (the last is read as unbounded).

    Grid point c holds batch sizes c .. next point - 1 (the first from 1, the last up to ``bs_max``). The context
    ranges are the buckets' (the same rows at every c), each reaching up to the next's ctx_lo - 1; two neighbouring
    context ranges merge where every batch range has the same K in both, two neighbouring batch ranges where their K
    agree in every context range. ``no_speculation_at``: the loads where tune's load check left no speculation (its
    own verdict at a checked load, or the monotone fit's K = 0 above every checked load): K = 0 in every context range
    there, and only there (a load between them keeps its own answer: a tie at c = 4 says nothing of a b kept at
    c = 16). ``no_speculation_from`` (older callers): every load from that one on. ``served``: the 3-item form's b at
    each c; where that b is not among a table's block sizes (a small b the load check timed and kept, b = 2 or 3, which the labels
    never measured), every context range at that c takes it: no bucket there can be compared with it."""
    cs = sorted(t_by_c)
    if not cs or cs[0] < 1 or cs[-1] > bs_max:
        raise ValueError(f"concurrency grid {cs} must lie in 1..{bs_max}")
    buckets = t_by_c[cs[0]].buckets
    if any([(b.ctx_lo, b.ctx_hi) for b in t_by_c[c].buckets] != [(b.ctx_lo, b.ctx_hi) for b in buckets] for c in cs):
        raise ValueError("the tables at each c must bucket the same rows alike")
    ctx = [[1 if j == 0 else bk.ctx_lo, ctx_max if j == len(buckets) - 1 else buckets[j + 1].ctx_lo - 1]
           for j, bk in enumerate(buckets)]
    off = {int(c) for c in (no_speculation_at or ())}

    def fixed(c: int) -> Optional[int]:
        if c in off or (no_speculation_from is not None and c >= no_speculation_from):
            return 1
        b = (served or {}).get(c)
        return b if b is not None and b not in t_by_c[c].block_sizes else None

    ks = [[(fixed(c) or int(b)) - 1 for b in t_by_c[c].chosen] for c in cs]  # [c][bucket]
    j = 1
    while j < len(ctx):  # merge context ranges that no batch range tells apart
        if all(row[j] == row[j - 1] for row in ks):
            ctx[j - 1][1] = ctx[j][1]
            del ctx[j]
            for row in ks:
                del row[j]
        else:
            j += 1
    rows: List[Tuple[int, int, List[int]]] = []
    for i, c in enumerate(cs):
        bs_lo, bs_hi = (1 if i == 0 else c), (cs[i + 1] - 1 if i + 1 < len(cs) else bs_max)
        if rows and rows[-1][2] == ks[i]:
            rows[-1] = (rows[-1][0], bs_hi, ks[i])
        else:
            rows.append((bs_lo, bs_hi, ks[i]))
    return [[lo, hi, a, z, k] for lo, hi, row in rows for (a, z), k in zip(ctx, row)]


def rows_from_shards(shards: Sequence, candidates: Sequence[int], split: Optional[str] = "train",
                     val_fraction: float = 0.3, calibration_fraction: float = 0.15) -> Tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, tau [rows, candidates]) of the label shards' rows in ``split`` ("train", "val" or "calib" as
    split_of names them, with the config's fractions; None: every row): read once, for a table at every c."""
    from pipeline.io.storage import read_table
    from pipeline.policy.blocksize import split_of  # imports torch: only here, so the module stays numpy-only

    ids: List[str] = []
    lengths: List[int] = []
    taus: List[List[float]] = []
    for path in shards:
        tb = read_table(path, columns=["prompt_id", "prompt_tokens", "tau"]).to_pydict()
        ids += tb["prompt_id"]
        lengths += tb["prompt_tokens"]
        taus += tb["tau"]
    if any(len(r) != len(candidates) for r in taus):
        raise ValueError(f"a tau list's length differs from the {len(candidates)} candidates passed")
    keep = [split is None or split_of(i, val_fraction, calibration_fraction) == split for i in ids]
    if not any(keep):
        raise ValueError(f"no rows in split {split!r}")
    return (np.array(lengths, dtype=np.int64)[keep],
            np.array(taus, dtype=np.float64).reshape(len(ids), -1)[keep])


def table_from_shards(shards: Sequence, candidates: Sequence[int], cost: Optional[Callable[[int], float]] = None,
                      split: Optional[str] = "train", val_fraction: float = 0.3, calibration_fraction: float = 0.15,
                      n: int = 4, with_ar: bool = True, base_b: Optional[int] = None) -> ContextTable:
    """context_table over label shards' rows (:func:`rows_from_shards`). ``candidates``: the block sizes each row's
    tau list aligns with."""
    x, tau = rows_from_shards(shards, candidates, split, val_fraction, calibration_fraction)
    return context_table(x, tau, candidates, cost, n, with_ar, base_b)
