"""``blockpilot validate DIR``: check a label dataset against its manifest and its label schema (v4, v3, v2 or v1).

Every violation is one problem line that starts with the file it concerns; any problem means exit status 1.

* **The folder.** ``manifest.json`` present and readable, ``_SUCCESS`` present.
* **The manifest's files.** Every shard the manifest lists is on disk, every ``part-NNNNN.parquet`` on disk is
  listed, and each listed shard's row count and sha256 equal its entry.
* **Accounting.** Each listed shard's rows plus its rejects (the lines of ``_rejects/part-NNNNN.jsonl``, which must
  also number the entry's ``rejects``) equal the entry's ``input_rows``, the rows of the prompt shard it was made
  from (label writes exactly one row per accepted prompt). A manifest written before ``input_rows`` existed has it
  in no entry: its shards were valid under the contract they were written with, so the check is skipped (the
  summary's ``input_rows_check`` says so) and that is not a problem. An entry without ``input_rows`` IS a problem
  when other entries of the same manifest have it: the driver writes it for every file or for none, so such a
  manifest was edited or assembled from two runs.
* **The schema.** ``blockpilot.schema_version`` (4, or 3, 2 or 1: older sets stay readable) and the exact label
  schema of that version (column names and types).
* **The rows.** No nulls (but the ``trace_*`` columns of v3, null together where a row has no trace); candidates
  as in the shard's metadata; tau (and v4's tau_expected) one value per candidate, finite and >= 1; ``label_block_size`` (with
  ``label_index``) and ``label_speedup_block_size`` within the candidates; logits finite and exactly at the
  precision ``blockpilot.logits_precision`` names (fp16 where the key is absent: every set before it; bf16 sets are
  read the same way, float32 holding bfloat16 values); prompt ids unique across the whole folder (a duplicate
  names every file it is in). v3's trace: consistent with itself, with the row's
  new tokens and with ``max_new_tokens`` (pipeline.policy.trace.Trace.check).

The logits column is checked with numpy and never converted to Python objects, so a full-vocabulary set streams.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np

from pipeline.data.schemas import (LABELS_SCHEMA_VERSION, LOGITS_PRECISION_DOCS, READABLE_LABELS_SCHEMA_VERSIONS,
                                   TRACE_COLUMNS, at_precision, labels_schema)

from pipeline.io.shards import decode_metadata
from pipeline.io.layout import REJECTS, REJECTS_DIR
from pipeline.io.shards import MANIFEST, file_sha256, is_complete, list_shards, read_jsonl
from pipeline.io.storage import location, parquet_file
from pipeline.policy.trace import Trace

# Every column but logits, read as Python values row by row.
ROW_COLUMNS = ["prompt_id", "candidates", "tau", "label_block_size", "label_index", "label_speedup_block_size"]
TRACE_NAMES = [name for name, _, _ in TRACE_COLUMNS]  # v3: nullable, all together


def _trace_problem(row: Dict[str, Any], max_new_tokens) -> str:
    """What is wrong with one v3 row's trace columns ('' if nothing)."""
    nulls = [c for c in TRACE_NAMES if row[c] is None]
    if nulls:
        return "" if len(nulls) == len(TRACE_NAMES) else f"trace columns null only in part: {nulls}"
    trace = Trace.from_row(row)
    try:
        trace.check(max_new_tokens)
    except ValueError as err:
        return str(err)
    if len(set(row["new_tokens"])) != 1 or trace.new_tokens != row["new_tokens"][0]:
        return f"a trace of {trace.new_tokens} new tokens, new_tokens {row['new_tokens']}"
    return ""


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


def _read_manifest(root: Path, bad: Callable[[str], None]) -> Dict[str, Any]:
    path = root / MANIFEST
    if not path.exists():
        bad(f"{MANIFEST} is missing (the label stage has not finished)")
        return {}
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        bad(f"{MANIFEST} is not valid JSON: {err}")
        return {}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list) \
            or not all(isinstance(f, dict) and isinstance(f.get("file"), str) for f in manifest["files"]):
        bad(f"{MANIFEST}: no valid 'files' list (one object with a 'file' name per shard)")
        return {}
    return manifest


