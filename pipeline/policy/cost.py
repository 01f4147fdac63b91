"""A measured cost model of one decode step: seconds of the draft forward and of the target verify at block size b.

:func:`measure_profile` times both parts separately at every b in 1..max_block_size, at a few context lengths, on the engine's
own device and dtype: a warm-up decode per (b, context), then rounds of timed decodes (every b once per round, in
a shuffled order, so that load that comes and goes on a shared machine hits every b alike) until the median per-step
cost of every b at every context length moves by less than ``rel_tol`` from one round to the next
(:func:`round_stability`; or ``max_repeats`` rounds). Each timed decode runs at least ``steps`` verify steps
(``max_new_tokens = steps * b + 1``, stop tokens off), since a probe of a few tokens measures one or two steps and is
noise (the old start-up probe: 8 tokens at tau ~4 = 2 steps); b = 1 runs 4x as many (``ar_steps``), since its
cheap steps warm up over the first several of a decode, 4 times a round.

It then fits a smooth model, affine in b per component over b >= 2 (``draft(b) = a + c b``, ``verify(b) = a + c
b``; b = 1 is autoregressive decoding, no draft, and keeps its measured value), and KEEPS the raw points, so a
reader can refit. :class:`CostProfile` is the result; ``cost_profile.json`` is its documented format
(:data:`FORMAT_DOC`). Ray-free.

Two more terms (format version 2), because measured decodes showed them (benchmarks/results/cost-model-error.md):

* the first step of a decode costs more than the others (its draft pass reads the whole prompt's context
  features): the per-step costs are the steady ones, first step excluded, and ``first_step`` is a per-decode
  extra, affine in the prompt length, one for speculative decoding (b >= 2) and one for AR (b = 1);
* a per-step rule's own work (the draft's confidence over the vocabulary at every drafted slot, then the rule):
  ``rule(b)``, affine in the drafted b, timed inside the engine on decodes with a rule that verifies the whole
  block (``threshold:0``, so the verify is the plain one) at a few b.

:meth:`CostProfile.decode_seconds` is the model of one whole decode; a version-1 profile reads with both terms 0.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

FORMAT = "blockpilot.cost_profile"
FORMAT_VERSION = 3
TIMING_RULE = "threshold:0"  # verifies every drafted token, doing all of a threshold rule's work
from pipeline.io.layout import COST_PROFILE as FILENAME  # noqa: E402

FORMAT_DOC = f"""## `{FILENAME}` (format `{FORMAT}`, version {FORMAT_VERSION})

Seconds per decode step (draft forward + target verify) at every block size b in 1..profile.max_block_size, measured by
`blockpilot profile` (or once per label worker) on one machine. Keys:

| key | meaning |
| --- | --- |
| `format`, `version` | `{FORMAT}`, {FORMAT_VERSION} |
| `hardware` | platform, machine, processor, CPU count, torch threads, torch version, GPU name (or null) |
| `device`, `dtype` | the torch device and dtype the models ran in |
| `target`, `draft`, `target_revision`, `draft_revision`, `trained_block_size` | the model pair |
| `block_sizes`, `context_lengths` | the grid measured (prompt tokens before the timed decode) |
| `settings` | steps per timed decode (at least; version 2: `ar_steps` at b = 1, timed `ar_repeats` times a round), warm-up, min/max rounds, the stability tolerance |
| `seconds` | `{{b: seconds per step}}` of the model: the fit for b >= 2, the measured value at b = 1; steady steps (the first step of each decode excluded; version 1: every step). What consumers use |
| `measured` | `{{b: {{draft, verify, total}}}}`: median over rounds of steady seconds per step, mean over context lengths |
| `spread` | `{{b: (p75 - p25) / median}}` of the total per-step seconds over rounds, worst context length |
| `fit` | `{{draft: {{intercept, slope}}, verify: {{intercept, slope}}, from_block_size: 2, max_rel_residual}}`: seconds = intercept + slope x b; version 2 adds `rule: {{intercept, slope}}` (a per-step rule's own seconds per step, by drafted b) and `first_step: {{speculative, autoregressive}}` (each `{{intercept, slope}}`: the first step's extra seconds over a steady one, by prompt tokens) |
| `raw` | every timed point: `{{b, context, round, steps, draft_seconds, verify_seconds}}` (per step, over all steps), warm-ups excluded; version 2 adds `first_draft_seconds`, `first_verify_seconds` (the first step's), `rule` (null, or `{TIMING_RULE}` on the rule's points, which the draft / verify fit leaves out) and `rule_seconds` (per step) |
| `rule_block_sizes` | version 2: the b the rule's points were timed at |
| `rounds`, `stable`, `wall_seconds`, `measured_at` | rounds run, whether every b met the tolerance, time spent, when |
| `pooled_workers` | a label folder's profile only: how many label workers' points (on the same hardware, device, dtype, models and grid) were refitted together; `rounds` is then their sum, `stable` whether every one was |

