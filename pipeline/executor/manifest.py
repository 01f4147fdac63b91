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
    files, rejects = [], read_jsonl(folder / REJECTS_DIR / INPUT_REJECTS)
    for t in tasks:
        p = location(t.output)
        if not p.exists():
            continue
        shard_rejects = read_jsonl(t.rejects)
        rejects.extend(shard_rejects)
        files.append({"file": p.name, "rows": parquet_file(p).metadata.num_rows, "bytes": size(p),
                      "sha256": file_sha256(p), "rejects": len(shard_rejects), "input_rows": t.rows})
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
        "summary": stage.summarize([location(t.output) for t in tasks if location(t.output).exists()]),
        **stage.manifest_extras(),
    }
    write_json_atomic(manifest, folder / MANIFEST)
    return manifest
