"""What a complete label folder sums up to: the label histograms and mean tau per candidate, and the one cost
profile written beside the shards (every worker's on the labelling machine, pooled)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from pipeline.io.shards import decode_metadata
from pipeline.io.storage import parallel_map, parquet_file, read_table
from pipeline.policy.cost import CostProfile

SUMMARY_COLUMNS = ["candidates", "tau", "label_block_size", "label_speedup_block_size"]


def label_summary(shards: List[Path]) -> Dict[str, Any]:
    """Label histograms and mean tau per candidate, read without the logits column; {} without rows."""
    if not shards:
        return {}
    return merge_label_stats([label_shard_stats(read_table(p, columns=SUMMARY_COLUMNS)) for p in shards])


def label_shard_stats(t: pa.Table) -> Dict[str, Any]:
    """One shard's part of :func:`label_summary` (the worker computes it as it writes the shard: the sidecar
    keeps it): row count, label counts and the sum of tau per candidate."""
    if t.num_rows == 0:
        return {"rows": 0}
    candidates = t.column("candidates")[0].as_py()
    taus = np.array(t.column("tau").to_pylist(), dtype=np.float64)
    return {"rows": t.num_rows, "candidates": candidates,
            "labels": dict(Counter(str(b) for b in t.column("label_block_size").to_pylist())),
            "speed_labels": dict(Counter(str(b) for b in t.column("label_speedup_block_size").to_pylist())),
            "tau_sum": [float(x) for x in taus.sum(axis=0)]}


def merge_label_stats(stats: List[Dict[str, Any]]) -> Dict[str, Any]:
    """:func:`label_summary` from the shards' :func:`label_shard_stats`; {} without rows."""
    stats = [s for s in stats if s.get("rows")]
    if not stats:
        return {}
    candidates = stats[0]["candidates"]
    rows = sum(s["rows"] for s in stats)
    hist, speed = Counter(), Counter()
    tau = np.zeros(len(candidates))
    for s in stats:
        hist.update(s["labels"])
        speed.update(s["speed_labels"])
        tau += np.array(s["tau_sum"])
    batching = Counter()
    for s in stats:
        batching.update(s.get("batching") or {})
    profiles: Dict[str, Dict[str, Any]] = {}
    for s in stats:  # each worker profile's rows and one shard that carries it (chosen_cost_profile reads that one)
        p = s.get("cost_profile") or {}
        if p.get("key") and p.get("shard"):
            seen = profiles.setdefault(p["key"], {"rows": 0, "shard": p["shard"]})
            seen["rows"] += s["rows"]
    known = len(profiles) and all((s.get("cost_profile") or {}).get("shard") for s in stats)
    return {
        **({"cost_profiles": profiles} if known else {}),
        "candidates": candidates,
        # label.batch_size's cost: batches run, failed (out of memory among them), prompts retried alone
        "batching": dict(batching),
        "label_histogram": {int(b): hist.get(str(b), 0) for b in candidates},
        "speedup_label_histogram": {int(b): speed.get(str(b), 0) for b in candidates},
        "mean_tau": {int(b): round(float(tau[i] / rows), 4) for i, b in enumerate(candidates)},
    }


def machine_of(profile: Dict[str, Any]) -> str:
    """What must agree for two workers' timings to be pooled: the hardware, device, dtype, the model pair and the
    grid measured."""
    keys = ("hardware", "device", "dtype", "target", "draft", "target_revision", "draft_revision", "block_sizes",
            "context_lengths")
    return json.dumps({k: profile.get(k) for k in keys}, sort_keys=True, default=str)


def profile_key(profile: Dict[str, Any]) -> str:
    """What tells two workers' profiles apart: their measured seconds."""
    return json.dumps(profile.get("seconds"), sort_keys=True)


def chosen_cost_profile(folder: Path, manifest: Dict[str, Any]) -> Optional[Tuple[CostProfile, int, int]]:
    """The folder's cost profile, how many distinct worker profiles the shards hold (each shard's metadata keeps its
    worker's, ``blockpilot.cost_profile``; workers are told apart by their measured seconds) and how many were
    pooled into it; None when no shard has one.

    Every worker on the same machine (hardware, device, dtype, models, grid) as the worker that labelled the most
    rows is pooled: their raw points refitted together (CostProfile.from_raw). One worker's start-up profile on a
    busy 2-core machine pins the verify slope to about +-25 % (bootstrap over its points); it is what moves the
    train-chosen b and every modelled gain between runs of the same labels, and two workers' points halve its
    variance for free. Workers on other machines stay out: their seconds are another machine's.

    One footer per worker profile is read: the shards' statistics (merge_label_stats' ``cost_profiles``) say which
    profile each carries and one shard of each, so at 15,625 shards and 64 workers the driver reads 64 footers
    before _SUCCESS, not 15,625 (a minute or more of an object store's round trips even in parallel). A folder whose
    statistics lack it (written before) has every footer read, in parallel (pipeline.io.storage.parallel_map)."""
    rows: Dict[str, int] = Counter()
    profiles: Dict[str, Dict[str, Any]] = {}
    known = (manifest.get("summary") or {}).get("cost_profiles")
    files = [{"file": p["shard"], "rows": p["rows"]} for p in known.values()] if known else manifest["files"]
    metas = parallel_map(lambda f: decode_metadata(parquet_file(folder / f["file"]).schema_arrow.metadata), files)
    for f, meta in zip(files, metas):
        if "cost_profile" in meta:
            key = profile_key(meta["cost_profile"])
            profiles[key] = meta["cost_profile"]
            rows[key] += f["rows"]
    if not profiles:
        return None
    main = profiles[max(rows, key=rows.get)]
    machine, base = machine_of(main), CostProfile.from_dict(main)
    same = [p for p in profiles.values() if machine_of(p) == machine]
    # A vLLM-timed profile (label.engine=vllm: its raw points are per-run TPOT records, not steps to refit) is not
    # pooled: the main worker's stands.
    if len(same) == 1 or not all(p.get("raw") for p in same) or any(p.get("engine") for p in same):
        return base, len(profiles), 1
    pooled = CostProfile.from_raw([r for p in same for r in p["raw"]],
                                  {**base.meta, "pooled_workers": len(same),
                                   "rounds": sum(int(p.get("rounds", 0)) for p in same),
                                   "stable": all(bool(p.get("stable")) for p in same)})
    pooled.version = base.version
    if all(p.get("load") for p in same):  # the load grid's points pooled the same way
        from pipeline.policy.load_cost import pool_load

        pooled.meta["load"] = pool_load([p["load"] for p in same], base.meta.get("context_lengths") or [])
    return pooled, len(profiles), len(same)
