"""The one manifest format (``manifest.json``), written after a stage's last shard; the only writer of manifests,
of the gathered ``rejects.jsonl`` and of the shards' stamps (``_stamps.json``, pipeline.io.layout.STAMPS)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from pipeline.executor.stage import ShardStage, ShardTask
from pipeline.io.layout import CHECKSUMS_DIR, INPUT_REJECTS, MANIFEST, REJECTS, REJECTS_DIR, STAMPS
from pipeline.io.shards import (
    file_sha256,
    fingerprint_sha256,
    normalise,
    read_listed_jsonl,
    read_sidecar,
    write_json_atomic,
    write_jsonl_atomic,
)
from pipeline.io.storage import listing, location, parallel_map, parquet_file

MANIFEST_VERSION = 1


def _counts(records: List[Dict[str, Any]], key: str) -> Dict[str, int]:
    return dict(Counter(r[key] for r in records if r.get(key) is not None))


def write_manifest(stage: ShardStage, tasks: List[ShardTask], fingerprint: Dict[str, Any],
                   workers: List[Dict[str, Any]], kept: Optional[Dict[str, Optional[Dict[str, Any]]]] = None
                   ) -> Dict[str, Any]:
    """The one manifest format. Reads what is on disk (so it also describes an interrupted run's shards), gathers
    the reject files into ``rejects.jsonl``, and keeps the workers of earlier runs that wrote some shards.

    ``kept``: the sidecars the driver's to-do check read of the shards it kept (pipeline.executor.driver._place),
    not read again. One listing each of the folder, its reject files and its sidecars, then in parallel one read of
    each other shard's sidecar and of each reject file that is not empty."""
    folder, kept = stage.folder, kept or {}
    shards, rejected, sidecars = listing(folder), listing(folder / REJECTS_DIR), listing(folder / CHECKSUMS_DIR)
    present = [t for t in tasks if t.name in shards]

    def entry(t: ShardTask) -> Tuple[Dict[str, Any], List[Dict[str, Any]], Any, Any]:
        p, stem = location(t.output), t.name.rsplit(".", 1)[0]
        shard_rejects = read_listed_jsonl(t.rejects, rejected.get(stem + ".jsonl"))
        # The sidecar, written with the shard (and checked against it when resume kept it), carries what this
        # entry needs: no shard is read again here (a million label rows at V = 151,936 are ~250 GB).
        side = kept.get(t.name) or (read_sidecar(t.checksum) if stem + ".json" in sidecars else None)
        if side and side.get("file") == p.name and side.get("rows") is not None:
            record = {"rows": int(side["rows"]), "bytes": int(side["bytes"]), "sha256": side["sha256"]}
            stamp = side.get("stamp")
            stats = side.get("stats")
        else:  # a shard written before sidecars carried rows: read it (its stamp: this listing's, of these bytes)
            record = {"rows": parquet_file(p).metadata.num_rows, "bytes": shards[t.name]["size"],
                      "sha256": file_sha256(p)}
            stamp, stats = shards[t.name]["stamp"], None
        return ({"file": p.name, **record, "rejects": len(shard_rejects), "input_rows": t.rows}, shard_rejects,
                stats, stamp)

    entries = parallel_map(entry, present)
    files = [f for f, _, _, _ in entries]
    stats = [st for _, _, st, _ in entries]
    rejects = read_listed_jsonl(folder / REJECTS_DIR / INPUT_REJECTS, rejected.get(INPUT_REJECTS))
    rejects += [r for _, shard_rejects, _, _ in entries for r in shard_rejects]
    write_jsonl_atomic(rejects, folder / REJECTS)
    if MANIFEST in shards:
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
        "summary": _summary(stage, present, stats),
        **stage.manifest_extras(),
    }
    # the stamps first: a manifest never lists a shard whose stamp a later skip check could not find
    write_json_atomic({f["file"]: stamp for f, _, _, stamp in entries}, folder / STAMPS)
    write_json_atomic(manifest, folder / MANIFEST)
    return manifest


def _summary(stage: ShardStage, present: List[ShardTask], stats: List[Any]) -> Dict[str, Any]:
    """The stage's summary: merged from the shards' sidecar statistics when every shard has them, else read from
    the shards on disk (stage.summarize)."""
    if stats and all(s is not None for s in stats):
        return stage.merge_stats(stats)
    return stage.summarize([location(t.output) for t in present])
