"""The one manifest format (``manifest.json``), written after a stage's last shard; the only writer of manifests
and of the gathered ``rejects.jsonl``."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Dict, List

from pipeline.executor.stage import ShardStage, ShardTask
from pipeline.io.layout import INPUT_REJECTS, MANIFEST, REJECTS, REJECTS_DIR
from pipeline.io.shards import (
    file_sha256,
    fingerprint_sha256,
    normalise,
    read_jsonl,
    read_sidecar,
    write_json_atomic,
    write_jsonl_atomic,
)
from pipeline.io.storage import location, parquet_file, size

MANIFEST_VERSION = 1


def _counts(records: List[Dict[str, Any]], key: str) -> Dict[str, int]:
    return dict(Counter(r[key] for r in records if r.get(key) is not None))


def write_manifest(stage: ShardStage, tasks: List[ShardTask], fingerprint: Dict[str, Any],
                   workers: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The one manifest format. Reads what is on disk (so it also describes an interrupted run's shards), gathers
    the reject files into ``rejects.jsonl``, and keeps the workers of earlier runs that wrote some shards."""
    folder = stage.folder
    files, rejects, stats = [], read_jsonl(folder / REJECTS_DIR / INPUT_REJECTS), []
    for t in tasks:
        p = location(t.output)
        if not p.exists():
            continue
        shard_rejects = read_jsonl(t.rejects)
        rejects.extend(shard_rejects)
        # The sidecar, written with the shard (and checked against its bytes when resume kept it), carries what
        # this entry needs: no shard is read again here (a million label rows at V = 151,936 are ~250 GB).
        side = read_sidecar(t.checksum) if t.checksum else None
        if side and side.get("file") == p.name and side.get("rows") is not None:
            entry = {"rows": int(side["rows"]), "bytes": int(side["bytes"]), "sha256": side["sha256"]}
            stats.append(side.get("stats"))
        else:  # a shard written before sidecars carried rows: read it
            entry = {"rows": parquet_file(p).metadata.num_rows, "bytes": size(p), "sha256": file_sha256(p)}
            stats.append(None)
        files.append({"file": p.name, **entry, "rejects": len(shard_rejects), "input_rows": t.rows})
    write_jsonl_atomic(rejects, folder / REJECTS)
    if (folder / MANIFEST).exists():
        try:
            earlier = json.loads((folder / MANIFEST).read_text()).get("workers", [])
        except ValueError:
            earlier = []
        seen = {(w.get("identity"), w.get("pid")) for w in workers}
        workers = [w for w in earlier if (w.get("identity"), w.get("pid")) not in seen] + list(workers)
    manifest = {
        "manifest_version": MANIFEST_VERSION, "stage": stage.name, "schema_version": stage.schema_version,
        "files": files, "rows": sum(f["rows"] for f in files), "shards": len(files),
        "rejects": len(rejects), "rejects_file": REJECTS,
        "rejects_by_reason": _counts(rejects, "reason"), "rejects_by_source": _counts(rejects, "source"),
        # A worker with many decode errors (a bad GPU, OOM on long prompts) stands out here.
        "rejects_by_worker": _counts(rejects, "worker"),
        "fingerprint": normalise(fingerprint), "fingerprint_sha256": fingerprint_sha256(fingerprint),
        "workers": workers,
        "summary": _summary(stage, tasks, stats),
        **stage.manifest_extras(),
    }
    write_json_atomic(manifest, folder / MANIFEST)
    return manifest


def _summary(stage: ShardStage, tasks: List[ShardTask], stats: List[Any]) -> Dict[str, Any]:
    """The stage's summary: merged from the shards' sidecar statistics when every shard has them, else read from
    the shards (stage.summarize)."""
    if stats and all(s is not None for s in stats):
        return stage.merge_stats(stats)
    return stage.summarize([location(t.output) for t in tasks if location(t.output).exists()])