Version 1 (no `rule`, no `first_step`, per-step costs over all steps) still reads, with both terms 0. Version 3
(pipeline/policy/load_cost.py) adds the concurrency axis; a profile without it reads as c = 1 at every load:

| key | meaning |
| --- | --- |
{{LOAD}}"""


def hardware_info(device: str = "cpu") -> Dict[str, Any]:
    import os

    import torch

    gpu = None
    if str(device).startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "gpu": gpu}


def fit_affine(bs: Sequence[float], ys: Sequence[float]) -> Dict[str, float]:
    """Least-squares ``y = intercept + slope * b`` with ``slope >= 0``: a forward over more tokens never costs less,
    so a negative slope is timing noise (on a tiny draft the 2- and 16-token passes cost about the same) and the
    constrained optimum is then the flat line through the mean."""
    b, y = np.asarray(bs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if len(b) == 1:
        return {"intercept": float(y[0]), "slope": 0.0}
    slope, intercept = np.polyfit(b, y, 1)
    if slope < 0:
        return {"intercept": float(y.mean()), "slope": 0.0}
    return {"intercept": float(intercept), "slope": float(slope)}


@dataclass
class CostProfile:
    """Seconds per decode step by block size; ``cost(b)`` is the model (fit for b >= 2, measured b = 1)."""

    seconds: Dict[int, float]
    measured: Dict[int, Dict[str, float]] = field(default_factory=dict)
    spread: Dict[int, float] = field(default_factory=dict)
    fit: Dict[str, Any] = field(default_factory=dict)
    raw: List[Dict[str, Any]] = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION  # of the format it was measured in (a version-1 profile stays one when re-saved)

    def cost(self, b: int) -> float:
        b = int(b)
        if b in self.seconds:
            return float(self.seconds[b])
        f = self.fit
        if b >= f.get("from_block_size", 2) and "draft" in f:
            return _affine(f["draft"], b) + _affine(f["verify"], b)
        raise KeyError(f"the cost profile has no block size {b} (measured {sorted(self.seconds)})")

    def step_seconds(self, drafted: int, verified: int, rule: bool = True) -> float:
        """One step of a per-step rule (pipeline/policy/step_rules.py): the draft's pass over a block of ``drafted``
        tokens, the rule's own work on it (``rule_seconds``; not with ``rule=False``), then the target's verify over
        the known token + ``verified`` drafted ones (the fitted components apart). A plain step at b is
        ``step_seconds(b, b - 1, rule=False)`` = ``cost(b)``."""
        f = self.fit
        if "draft" in f and "verify" in f and drafted >= f.get("from_block_size", 2):
            return (_affine(f["draft"], drafted) + _affine(f["verify"], verified + 1) +
                    (self.rule_seconds(drafted) if rule else 0.0))
        return self.cost(verified + 1)

    def rule_seconds(self, drafted: int) -> float:
        """A per-step rule's own seconds in one step at ``drafted`` b (0 in a version-1 profile)."""
        return max(0.0, _affine(self.fit["rule"], drafted)) if "rule" in self.fit else 0.0

    def first_step_seconds(self, block_size: int, context: int) -> float:
        """What the first step of a decode costs over a steady one, after a prompt of ``context`` tokens (0 in a
        version-1 profile, whose per-step costs carry it spread over its timed steps)."""
        fs = self.fit.get("first_step") or {}
        p = fs.get("speculative" if block_size >= 2 else "autoregressive")
        return max(0.0, _affine(p, context)) if p else 0.0

    def decode_seconds(self, verified: Sequence[int], block_size: int, rule: bool = False, context: int = 0) -> float:
        """The model of one whole decode with ``verified[i]`` drafted tokens sent at step i: plain decoding at
        ``block_size`` costs ``cost(v + 1)`` a step (the draft and the verify run over the v + 1 tokens, fewer at
        the max_new_tokens cut), a per-step rule ``step_seconds(block_size, v)``; plus the first step's extra."""
        if not verified:
            return 0.0
        steps = (sum(self.step_seconds(block_size, v) for v in verified) if rule else
                 sum(self.cost(v + 1) for v in verified))
        return steps + self.first_step_seconds(block_size, context)

    def costs(self, block_sizes: Sequence[int]) -> Dict[int, float]:
        return {int(b): self.cost(b) for b in block_sizes}

    def to_dict(self) -> Dict[str, Any]:
        return {"format": FORMAT, "version": self.version, **self.meta,
                "seconds": {str(b): v for b, v in sorted(self.seconds.items())},
                "measured": {str(b): v for b, v in sorted(self.measured.items())},
                "spread": {str(b): v for b, v in sorted(self.spread.items())},
                "fit": self.fit, "raw": self.raw}

    def summary(self) -> Dict[str, Any]:
        """The small part (no raw points): what label shard metadata and policy.json carry."""
        d = self.to_dict()
        d.pop("raw")
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "CostProfile":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a cost profile (format {d.get('format')!r}, expected {FORMAT!r})")
        if int(d.get("version", 1)) > FORMAT_VERSION:
            raise ValueError(f"cost profile version {d['version']} is newer than this reader ({FORMAT_VERSION})")
        known = ("format", "version", "seconds", "measured", "spread", "fit", "raw")
        return cls(seconds={int(b): float(v) for b, v in d["seconds"].items()},
                   measured={int(b): v for b, v in d.get("measured", {}).items()},
                   spread={int(b): float(v) for b, v in d.get("spread", {}).items()},
                   fit=d.get("fit", {}), raw=d.get("raw", []),
                   meta={k: v for k, v in d.items() if k not in known}, version=int(d.get("version", 1)))

    @classmethod
    def from_raw(cls, raw: List[Dict[str, Any]], meta: Optional[Dict[str, Any]] = None) -> "CostProfile":
        """The profile the raw points of a ``cost_profile.json`` give (every b and context length they hold), fitted
        as :func:`measure_profile` fits them: what a reader refitting the kept points gets."""
        block_sizes = sorted({int(p["b"]) for p in raw if not p.get("rule")})
        contexts = sorted({int(p["context"]) for p in raw})
        return cls(*_fit(block_sizes, raw, contexts), raw=list(raw), meta=dict(meta or {}))

    def save(self, path: Union[str, Path]) -> None:
        from pipeline.io.shards import write_text_atomic

        write_text_atomic(json.dumps(self.to_dict(), indent=1) + "\n", path)  # local or object storage

    @classmethod
    def load(cls, path: Union[str, Path]) -> "CostProfile":
        from pipeline.io.storage import location

        return cls.from_dict(json.loads(location(path).read_text()))


