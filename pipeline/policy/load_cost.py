"""The cost of a step under load: seconds per batched decode step at every (b, c), and the model of a ragged step.

``cost_profile.json`` version 3 adds a concurrency axis to version 2 (:mod:`pipeline.policy.cost`): the top level
stays the c = 1 profile, measured by the batch-1 engine as before, and ``load`` holds, per c > 1, what
:func:`pipeline.decoding.load_profile.measure_load` timed on the batched engine (c streams at one b): the median
steady seconds per step of the draft and of the verify at each b, and an affine fit in b per component. A profile
without ``load`` reads as c = 1 at every load.

The batched engine is ragged (pipeline.decoding.batched: linear layers over the rows' tokens, attention per row), so
a step of ``rows`` rows whose blocks differ costs what ``rows`` rows at their MEAN block cost:
``draft_c(mean drafted b, W) + verify_c(mean verified + 1, W)`` at c = rows, where W is the keys each row's
attention reads (the engine pads attention to the step's longest row), each fit interpolated linearly in c between
the grid's points (:meth:`LoadCost.step_seconds`). The width axis is measured, not assumed: at c = 16 on the tiny
pair a b = 6 step costs 16 ms at 64 keys a row and 36 ms at 900 (benchmarks/results/default-run-load.md), so a
model at the profile's short contexts underestimates the evaluation's longer ones. How well that fits measured runs: evaluate's
``load.cost_model`` (modelled / measured seconds per method and c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from pipeline.policy.cost import FORMAT_DOC, CostProfile, _affine, fit_affine
from pipeline.policy.vllm_sweep import SWEEP_DOC

LOAD_DOC = """| `load_skipped` | version 3, instead of `load`: why the pair has no load grid (the batched engine refuses it) |
| `load_seconds` | version 3: seconds spent timing the load grid (part of `wall_seconds`) |
| `concurrency` | version 3: the c grid, 1 first (`profile.concurrency`) |
| `load` | version 3: `{c: {seconds, measured, fit, raw}}` for each c > 1, timed on the batched engine with c streams at one b (steady steps, the first of each stream left out): `seconds` `{b: seconds per batched step}` of the model (fit for b >= 2, measured at b = 1), `measured` `{b: {draft, verify, total}}` medians over rounds, mean over contexts, `fit` `{draft, verify: {intercept, slope, per_key, per_key_b, ref_width}, ar: {intercept, per_key, ref_width}}`: seconds = intercept + slope b + (per_key + per_key_b b)(W - ref_width) at W keys per row (profiles before the width axis: `{intercept, slope}` alone), `raw` `{b, context, round, steps, width, draft_seconds, verify_seconds}` per timed run (`width`: the mean keys per row of its steps) |
"""

# The whole format, both versions' keys, and what an imported vLLM sweep adds (the label card prints it).
PROFILE_DOC = FORMAT_DOC.replace("{LOAD}", LOAD_DOC.rstrip("\n")) + "\n" + SWEEP_DOC


def fit_load(raw: List[Dict[str, Any]], block_sizes: Sequence[int], contexts: Sequence[int]) -> Dict[str, Any]:
    """{seconds, measured, fit, raw} of one c from its raw points: medians over rounds, mean over contexts, fits in b
    over b >= 2 (b = 1 keeps its measured value). With the points' ``width`` (keys per row; profiles since the width
    axis) each fit is :func:`fit_width`'s, stated at the points' mean width, and ``fit["ar"]`` is b = 1's."""
    measured = {}
    for b in block_sizes:
        per = [{k: float(np.median([p[f"{k}_seconds"] for p in raw if p["b"] == b and p["context"] == ctx]))
                for k in ("draft", "verify")} for ctx in contexts if any(p["b"] == b and p["context"] == ctx
                                                                          for p in raw)]
        m = {k: float(np.mean([x[k] for x in per])) for k in ("draft", "verify")}
        measured[int(b)] = {**m, "total": m["draft"] + m["verify"]}
    multi = [b for b in measured if b >= 2]
    if raw and all("width" in p for p in raw) and len({round(p["width"]) for p in raw}) > 1:
        ref = float(np.mean([p["width"] for p in raw]))
        fit = {k: fit_width([p for p in raw if p["b"] >= 2], k, ref) for k in ("draft", "verify")} if multi else {}
        if 1 in measured:
            fit["ar"] = fit_width([p for p in raw if p["b"] == 1], "total", ref)
    else:
        fit = {k: fit_affine(multi, [measured[b][k] for b in multi]) for k in ("draft", "verify")} if multi else {}
    seconds = {b: (_affine(fit["draft"], b) + _affine(fit["verify"], b)) if b >= 2 else measured[b]["total"]
               for b in measured}
    return {"seconds": seconds, "measured": measured, "fit": fit, "raw": raw}