def _check_accounting(root: Path, name: str, rows: int, entry: Dict[str, Any], bad: Callable[[str], None]) -> None:
    """rows + rejects == input_rows for one listed shard (called only when the manifest records input_rows)."""
    rel = f"{REJECTS_DIR}/{Path(name).stem}.jsonl"
    if "input_rows" not in entry:
        bad(f"{name}: its manifest entry has no input_rows while other entries have it (edited or mixed manifest)")
        return
    path = root / rel
    if not path.exists():
        bad(f"{name}: reject file {rel} is missing, so rows + rejects cannot be checked against input_rows")
        return
    try:
        rejected = len(read_jsonl(path))
    except (ValueError, UnicodeDecodeError) as err:
        bad(f"{name}: reject file {rel} is not valid JSON lines ({err})")
        return
    if entry.get("rejects") is not None and entry["rejects"] != rejected:
        bad(f"{name}: reject file {rel} holds {rejected} reject(s), manifest says {entry['rejects']}")
    if rows + rejected != entry["input_rows"]:
        bad(f"{name}: {rows} rows + {rejected} rejects = {rows + rejected}, but its input shard had "
            f"{entry['input_rows']} rows (manifest input_rows): rows lost or added")


def validate_dataset(folder: str) -> ValidationReport:
    root = location(folder)  # a local folder or object storage (s3://...)
    rep = ValidationReport(str(root))
    bad = rep.problems.append
    if not root.is_dir():
        bad(f"{root} is not a folder")
        return rep
    manifest = _read_manifest(root, bad)
    if not is_complete(root):
        bad("_SUCCESS marker is missing (the dataset is incomplete)")

    shards = list_shards(root)
    entries = manifest.get("files", [])
    listed = {f["file"]: f for f in entries}
    for name in sorted(set(listed) - {p.name for p in shards}):
        bad(f"{name}: listed in the manifest but missing on disk")
    if manifest:
        for p in shards:
            if p.name not in listed:
                bad(f"{p.name}: on disk but not in the manifest")
    accounting = any("input_rows" in f for f in entries)

    first_seen: Dict[str, str] = {}  # prompt_id -> the first file it is in
    dup_files: Dict[str, List[str]] = {}  # prompt_id -> every file it is in, for duplicates only
    hist: Counter = Counter()
    tau_sum: Dict[int, float] = {}
    rows = tau_rows = 0
    candidates_seen = None
    for p in shards:
        try:
            pf = parquet_file(p)
            meta = decode_metadata(pf.schema_arrow.metadata)
        except Exception as err:  # noqa: BLE001 - truncated, corrupted, not Parquet
            bad(f"{p.name}: unreadable Parquet ({type(err).__name__}: {err})")
            continue
        entry = listed.get(p.name)
        if entry is not None:
            if pf.metadata.num_rows != entry.get("rows"):
                bad(f"{p.name}: {pf.metadata.num_rows} rows, manifest says {entry.get('rows')}")
            if file_sha256(p) != entry.get("sha256"):
                bad(f"{p.name}: sha256 differs from the manifest (file changed or corrupted)")
            if accounting:
                _check_accounting(root, p.name, pf.metadata.num_rows, entry, bad)
        version = str(meta.get("schema_version"))
        if version not in READABLE_LABELS_SCHEMA_VERSIONS:
            bad(f"{p.name}: schema_version {meta.get('schema_version')!r}, expected one of "
                f"{', '.join(READABLE_LABELS_SCHEMA_VERSIONS)}")
            version = LABELS_SCHEMA_VERSION
        precision = meta.get("logits_precision", "fp16")
        if precision not in LOGITS_PRECISION_DOCS:
            bad(f"{p.name}: logits_precision {precision!r}, expected one of {', '.join(LOGITS_PRECISION_DOCS)}")
            precision = None
        vocab = meta.get("vocab_size")
        expected = labels_schema(int(vocab), version) if vocab else None
        got = pf.schema_arrow.remove_metadata()
        if expected is None or not got.equals(expected):
            bad(f"{p.name}: schema does not match label schema v{version}")
            continue
        try:
            for batch in pf.iter_batches(batch_size=256):
                nulls = {c: batch.column(c).null_count for c in batch.schema.names
                         if batch.column(c).null_count and c not in TRACE_NAMES}
                if nulls:
                    bad(f"{p.name}: null values in {nulls}")
                    break
                logits = batch.column("logits").flatten().to_numpy(zero_copy_only=False)
                logits = logits.reshape(batch.num_rows, int(vocab))
                finite = np.isfinite(logits).all(axis=1)
                # Values the declared precision cannot hold: the metadata does not describe the rows (a set
                # assembled from two precisions, or rewritten without rounding).
                off = ~at_precision(logits, precision).all(axis=1) if precision else np.zeros(len(finite), bool)
                traced = TRACE_NAMES[0] in batch.schema.names
                expected = "tau_expected" in batch.schema.names  # v4
                d = batch.select(ROW_COLUMNS + (["new_tokens"] + TRACE_NAMES if traced else []) +
                                 (["tau_expected"] if expected else [])).to_pydict()
                if not finite.all():
                    ids = [d["prompt_id"][i] for i in np.flatnonzero(~finite)]
                    bad(f"{p.name}: {len(ids)} row(s) with non-finite logits (NaN or inf), e.g. row {ids[0]}")
                if off.any():
                    ids = [d["prompt_id"][i] for i in np.flatnonzero(off)]
                    bad(f"{p.name}: {len(ids)} row(s) with logits not at the precision {precision} the metadata "
                        f"names (blockpilot.logits_precision), e.g. row {ids[0]}")
                for i, pid in enumerate(d["prompt_id"]):
                    rows += 1
                    if pid in first_seen:
                        dup_files.setdefault(pid, [first_seen[pid]]).append(p.name)
                    else:
                        first_seen[pid] = p.name
                    cands, tau = d["candidates"][i], d["tau"][i]
                    if candidates_seen is None:
                        candidates_seen = cands
                    if cands != meta.get("candidates"):
                        bad(f"{p.name}: row {pid} candidates {cands} differ from the metadata {meta.get('candidates')}")
                    if len(tau) != len(cands):
                        bad(f"{p.name}: row {pid} has {len(tau)} tau values for {len(cands)} candidates")
                        continue
                    nonfinite = [b for b, t in zip(cands, tau) if not math.isfinite(t)]
                    low = [b for b, t in zip(cands, tau) if math.isfinite(t) and t < 1]
                    if nonfinite:
                        bad(f"{p.name}: row {pid} has tau not finite (NaN or inf) at b={nonfinite}: {tau}")
                    if low:
                        bad(f"{p.name}: row {pid} has tau < 1 at b={low}: {tau}")
                    te = d["tau_expected"][i] if expected else None
                    if te is not None and (len(te) != len(cands) or
                                           not all(math.isfinite(t) and t >= 1 - 1e-4 for t in te)):
                        bad(f"{p.name}: row {pid} has tau_expected {te}: one finite value >= 1 per candidate")
                    lb, li = d["label_block_size"][i], d["label_index"][i]
                    if lb not in cands or li < 0 or li >= len(cands) or cands[li] != lb:
                        bad(f"{p.name}: row {pid} label {lb} (index {li}) not within candidates {cands}")
                    if d["label_speedup_block_size"][i] not in cands:
                        bad(f"{p.name}: row {pid} speedup label {d['label_speedup_block_size'][i]} not within "
                            f"candidates {cands}")
                    why = _trace_problem({c: d[c][i] for c in d}, meta.get("max_new_tokens")) if traced else ""
                    if why:
                        bad(f"{p.name}: row {pid} trace: {why}")
                    if nonfinite or low:
                        continue
                    hist[lb] += 1
                    for b, t in zip(cands, tau):
                        tau_sum[b] = tau_sum.get(b, 0.0) + t
                    tau_rows += 1
        except Exception as err:  # noqa: BLE001 - a damaged page or column
            bad(f"{p.name}: unreadable data ({type(err).__name__}: {err})")
    if dup_files:
        files = sorted({f for fs in dup_files.values() for f in fs})
        pid, where = next(iter(dup_files.items()))
        bad(f"{', '.join(files)}: {len(dup_files)} duplicate prompt_id(s), e.g. {pid} (in {' and '.join(where)})")
    if manifest and rows != manifest.get("rows") and not rep.problems:
        bad(f"{MANIFEST}: {rows} rows read, manifest says {manifest.get('rows')}")
    try:
        rejects = read_jsonl(root / REJECTS)
    except (ValueError, UnicodeDecodeError) as err:
        bad(f"{REJECTS} is not valid JSON lines ({err})")
        rejects = []
    rep.summary = {
        "rows": rows, "shards": len(shards), "rejects": len(rejects),
        "rejects_by_reason": dict(Counter(r.get("reason") for r in rejects)),
        "input_rows_check": "rows + rejects == input_rows per shard" if accounting else
        "skipped: the manifest predates input_rows",
        "label_histogram": {int(b): hist.get(b, 0) for b in (candidates_seen or [])},
        "mean_tau": {int(b): round(tau_sum.get(b, 0.0) / tau_rows, 4) for b in (candidates_seen or [])}
        if tau_rows else {},
    }
    return rep
