"""What a complete label folder sums up to: the label histograms and mean tau per candidate, and the one cost
profile written beside the shards (that of the worker that labelled the most rows)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from pipeline.io.shards import decode_metadata
from pipeline.io.storage import parquet_file, read_table
from pipeline.policy.cost import CostProfile

SUMMARY_COLUMNS = ["candidates", "tau", "label_block_size", "label_speedup_block_size"]


def label_summary(shards: List[Path]) -> Dict[str, Any]:
    """Label histograms and mean tau per candidate, read without the logits column; {} without rows."""
    if not shards:
        return {}
    t = pa.concat_tables([read_table(p, columns=SUMMARY_COLUMNS) for p in shards])
    if t.num_rows == 0:
        return {}
    candidates = t.column("candidates")[0].as_py()
    taus = np.array(t.column("tau").to_pylist(), dtype=np.float64)
    hist = Counter(t.column("label_block_size").to_pylist())
    speed_hist = Counter(t.column("label_speedup_block_size").to_pylist())
    return {
        "candidates": candidates,
        "label_histogram": {int(b): hist.get(b, 0) for b in candidates},
        "speedup_label_histogram": {int(b): speed_hist.get(b, 0) for b in candidates},
        "mean_tau": {int(b): round(float(taus[:, i].mean()), 4) for i, b in enumerate(candidates)},
    }


def chosen_cost_profile(folder: Path, manifest: Dict[str, Any]) -> Optional[Tuple[CostProfile, int]]:
    """The cost profile of the worker that labelled the most rows (each shard's metadata holds its worker's,
    ``blockpilot.cost_profile``; workers are told apart by their measured seconds) and how many distinct profiles
    the shards hold; None when no shard has one."""
    rows: Dict[str, int] = Counter()
    profiles: Dict[str, Dict[str, Any]] = {}
    for f in manifest["files"]:
        meta = decode_metadata(parquet_file(folder / f["file"]).schema_arrow.metadata)
        if "cost_profile" in meta:
            key = json.dumps(meta["cost_profile"].get("seconds"), sort_keys=True)
            profiles[key] = meta["cost_profile"]
            rows[key] += f["rows"]
    if not profiles:
        return None
    return CostProfile.from_dict(profiles[max(rows, key=rows.get)]), len(profiles)