def fit_width(points: List[Dict[str, Any]], part: str, ref_width: float) -> Dict[str, float]:
    """Least squares ``y = intercept + slope * b + (per_key + per_key_b * b) * (W - ref_width)`` over raw points
    (``part`` "draft", "verify" or "total" seconds; W the step's keys per row): a row's attention reads W keys for
    each of its b queries, so the width adds a term in W and one in b x W. A single b fits no b terms."""
    b = np.array([p["b"] for p in points], float)
    w = np.array([p["width"] for p in points], float) - ref_width
    y = np.array([p["draft_seconds"] + p["verify_seconds"] if part == "total" else p[f"{part}_seconds"]
                  for p in points], float)
    one_b = len(set(b.tolist())) == 1
    x = np.stack([np.ones_like(b), w] if one_b else [np.ones_like(b), b, w, b * w], axis=1)
    coef = np.linalg.lstsq(x, y, rcond=None)[0].tolist()
    i, sl, pk, pkb = (coef[0], 0.0, coef[1], 0.0) if one_b else coef
    if min(pk + pkb * b.min(), pk + pkb * b.max()) < -1e-10:  # below 0.1 ns a key: rounding, not a slope
        # Keys never make a step cheaper: a negative slope is the profile's noise (AR's per-key cost is small
        # beside its step and came out negative at c = 4, 8 and 16 in default runs), and extrapolated to the
        # evaluation's longer rows it models those steps too fast. Refit without the width terms.
        x = x[:, :1] if one_b else x[:, :2]
        coef = np.linalg.lstsq(x, y, rcond=None)[0].tolist()
        i, sl, pk, pkb = (coef[0], 0.0 if one_b else coef[1], 0.0, 0.0)
    return {"intercept": float(i), "slope": float(sl), "per_key": float(pk), "per_key_b": float(pkb),
            "ref_width": float(ref_width)}


def _at_width(p: Dict[str, float], b: float, width: Optional[float]) -> float:
    """A fit at block size b and ``width`` keys per row (None, or a fit without the width axis: its reference)."""
    y = _affine(p, b)
    if width is not None and "ref_width" in p:
        y += (p.get("per_key", 0.0) + p.get("per_key_b", 0.0) * b) * (width - p["ref_width"])
    return float(y)


