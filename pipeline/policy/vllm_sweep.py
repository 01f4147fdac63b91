"""A ``vllm bench sweep serve`` result folder as a cost profile (``cost_profile.json`` version 3): the serving engine's
seconds per batched decode step at every (b, c) it ran, b = K + 1. Ray-free. From vllm-project/vllm's own source:

* ``vllm/benchmarks/sweep/serve.py`` (commit 0031557f20f5): a folder ``SERVE--<serve name>-BENCH--<bench name>`` per
  combination, with ``run=<n>.json`` per run and ``summary.json``, a JSON list of the runs' records: the bench result
  with the serve, then the bench overrides (``speculative_config[.num_speculative_tokens]``, ``max_concurrency``) and
  ``run_number`` merged in at top level; ``*failure.json`` for a failed run (``--continue-on-error``);
  ``summary.csv`` (pandas ``to_csv`` of all records, a dict cell as ``str(dict)``) written when the sweep ends.
* ``vllm/benchmarks/serve.py`` (commit 009e6d4a1cd6): ``output_throughput`` (output tokens / duration),
  ``mean_tpot_ms`` (per request ``(latency - ttft) / (output_len - 1)``, mean over requests), ``max_concurrency``,
  ``completed``, ``failed``, ``num_prompts``; with speculation, ``spec_decode_acceptance_length`` (``1 + accepted /
  drafts``) and ``spec_decode_per_position_acceptance_rates``.
* ``vllm/benchmarks/sweep/tune_speculative_k.py`` (commit 318528f63c2d): K is ``speculative_config.``
  ``num_speculative_tokens_per_batch_size`` (a ``[[start, end, K]]`` schedule) or ``...num_speculative_tokens``,
  flat dotted or nested; it reads every ``summary.json``, and so does :func:`read_sweep` (values stay typed; a bad
  file costs only its combination), ``summary.csv`` only when there is none. No speculative config, no K, no spec
  metrics: K = 0, tau = 1; a speculative config without a K is refused, not read as K = 0.
"""

from __future__ import annotations

import ast
import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from pipeline.policy.cost import FORMAT, FORMAT_VERSION, _affine, fit_affine

SCHEDULE_KEY = "speculative_config.num_speculative_tokens_per_batch_size"
K_KEY = "speculative_config.num_speculative_tokens"


@dataclass(frozen=True)
class SweepPoint:
    """One benchmark run of the sweep: K draft tokens at ``max_concurrency`` c."""

    k: int
    concurrency: int
    output_throughput: float  # output tokens / s, all streams
    mean_tpot_ms: float
    acceptance_length: float  # tau: tokens a step yields per request, the bonus token included (1 at K = 0)
    per_position: Optional[List[float]]
    file: str
    run_number: Optional[int] = None
    speculative: Optional[bool] = None  # the server had a speculative config (at K = 0: the drafter still runs)

    @property
    def speculative_k0(self) -> bool:
        """K = 0 inside a speculative server: not plain vLLM (module docstring)."""
        return self.k == 0 and bool(self.speculative)

    @property
    def block_size(self) -> int:
        return self.k + 1

    @property
    def step_seconds(self) -> float:
        """One batched decode step of c streams at b = K + 1: TPOT x tau. vLLM's TPOT is a request's time after its
        first token over its tokens after the first, and a step yields tau tokens per request. It is the figure used
        because it leaves out time to first token (queueing, the request's prefill), which our model keeps apart."""
        return self.mean_tpot_ms / 1000.0 * self.acceptance_length

    @property
    def throughput_step_seconds(self) -> float:
        """The same from throughput, c x tau / output_throughput: it also counts prefill, TTFT and the ramp-up and
        tail with fewer than c streams, so it reads above :attr:`step_seconds`; kept in the raw points to check."""
        return self.concurrency * self.acceptance_length / self.output_throughput


class SweepRead(NamedTuple):
    points: List[SweepPoint]
    rejects: List[Dict[str, Any]]  # {"file", "record" (index, or None), "reason"}


def _parse(v: Any) -> Any:
    """A value given as text (a CSV cell, a JSON-string override): JSON, else a Python literal (str(dict)), else it."""
    for parse in (json.loads, ast.literal_eval) if isinstance(v, str) else ():
        try:
            return parse(v)
        except (ValueError, SyntaxError):
            pass
    return v


