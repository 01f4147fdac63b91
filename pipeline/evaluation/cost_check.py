"""How well the cost model explains wall clock: per method, modelled decode seconds against measured ones.

A method's modelled seconds (``modelled_seconds``: the cost profile applied to its steps,
pipeline.evaluation.results.modelled_seconds) and its measured ones (``decode_seconds``) are compared per
evaluation set and on average over the sets (as every other evaluate table averages):

* ``ratio``: sum over prompts of modelled seconds / sum of measured seconds (1 = the model explains the time);
* ``median_ratio``: the median over prompts of the per-prompt ratio (robust to a prompt the machine slowed);
* ``speedup_error``: the modelled speedup vs AR / the wall speedup vs AR - 1, from evaluate's own speedup tables.

A ratio that is the same for every method cancels in every speedup (a machine uniformly faster or slower than
the one profiled); what moves a speedup is the spread of the ratios, which ``speedup_error`` shows. Also
``ratio_vs_ar``: the method's ratio / AR's ratio, the part of the error a speedup sees.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pyarrow as pa

MODELLED, MEASURED = "modelled_seconds", "decode_seconds"
METRICS = ("ratio", "median_ratio", "ratio_vs_ar", "speedup_error")


def ratios(modelled: Sequence[float], measured: Sequence[float]) -> Dict[str, Optional[float]]:
    """``ratio`` (sum / sum) and ``median_ratio`` (median of the per-prompt ratios) of paired seconds; rows with
    no modelled or no positive measured time are left out."""
    pairs = [(m, s) for m, s in zip(modelled, measured) if m is not None and s is not None and s > 0]
    if not pairs:
        return {"ratio": None, "median_ratio": None, "prompts": 0}
    mod, meas = (np.array(x, dtype=np.float64) for x in zip(*pairs))
    return {"ratio": float(mod.sum() / meas.sum()), "median_ratio": float(np.median(mod / meas)),
            "prompts": len(pairs)}


def _mean(values: List[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def cost_check(results: pa.Table, summary: Dict[str, Any]) -> Dict[str, Any]:
    """The ``cost_model`` section of evaluate's summary: ``{method: {set | "average": {ratio, median_ratio,
    ratio_vs_ar, speedup_error, prompts}}}`` under ``methods``, plus ``worst`` (the method whose average ratio is
    furthest from AR's, and that distance) and ``mean_abs_ratio_error`` (mean over methods of |ratio - 1|) and
    ``mean_abs_speedup_error``. Empty ({}) without modelled seconds."""
    if MODELLED not in results.column_names or results.column(MODELLED).null_count == results.num_rows:
        return {}
    cols = results.select(["source", "method", MODELLED, MEASURED]).to_pydict()
    datasets, methods = summary["datasets"], summary["methods"]
    tables = summary["tables"]
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for m in methods:
        out[m] = {}
        for ds in datasets:
            idx = [i for i, (s, mm) in enumerate(zip(cols["source"], cols["method"])) if s == ds and mm == m]
            if not idx:
                continue
            out[m][ds] = ratios([cols[MODELLED][i] for i in idx], [cols[MEASURED][i] for i in idx])
            mod = tables.get("modelled_speedup", {}).get(m, {}).get(ds)
            wall = tables.get("speedup", {}).get(m, {}).get(ds)
            out[m][ds]["speedup_error"] = mod / wall - 1 if mod and wall else None
    for m in methods:
        for ds, v in out[m].items():
            ar = out.get("AR", {}).get(ds, {}).get("ratio")
            v["ratio_vs_ar"] = v["ratio"] / ar if v["ratio"] is not None and ar else None
        per_set = list(out[m].values())
        out[m]["average"] = {k: _mean([v.get(k) for v in per_set]) for k in METRICS}
        out[m]["average"]["prompts"] = sum(v["prompts"] for v in per_set)
    avg = {m: out[m]["average"] for m in methods if out[m]}
    scored = [m for m in avg if avg[m]["ratio_vs_ar"] is not None]
    worst = max(scored, key=lambda m: abs(avg[m]["ratio_vs_ar"] - 1)) if scored else None
    return {"methods": out, "datasets": datasets,
            "mean_abs_ratio_error": _mean([abs(v["ratio"] - 1) for v in avg.values() if v["ratio"] is not None]),
            "mean_abs_speedup_error": _mean([abs(v["speedup_error"]) for v in avg.values()
                                             if v["speedup_error"] is not None]),
            "worst": None if worst is None else {"method": worst,
                                                 "ratio_vs_ar_error": avg[worst]["ratio_vs_ar"] - 1}}