@dataclass
class LoadCost:
    """Per-c draft and verify fits (c = 1 from the profile's top level), interpolated linearly in c."""

    profile: CostProfile
    grid: Dict[int, Dict[str, Any]]  # c -> {"draft": {intercept, slope}, "verify": ..., "ar": seconds at b = 1}

    @classmethod
    def from_profile(cls, profile: CostProfile) -> "LoadCost":
        f = profile.fit
        if "draft" not in f:  # a profile of seconds alone: the line through them, all of it the verify's
            multi = sorted(b for b in profile.seconds if b >= 2)
            f = {"draft": {"intercept": 0.0, "slope": 0.0},
                 "verify": fit_affine(multi, [profile.seconds[b] for b in multi])}
        ar = profile.seconds.get(1)
        grid = {1: {"draft": f["draft"], "verify": f["verify"], "ar": ar}}
        for c, part in (profile.meta.get("load") or {}).items():
            seconds = {int(b): float(s) for b, s in part["seconds"].items()}
            grid[int(c)] = {"draft": part["fit"]["draft"], "verify": part["fit"]["verify"], "ar": seconds.get(1),
                            "ar_width": part["fit"].get("ar")}
        return cls(profile, dict(sorted(grid.items())))

    @property
    def concurrency(self) -> List[int]:
        return list(self.grid)

    def _at(self, c: float, part: str) -> Dict[str, float]:
        """A fit at c rows: each coefficient linear in c between grid points, extended from the last two (a width
        term missing at one point, as at c = 1, counts as 0 there)."""
        cs = [x for x in self.concurrency if self.grid[x].get(part)]
        if not cs:
            return {}
        if len(cs) == 1 or c <= cs[0]:
            return self.grid[cs[0]][part]
        hi = next((i for i, x in enumerate(cs) if x >= c), len(cs) - 1)
        lo = max(hi - 1, 0)
        a, b = cs[lo], cs[hi]
        w = (c - a) / (b - a)
        pa, pb = self.grid[a][part], self.grid[b][part]
        out = {k: (1 - w) * pa.get(k, 0.0) + w * pb.get(k, 0.0) for k in ("intercept", "slope", "per_key", "per_key_b")}
        out["slope"] = max(0.0, out["slope"])
        ref = pb.get("ref_width", pa.get("ref_width"))
        if ref is not None:
            out["ref_width"] = ref
        return out

    def _ar(self, c: float, width: Optional[float] = None) -> float:
        pts = [(x, g["ar"]) for x, g in self.grid.items() if g.get("ar") is not None]
        if not pts:
            raise KeyError("the cost profile has no b = 1 (autoregressive) seconds")
        xs, ys = zip(*pts)
        base = float(np.interp(c, xs, ys)) if c <= xs[-1] or len(xs) == 1 else \
            float(ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (c - xs[-1]))
        fit = self._at(c, "ar_width")
        return base + (_at_width(fit, 1, width) - _affine(fit, 1) if fit else 0.0)

    def cost(self, b: int, c: int, width: Optional[float] = None) -> float:
        """Seconds of one batched step of c streams, each at block size b, with ``width`` keys per row (None: the
        profile's mean width); c = 1: the profile's own cost(b)."""
        if c == 1:
            return self.profile.cost(b)
        if b < 2:
            return self._ar(c, width)
        return _at_width(self._at(c, "draft"), b, width) + _at_width(self._at(c, "verify"), b, width)

    def at(self, c: int) -> CostProfile:
        """The profile of one stream's step at load c, in the c = 1 format: what the speed targets, the train-chosen
        b and every per-request comparison read. A stream's share of a batched step is cost(b, c) / c; the
        comparisons between block sizes at one c need only the ratios, so the batched step's seconds stand in."""
        if c == 1:
            return self.profile
        fit = {**self.profile.fit, "draft": self._at(c, "draft"), "verify": self._at(c, "verify")}
        fit.pop("first_step", None)  # a batched step's first is no dearer per stream: its prefill is apart
        if "rule" in fit:  # the batched engine runs a rule row by row: c rows' worth per step
            fit["rule"] = {k: v * c for k, v in fit["rule"].items()}
        seconds = {b: self.cost(b, c) for b in self.profile.seconds}
        return CostProfile(seconds, fit=fit, meta={**self.profile.meta, "at_concurrency": int(c)},
                           version=self.profile.version)

    def step_seconds(self, rows: int, verify_tokens: int, drafting: int = 0, draft_tokens: int = 0,
                     width: Optional[float] = None) -> float:
        """The ragged model of one batched step: ``rows`` rows verifying ``verify_tokens`` tokens in all, of which
        ``drafting`` rows drafted ``draft_tokens`` block positions in all (a b = 1 row drafts nothing), each row's
        attention over ``width`` keys (None: the profile's mean width)."""
        if rows < 1:
            return 0.0
        verify = _at_width(self._at(rows, "verify"), verify_tokens / rows, width)
        if drafting == 0:  # every row autoregressive: the measured b = 1 step
            return self._ar(rows, width)
        return verify + _at_width(self._at(drafting, "draft"), draft_tokens / drafting, width)

    def run_seconds(self, steps: Sequence[Any]) -> float:
        """The model of a batched run's decode steps (pipeline.decoding.batched.BatchStep, kind "decode"; needs
        ``drafting``)."""
        return float(sum(self.step_seconds(s.rows, s.verify_tokens, s.drafting, s.draft_tokens,
                                           getattr(s, "width", 0) or None) for s in steps if s.kind == "decode"))


def padded_width(widths: Sequence[float], c: int) -> float:
    """The expected keys a row's attention reads in a step of c rows drawn from ``widths``: the batched engine pads
    a step's attention to its longest row, so E[max of c draws] (the empirical distribution, with replacement):
    sum_i w_(i) (F_i^c - F_(i-1)^c) over the sorted widths."""
    w = np.sort(np.asarray(widths, dtype=np.float64))
    n = len(w)
    upto = np.arange(1, n + 1) / n
    return float((w * (upto ** c - (upto - 1 / n) ** c)).sum())


def schedule(tau_train: np.ndarray, candidates: Sequence[int], load: LoadCost,
             concurrency: Sequence[int], widths: Optional[Sequence[float]] = None) -> Dict[int, int]:
    """b*(c): at each c the one fixed b with the least modelled time per token on the train rows (mean of cost(b, c)
    / tau), as the train-chosen b is chosen at c = 1; ties to the smaller b. b = 1, no speculation (tau 1 on every
    row by definition), is always one of the options where the profile timed it: at high load a verify of b tokens
    costs up to b times a plain step, and then not speculating is the fastest (issue #44: AR beat every b at c = 16
    on the default run). ``widths``: the train rows' mean keys a row (pipeline.training.data.Splits.widths); each c's
    costs are then taken at :func:`padded_width`, the width its steps run at, rather than at the profile's mean
    (b's per-key cost grows with its b queries, so a wider step favours the smaller b: at c = 16 on the default run
    that width was ~1.7x the profile's)."""
    options, tau = list(candidates), np.asarray(tau_train, dtype=np.float64)
    if 1 not in options and has_ar(load):
        options, tau = [1, *options], np.hstack([np.ones((len(tau), 1)), tau])
    out = {}
    for c in concurrency:
        width = padded_width(widths, c) if widths is not None and len(widths) and c > 1 else None
        costs = np.array([load.cost(b, c, width) for b in options])
        out[int(c)] = int(options[int(np.argmin((costs[None, :] / tau).mean(axis=0)))])
    return out