def _affine(p: Dict[str, float], b: float) -> float:
    return float(p["intercept"] + p["slope"] * b)


def measure_profile(engine, block_sizes: Sequence[int], vocab_size: int,
                    context_lengths: Sequence[int] = (64, 256), steps: int = 16, warmup: int = 1,
                    min_repeats: int = 3, max_repeats: int = 8, rel_tol: float = 0.02, seed: int = 0,
                    meta: Optional[Dict[str, Any]] = None, rule_block_sizes: Optional[Sequence[int]] = None,
                    ar_steps: Optional[int] = None, ar_repeats: int = 4) -> CostProfile:
    """Time the draft forward and the target verify per decode step at every b in ``block_sizes`` (see the module
    docstring), and a per-step rule's own work at ``rule_block_sizes`` (default: the smallest, middle and largest b
    >= 2); returns the fitted profile with its raw points. b = 1 runs ``ar_steps`` steps (default 4 x ``steps``):
    its steps are the cheapest and warm up over the first several of a decode, which ``steps`` of them overstate
    (on the tiny pair by ~7 %, benchmarks/results/cost-model-error.md), where a real AR decode runs hundreds; and
    ``ar_repeats`` times per round and context, spread through the round as the b >= 2 points are (their fit pools
    every b; b = 1 keeps its own median, which one decode per round left at the mercy of one moment's load)."""
    import torch

    from pipeline.policy.step_rules import parse_rule

    t_start = time.perf_counter()
    block_sizes = sorted({int(b) for b in block_sizes})
    multi = [b for b in block_sizes if b >= 2]
    rule_sizes = sorted({int(b) for b in (rule_block_sizes if rule_block_sizes is not None else
                                          (multi[:1] + multi[len(multi) // 2:][:1] + multi[-1:]))})
    timing_rule = parse_rule(TIMING_RULE)
    ar_steps = int(ar_steps or 4 * steps)

    def n_steps(b: int) -> int:
        return ar_steps if b == 1 else steps

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    saved, engine.stop_token_ids = engine.stop_token_ids, None  # every timed decode runs its steps
    raw: List[Dict[str, Any]] = []
    stable = False
    rounds = 0
    try:
        states = {}
        for ctx in context_lengths:
            ids = torch.randint(0, max(2, vocab_size - 8), (1, int(ctx)), generator=g)
            states[int(ctx)] = engine.prefill(ids)

        budget: Dict[tuple, int] = {}  # max_new_tokens that gives about `steps` steps (greedy: the same each time)
        grid = [(b, ctx, None) for b in block_sizes for ctx in states for _ in range(ar_repeats if b == 1 else 1)]
        grid += [(b, ctx, TIMING_RULE) for b in rule_sizes for ctx in states]

        def timed(b: int, ctx: int, rule: Optional[str]):
            r = engine.decode(states[ctx], block_size=b, max_new_tokens=budget.get((b, ctx), n_steps(b) * b + 1),
                              step_rule=timing_rule if rule else None)
            n = max(1, r.steps)
            fd, fv = r.first_step_seconds
            return r, {"b": b, "context": ctx, "steps": r.steps, "draft_seconds": r.draft_seconds / n,
                       "verify_seconds": r.verify_seconds / n, "first_draft_seconds": fd,
                       "first_verify_seconds": fv, "rule": rule, "rule_seconds": r.rule_seconds / n}

        for b, ctx, rule in dict.fromkeys(grid):  # each once
            for _ in range(max(1, warmup)):
                r = timed(b, ctx, rule)[0]
            if rule is None:  # the warm-up's own acceptance sets the token budget of this (b, context)
                budget[(b, ctx)] = max(2, int(sum(r.committed[:n_steps(b)])) + 1)
        for rounds in range(1, max_repeats + 1):
            for i in rng.permutation(len(grid)):
                raw.append({**timed(*grid[i])[1], "round": rounds})
            if rounds >= min_repeats:
                stable = round_stability(raw, rel_tol)["stable"]
                if stable:
                    break
    finally:
        engine.stop_token_ids = saved

    seconds, measured, spread, fit = _fit(block_sizes, raw, list(states))
    info = {"device": str(engine.device), "dtype": str(next(engine.target.parameters()).dtype).replace("torch.", ""),
            "hardware": hardware_info(str(engine.device)), **(meta or {}),
            "block_sizes": block_sizes, "context_lengths": [int(c) for c in context_lengths],
            "rule_block_sizes": rule_sizes,
            "settings": {"steps": steps, "ar_steps": ar_steps, "ar_repeats": ar_repeats, "warmup": warmup,
                         "min_repeats": min_repeats, "max_repeats": max_repeats, "rel_tol": rel_tol, "seed": seed},
            "rounds": rounds, "stable": bool(stable), "wall_seconds": round(time.perf_counter() - t_start, 2),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return CostProfile(seconds, measured, spread, fit, raw, info)


def round_stability(raw: List[Dict[str, Any]], rel_tol: float) -> Dict[str, Any]:
    """Whether the last round moved no (b, context)'s median per-step seconds by more than ``rel_tol`` (relative to
    the new median): per (b, context), the median of the plain points' steady draft + verify seconds over every
    round so far against the same median without the last round. From the raw points and per (b, context), not from
    the fit: the affine fit pools every b, so one b drifting moves it by a fraction of that b's own move and passes.
    {"stable", "worst": {b, context, move} or None}; not stable before two rounds."""
    plain = [p for p in raw if not p.get("rule")]
    last = max((int(p["round"]) for p in plain), default=0)
    worst: Optional[Dict[str, Any]] = None
    if last < 2:
        return {"stable": False, "worst": worst}
    cells: Dict[tuple, List[tuple]] = {}
    for p in plain:
        s = steady(p)
        cells.setdefault((int(p["b"]), int(p["context"])), []).append((int(p["round"]), s["draft"] + s["verify"]))
    stable = True
    for (b, ctx), pts in sorted(cells.items()):
        before = [t for r, t in pts if r < last]
        now = float(np.median([t for _, t in pts]))
        if not before:  # a (b, context) new in the last round has not settled
            move = float("inf")
        else:
            prev = float(np.median(before))
            move = abs(now - prev) / now if now > 0 else (0.0 if prev == 0 else float("inf"))
        stable &= move <= rel_tol
        if worst is None or move > worst["move"]:
            worst = {"b": b, "context": ctx, "move": move}
    return {"stable": bool(stable), "worst": worst}


def steady(p: Dict[str, Any]) -> Dict[str, float]:
    """A raw point's {draft, verify} seconds per step over its steady steps (the first one left out; a version-1
    point, which has no first step apart, over all of them)."""
    n = int(p.get("steps", 1))
    if "first_draft_seconds" not in p or n < 2:
        return {"draft": p["draft_seconds"], "verify": p["verify_seconds"]}
    return {k: (n * p[f"{k}_seconds"] - p[f"first_{k}_seconds"]) / (n - 1) for k in ("draft", "verify")}


def _fit(block_sizes: Sequence[int], raw: List[Dict[str, Any]], contexts: Sequence[int]):
    """(seconds, measured, spread, fit) from the raw points: medians over rounds of the steady per-step seconds,
    mean over context lengths, an affine fit per component over b >= 2, the measured value at b = 1; then the
    first step's extra by prompt length and the rule's own seconds by b."""
    measured, spread = {}, {}
    plain = [p for p in raw if not p.get("rule")]
    for b in block_sizes:
        per_ctx = {}
        for ctx in contexts:
            sub = [steady(p) for p in plain if p["b"] == b and p["context"] == ctx]
            per_ctx[ctx] = {k: float(np.median([p[k] for p in sub])) for k in ("draft", "verify")}
            tot = np.array([p["draft"] + p["verify"] for p in sub])
            q25, q50, q75 = np.percentile(tot, [25, 50, 75])
            spread[b] = max(spread.get(b, 0.0), float((q75 - q25) / q50) if q50 > 0 else 0.0)
        m = {k: float(np.mean([per_ctx[c][k] for c in per_ctx])) for k in ("draft", "verify")}
        m["total"] = m["draft"] + m["verify"]
        measured[b] = m
    multi = [b for b in block_sizes if b >= 2]
    fit: Dict[str, Any] = {"from_block_size": 2}
    seconds = {}
    if multi:
        for k in ("draft", "verify"):
            fit[k] = fit_affine(multi, [measured[b][k] for b in multi])
        for b in multi:
            seconds[b] = _affine(fit["draft"], b) + _affine(fit["verify"], b)
        fit["max_rel_residual"] = float(max(abs(seconds[b] - measured[b]["total"]) / measured[b]["total"]
                                            for b in multi))
    for b in block_sizes:
        if b < 2:
            seconds[b] = measured[b]["total"]
    fit.update(_extra_terms(plain, [p for p in raw if p.get("rule")], contexts))
    return seconds, measured, spread, fit


def _extra_terms(plain: List[Dict[str, Any]], ruled: List[Dict[str, Any]], contexts: Sequence[int]
                 ) -> Dict[str, Any]:
    """``first_step`` (per kind, affine in the prompt length: the median over b and rounds of the first step's
    seconds minus a steady step's, per context) and ``rule`` (affine in b: the median rule seconds per step), from
    version-2 points; {} from version-1 ones."""
    out: Dict[str, Any] = {}
    first = [p for p in plain if "first_draft_seconds" in p and p.get("steps", 0) >= 2]
    if first:
        out["first_step"] = {}
        for kind, sel in (("speculative", lambda b: b >= 2), ("autoregressive", lambda b: b < 2)):
            ctxs, extra = [], []
            for ctx in contexts:
                sub = [p for p in first if sel(p["b"]) and p["context"] == ctx]
                if sub:
                    ctxs.append(ctx)
                    extra.append(float(np.median([first_step_extra(p) for p in sub])))
            if ctxs:
                out["first_step"][kind] = fit_affine(ctxs, extra)
    if ruled:
        bs = sorted({p["b"] for p in ruled})
        out["rule"] = fit_affine(bs, [float(np.median([p["rule_seconds"] for p in ruled if p["b"] == b]))
                                      for b in bs])
    return out


def first_step_extra(p: Dict[str, Any]) -> float:
    """A version-2 raw point's first step seconds over one of its steady steps."""
    s = steady(p)
    return p["first_draft_seconds"] + p["first_verify_seconds"] - s["draft"] - s["verify"]


def largest_decoded_block_size(cfg, trained_block_size: int, candidates: Sequence[int] = ()) -> int:
    """The largest b a run of ``cfg`` decodes or models: the candidates, the trace b_max (label.trace_block_size,
    None = B + B // 4) and evaluate's fixed block sizes (None = the paper's set, up to 2B)."""
    B = int(trained_block_size)
    fixed = cfg.evaluate.fixed_block_sizes
    return max([*map(int, candidates), cfg.label.trace_block_size or B + B // 4,
                *(map(int, fixed) if fixed is not None else [2 * B])])


def profile_for(engine, cfg, trained_block_size: int, candidates: Sequence[int] = (),
                meta: Optional[Dict[str, Any]] = None) -> CostProfile:
    """The profile the config asks for (``cfg.profile``) on this engine: b in 1..profile.max_block_size (None: the
    largest b the run decodes, :func:`largest_decoded_block_size`) plus every candidate."""
    p = cfg.profile
    top = p.max_block_size or largest_decoded_block_size(cfg, trained_block_size, candidates)
    sizes = sorted(set(range(1, top + 1)) | {int(b) for b in candidates})
    vocab = int(engine.target.get_output_embeddings().weight.shape[0])
    m = cfg.model
    info = {"target": m.target, "draft": m.draft, "trained_block_size": int(trained_block_size), **(meta or {})}
    return measure_profile(engine, sizes, vocab, context_lengths=p.context_lengths, steps=p.steps,
                           min_repeats=p.min_repeats, max_repeats=p.max_repeats, rel_tol=p.rel_tol,
                           seed=cfg.decode.seed, meta=info)