def _get(rec: Dict[str, Any], key: str) -> Any:
    """``key`` as a flat dotted key or nested dicts, parts spelt with ``_`` or ``-`` (as the tuner); None: missing."""
    if key in rec:
        return _parse(rec[key])
    v: Any = rec
    for part in key.split("."):
        v = _parse(v)
        hit = [p for p in (part, part.replace("_", "-")) if isinstance(v, dict) and p in v]
        v = v[hit[0]] if hit else None
    return _parse(v)


def _num(rec: Dict[str, Any], key: str, positive: bool = True) -> float:
    v = _get(rec, key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{key} = {v!r} (None: missing), not a {'positive ' * positive}number")
    return float(v)


def _k_of(rec: Dict[str, Any], c: int) -> Optional[int]:
    """K at c as tune_speculative_k._extract_k reads it (a schedule's last range from at most c); None: none named."""
    k = _get(rec, SCHEDULE_KEY) if _get(rec, SCHEDULE_KEY) is not None else _get(rec, K_KEY)
    if isinstance(k, list) and k:
        rows = sorted((int(r[0]), int(r[2])) for r in k)
        return next((kk for start, kk in reversed(rows) if start <= c), rows[0][1])
    if k is not None and (not isinstance(k, (int, float)) or isinstance(k, bool) or k != int(k) or k < 0):
        raise ValueError(f"K = {k!r} is not a non-negative integer")
    return None if k is None else int(k)


def _point(rec: Any, file: str) -> SweepPoint:
    if not isinstance(rec, dict):
        raise ValueError("the record is not a JSON object")
    if _get(rec, "failed") is not None and _num(rec, "failed", positive=False) > 0:
        raise ValueError(f"{_num(rec, 'failed'):g} failed request(s): only complete runs count (as in vLLM's tuner)")
    if _get(rec, "num_prompts") is not None and _num(rec, "completed", positive=False) != _num(rec, "num_prompts"):
        raise ValueError(f"completed {_num(rec, 'completed', False):g} of {_num(rec, 'num_prompts'):g} prompts")
    if _get(rec, "max_concurrency") is None:
        raise ValueError("no max_concurrency: a run by request rate alone has no fixed number of streams")
    c = int(_num(rec, "max_concurrency"))
    thr, tpot, k = _num(rec, "output_throughput"), _num(rec, "mean_tpot_ms"), _k_of(rec, c)
    if k is None and _get(rec, "spec_decode_acceptance_length") is not None:
        raise ValueError("speculative metrics but no K in the record (set it in the serve params, not the serve cmd)")
    spec = _get(rec, "speculative_config")
    if k is None and (spec not in (None, {}, "") or any(str(key).startswith("speculative_config.") for key in rec)):
        raise ValueError("a speculative run (speculative_config set) with no K and no acceptance metrics: refused, "
                         "not read as K = 0")
    tau, per = 1.0, None
    if k:  # a K = 0 step yields one token per request, whatever the counters say
        tau = _num(rec, "spec_decode_acceptance_length")
        if not 1.0 <= tau <= k + 1 + 1e-9:
            raise ValueError(f"acceptance length {tau} outside [1, K + 1 = {k + 1}]")
        pp = _get(rec, "spec_decode_per_position_acceptance_rates")
        per = [float(x) for x in pp] if isinstance(pp, list) else None
    run = int(_num(rec, "run_number", False)) if _get(rec, "run_number") is not None else None
    return SweepPoint(k or 0, c, thr, tpot, tau, per, file, run, speculative=k is not None)


def read_sweep(folder: Union[str, Path]) -> SweepRead:
    """Every run of a ``vllm bench sweep serve`` folder, and each record or file it cannot use with the reason
    (failed requests, a run cut short, no concurrency, no acceptance length at K >= 1, a failed or unfinished run)."""
    folder, points, rejects = Path(folder), [], []

    def take(rec: Any, file: Path, i: Optional[int]) -> None:
        try:
            points.append(_point(rec, str(file)))
        except (ValueError, TypeError, KeyError, IndexError) as e:
            rejects.append({"file": str(file), "record": i, "reason": str(e)})

    summaries = sorted(folder.rglob("summary.json"))
    for path in summaries:
        try:
            recs = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            rejects.append({"file": str(path), "record": None, "reason": f"unreadable: {e}"})
            continue
        for i, rec in enumerate(recs if isinstance(recs, list) else [recs]):
            take(rec, path, i)
    if summaries:  # a combination with runs but no summary.json was cut short (or had no successful run)
        for d in sorted({p.parent for p in folder.rglob("run=*.json")} - {p.parent for p in summaries}):
            rejects.append({"file": str(d), "record": None, "reason": "run files but no summary.json: unfinished"})
    elif (folder / "summary.csv").is_file():
        with (folder / "summary.csv").open(newline="") as f:
            for i, row in enumerate(csv.DictReader(f)):
                take({k: _parse(v) for k, v in row.items() if k and v not in ("", None)}, folder / "summary.csv", i)
    else:
        raise FileNotFoundError(f"no summary.json or summary.csv under {folder}: not a vllm bench sweep serve folder")
    for path in sorted(folder.rglob("*failure.json")):  # the sweep's --continue-on-error record of a failed run
        rejects.append({"file": str(path), "record": None, "reason": "failed: " + path.read_text()[:400].strip()})
    return SweepRead(points, rejects)


def _part(c: int, agg: Dict[Tuple[int, int], Dict[str, float]], points: Sequence[SweepPoint]) -> Dict[str, Any]:
    """One c. The engine's step is timed whole, so all of it goes in the verify (draft 0), affine in b over b >= 2;
    ``seconds`` as measure_profile writes them: the fit at b >= 2, measured at b = 1."""
    s = {b: v["seconds"] for (cc, b), v in sorted(agg.items()) if cc == c}
    multi = [b for b in s if b >= 2]
    fit = {"draft": {"intercept": 0.0, "slope": 0.0}, "verify": fit_affine(multi, [s[b] for b in multi])}
    fit["max_rel_residual"] = max(abs(_affine(fit["verify"], b) - s[b]) / s[b] for b in multi)
    return {"seconds": {str(b): s[b] if b == 1 else _affine(fit["verify"], b) for b in s},
            "measured": {str(b): {"draft": 0.0, "verify": s[b], "total": s[b]} for b in s},
            "fit": fit, "raw": [{"b": p.block_size, "k": p.k, "concurrency": c, "round": p.run_number,
                                 "draft_seconds": 0.0, "verify_seconds": p.step_seconds, "tpot_step_seconds":
                                 p.step_seconds, "throughput_step_seconds": p.throughput_step_seconds,
                                 **{a: getattr(p, a) for a in ("mean_tpot_ms", "acceptance_length",
                                                               "output_throughput", "per_position", "file")}}
                                for p in points if p.concurrency == c]}


def sweep_profile(points: Sequence[SweepPoint], source: str, rejects: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
    """The ``cost_profile.json`` dict (version 3) of a sweep's points: the top level at c = 1 and ``load`` at every
    other c. Without c = 1 the smallest c stands in for it at the top level (read as c = 1 there; ``top_level_note``)
    and is in ``load`` too, so it costs right at its own c. A c with no K >= 1 (no fit in b) is left out, rejected."""
    k0: Dict[int, List[float]] = {}
    for p in points:  # K = 0 in a speculative server: its own entry, never b = 1 (module docstring)
        if p.speculative_k0:
            k0.setdefault(p.concurrency, []).append(p.step_seconds)
    points = [p for p in points if not p.speculative_k0]
    groups: Dict[Tuple[int, int], List[SweepPoint]] = {}
    for p in points:  # repeated runs (the sweep's --num-runs, 3 by default): the medians
        groups.setdefault((p.concurrency, p.block_size), []).append(p)
    agg = {cb: {key: float(np.median([getattr(p, attr) for p in ps])) for key, attr in (("seconds", "step_seconds"),
           ("tau", "acceptance_length"), ("throughput", "output_throughput"))} for cb, ps in groups.items()}
    cs = sorted({c for c, _ in agg})
    usable = [c for c in cs if any(cc == c and b >= 2 for cc, b in agg)]
    if not usable:
        raise ValueError(f"{source}: no run with K >= 1 at any concurrency")
    rejects = [*map(dict, rejects), *({"file": str(source), "record": None, "reason": f"c={c}: no run with K >= 1, "
                                       "so no fit in b; left out"} for c in cs if c not in usable)]
    parts, top = {c: _part(c, agg, points) for c in usable}, usable[0]
    by_c = {key: {str(c): {str(b): v[key] for (cc, b), v in sorted(agg.items()) if cc == c} for c in cs}
            for key in ("tau", "throughput")}
    note = {} if top == 1 else {"top_level_note": f"the sweep has no c = 1: the top level is its c = {top}"}
    return {"format": FORMAT, "version": FORMAT_VERSION, "source": "vllm bench sweep serve", "sweep_dir": str(source),
            "device": "serving engine", "block_sizes": sorted({b for _, b in agg}), "concurrency": usable,
            "top_level_concurrency": top, **note, "acceptance_length": by_c["tau"], "throughput": by_c["throughput"],
            "rejects": rejects, "seconds": parts[top]["seconds"], "measured": parts[top]["measured"],
            "fit": {**parts[top]["fit"], "from_block_size": 2}, "raw": parts[top]["raw"],
            "load": {str(c): parts[c] for c in usable if c != 1},
            "speculative_k0": {str(c): float(np.median(v)) for c, v in sorted(k0.items())}}


def vllm_tune_choice(points: Sequence[SweepPoint], uncertainty_penalty: float = 1.0,
                     relative_tolerance: float = 0.01) -> Dict[int, int]:
    """K per c as vLLM's ``tune_speculative_k`` picks it with its defaults (vllm/benchmarks/sweep/
    tune_speculative_k.py, commit 318528f63c2d: ``aggregate_measurements``, ``select_k_by_batch_size``): objective
    ``output_throughput``, maximised; per (c, K) the median over runs less ``uncertainty_penalty`` x 1.4826 x MAD
    (floored at 0); every K within ``relative_tolerance`` of the best counts as best, and the smallest such K wins.
    Its refusals (under 3 runs, an unstable objective, no c = 1, other K sets per c) are not repeated here."""
    groups: Dict[int, Dict[int, List[float]]] = {}
    for p in points:
        groups.setdefault(p.concurrency, {}).setdefault(p.k, []).append(p.output_throughput)
    out = {}
    for c, by_k in sorted(groups.items()):
        cons = {k: max(float(np.median(v)) - uncertainty_penalty * 1.4826 *
                       float(np.median(np.abs(np.array(v) - np.median(v)))), 0.0) for k, v in by_k.items()}
        best = max(cons.values())
        if best > 0:  # the tuner refuses a c with no positive objective
            util = {k: 1.0 if x / best >= 1.0 - relative_tolerance else x / best for k, x in cons.items()}
            out[c] = min(util, key=lambda k: (-util[k], k))
    return out


SWEEP_DOC = """## A `vllm bench sweep serve` folder as the cost profile (pipeline/policy/vllm_sweep.py)

| sweep field (vLLM run record) / profile key | used for / meaning |
| --- | --- |
| `speculative_config.num_speculative_tokens`, or `..._per_batch_size` at c (neither: K = 0); `max_concurrency` | K (b = K + 1); c, the streams of one batched step |
| `mean_tpot_ms` | step seconds = TPOT x tau: TPOT leaves out time to first token (prefill), which the step model keeps apart |
| `spec_decode_acceptance_length` | tau, tokens per step per request, the bonus token included (1 at K = 0) |
| `output_throughput` | the check c x tau / throughput (raw points); vLLM's own pick of K (`tune_speculative_k`) |
| `failed`, `completed`, `num_prompts` | a run with failed requests or cut short is rejected, with its reason |
| `source`, `sweep_dir`, `device`, `top_level_concurrency` | `vllm bench sweep serve`, the folder, `serving engine`, the c of the top level: 1, else the smallest c run, standing in for c = 1 (then `top_level_note`; it is in `load` too) |
| `acceptance_length`, `throughput` | `{c: {b: tau}}`, `{c: {b: output tok/s}}`: medians over runs, the server's own on the sweep's prompts |
| `fit`, `load[c].fit` | draft 0; verify the affine fit of the step seconds over b >= 2 (one b: slope 0) |
| `raw`, `load[c].raw` | per run: `b, k, concurrency, tpot_step_seconds, throughput_step_seconds, mean_tpot_ms, acceptance_length, output_throughput, per_position` (vLLM's per-position acceptance rates), `file` |
| `rejects` | `{file, record, reason}` of every run or file left out |
| `speculative_k0` | `{c: step seconds}` of speculative runs at K = 0 (the drafter runs: not plain vLLM, never b = 1); plain vLLM is b = 1, from runs without a speculative config |
"""