def has_ar(load: LoadCost) -> bool:
    """Whether the profile timed b = 1 at every load (profiles measure 1..2B; an imported one may lack K = 0)."""
    return 1 in load.profile.seconds and all(g.get("ar") is not None for c, g in load.grid.items() if c > 1)


def vllm_ranges(sched: Dict[int, int], top: int = 1024) -> List[List[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` from b*(c): ``[start_bs, end_bs, K]`` entries (inclusive
    concurrency ranges; K = b - 1 draft tokens, K = 0 where b*(c) = 1: no speculation), each grid point's b holding
    from it up to the next point - 1 and the last one up to ``top``; neighbouring points with the same K merge. The
    form of vLLM's docs/features/speculative_decoding/dynamic_speculative_decoding.md; the rules it must pass are
    :func:`vllm_schedule_errors`'."""
    cs = sorted(int(c) for c in sched)
    out: List[List[int]] = []
    for i, c in enumerate(cs):
        hi = cs[i + 1] - 1 if i + 1 < len(cs) else max(top, c)
        k = int(sched[c]) - 1
        if out and out[-1][2] == k:
            out[-1][1] = hi
        else:
            out.append([1 if i == 0 else c, hi, k])
    return out


def vllm_schedule_errors(ranges: Any, num_speculative_tokens: Any) -> List[str]:
    """What vLLM would refuse in a 3-item ``num_speculative_tokens_per_batch_size``, restated from its own checks
    (vllm-project/vllm ``vllm/v1/spec_decode/dynamic/utils.py`` at a6f6bb1d: validate_and_normalize_dynamic_sd_schedule
    and build_dynamic_sd_schedule_lookup): a non-empty list of 3-item entries; positive ranges, start <= end; K >= 0;
    sorted by start and non-overlapping; the first range starting at 1; ``num_speculative_tokens`` > 0 (the lookup
    refuses 0, so a schedule of K = 0 everywhere is no speculative config at all). vLLM clips a K above
    ``num_speculative_tokens`` silently (min(K, num_speculative_tokens)): ours refuses it, since the clip would
    deploy another K than the one chosen. [] when valid."""
    if not isinstance(ranges, list) or not ranges:
        return ["the schedule must be a non-empty list"]
    errors = []
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens <= 0:
        errors.append(f"num_speculative_tokens must be > 0 (got {num_speculative_tokens!r})")
    parsed = []
    for e in ranges:
        if not isinstance(e, (list, tuple)) or len(e) != 3:
            errors.append(f"entry {e!r} is not a 3-item (range_start, range_end, K)")
            continue
        lo, hi, k = (int(x) for x in e)
        if lo <= 0 or hi <= 0:
            errors.append(f"range ({lo}, {hi}) must be positive")
        if lo > hi:
            errors.append(f"range start {lo} > end {hi}")
        if k < 0:
            errors.append(f"K {k} < 0")
        if isinstance(num_speculative_tokens, int) and k > num_speculative_tokens:
            errors.append(f"K {k} > num_speculative_tokens {num_speculative_tokens} (vLLM would clip it)")
        parsed.append((lo, hi, k))
    parsed.sort()
    end = 0
    for lo, hi, _ in parsed:
        if lo <= end:
            errors.append("ranges must be sorted and non-overlapping")
        end = hi
    if parsed and parsed[0][0] != 1:
        errors.append("the first range must start at 1")
    return errors


def pool_load(loads: Sequence[Dict[str, Any]], contexts: Sequence[int]) -> Dict[str, Any]:
    """Several workers' ``load`` parts refitted together from their raw points (as the c = 1 points are pooled)."""
    out = {}
    for c in sorted({c for load in loads for c in load}, key=int):
        raw = [p for load in loads for p in load.get(c, {}).get("raw", [])]
        part = fit_load(raw, sorted({p["b"] for p in raw}), contexts)
        out[c] = {"seconds": {str(b): v for b, v in part["seconds"].items()},
                  "measured": {str(b): v for b, v in part["measured"].items()}, "fit": part["fit"], "raw": raw}
    return out
