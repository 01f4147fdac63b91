"""``blockpilot validate DIR``: check a label dataset against its manifest and schema v1."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pyarrow.parquet as pq

from .dataset import LABELS_SCHEMA_VERSION, decode_metadata, labels_schema
from .shards import MANIFEST, file_sha256, is_complete, list_shards, read_jsonl


@dataclass
class ValidationReport:
    folder: str
    problems: List[str] = field(default_factory=list)
    summary: Dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        lines = [f"validate {self.folder}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'}"]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        for k, v in self.summary.items():
            lines.append(f"  {k}: {json.dumps(v) if isinstance(v, (dict, list)) else v}")
        return "\n".join(lines)


def validate_dataset(folder: str) -> ValidationReport:
    root = Path(folder)
    rep = ValidationReport(str(root))
    bad = rep.problems.append
    if not root.is_dir():
        bad(f"{root} is not a folder")
        return rep
    manifest_path = root / MANIFEST
    manifest: Dict[str, Any] = {}
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            bad(f"{MANIFEST} is not valid JSON: {err}")
    else:
        bad(f"{MANIFEST} is missing (the label stage has not finished)")
    if not is_complete(root):
        bad("_SUCCESS marker is missing (the dataset is incomplete)")

    shards = list_shards(root)
    listed = {f["file"]: f for f in manifest.get("files", [])}
    for name in sorted(set(listed) - {p.name for p in shards}):
        bad(f"{name}: listed in the manifest but missing on disk")
    for p in shards:
        if listed and p.name not in listed:
            bad(f"{p.name}: on disk but not in the manifest")

    seen: Counter = Counter()
    hist: Counter = Counter()
    tau_sum: Dict[int, float] = {}
    rows = 0
    candidates_seen = None
    for p in shards:
        try:
            pf = pq.ParquetFile(p)
            meta = decode_metadata(pf.schema_arrow.metadata)
        except Exception as err:
            bad(f"{p.name}: unreadable Parquet ({type(err).__name__}: {err})")
            continue
        entry = listed.get(p.name)
        if entry:
            if pf.metadata.num_rows != entry.get("rows"):
                bad(f"{p.name}: {pf.metadata.num_rows} rows, manifest says {entry.get('rows')}")
            if file_sha256(p) != entry.get("sha256"):
                bad(f"{p.name}: sha256 differs from the manifest (file changed or corrupted)")
        if str(meta.get("schema_version")) != LABELS_SCHEMA_VERSION:
            bad(f"{p.name}: schema_version {meta.get('schema_version')!r}, expected {LABELS_SCHEMA_VERSION}")
        vocab = meta.get("vocab_size")
        expected = labels_schema(int(vocab)) if vocab else None
        got = pf.schema_arrow.remove_metadata()
        if expected is None or not got.equals(expected):
            bad(f"{p.name}: schema does not match label schema v{LABELS_SCHEMA_VERSION}")
            continue
        try:
            for batch in pf.iter_batches(batch_size=256):
                d = batch.to_pydict()
                logits = batch.column("logits").flatten().to_numpy(zero_copy_only=False)
                if not np.isfinite(logits).all():
                    bad(f"{p.name}: non-finite logits")
                for i, pid in enumerate(d["prompt_id"]):
                    seen[pid] += 1
                    cands, tau = d["candidates"][i], d["tau"][i]
                    if candidates_seen is None:
                        candidates_seen = cands
                    if cands != meta.get("candidates"):
                        bad(f"{p.name}: row {pid} candidates {cands} differ from the metadata")
                    if len(tau) != len(cands) or any(not math.isfinite(t) or t < 1 for t in tau):
                        bad(f"{p.name}: row {pid} has tau not finite or < 1: {tau}")
                        continue
                    lb, li = d["label_block_size"][i], d["label_index"][i]
                    if lb not in cands or li < 0 or li >= len(cands) or cands[li] != lb:
                        bad(f"{p.name}: row {pid} label {lb} (index {li}) not within candidates {cands}")
                    if d["label_speedup_block_size"][i] not in cands:
                        bad(f"{p.name}: row {pid} speedup label not within candidates")
                    hist[lb] += 1
                    for b, t in zip(cands, tau):
                        tau_sum[b] = tau_sum.get(b, 0.0) + t
                    rows += 1
        except Exception as err:
            bad(f"{p.name}: unreadable data ({type(err).__name__}: {err})")
    dups = [pid for pid, n in seen.items() if n > 1]
    if dups:
        bad(f"{len(dups)} duplicate prompt_id(s), e.g. {dups[0]}")
    if manifest and rows != manifest.get("rows") and not rep.problems:
        bad(f"{rows} rows read, manifest says {manifest.get('rows')}")
    rejects = read_jsonl(root / "rejects.jsonl")
    rep.summary = {
        "rows": rows, "shards": len(shards), "rejects": len(rejects),
        "rejects_by_reason": dict(Counter(r.get("reason") for r in rejects)),
        "label_histogram": {int(b): hist.get(b, 0) for b in (candidates_seen or [])},
        "mean_tau": {int(b): round(tau_sum.get(b, 0.0) / rows, 4) for b in (candidates_seen or [])} if rows else {},
    }
    return rep
