"""One stage's output folder: the bookkeeping every stage shares, shard-shaped or not (train and report use
:class:`StageFolder` directly). With :mod:`pipeline.executor.manifest`, the only writer of ``_SUCCESS``."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

from pipeline.executor.lease import Lease
from pipeline.io.layout import (CARD, CHECKSUMS_DIR, FINGERPRINT, MANIFEST, REJECTS, REJECTS_DIR, STAMPS, SUCCESS,
                                SUMMARY)
from pipeline.io.shards import (
    check_fingerprint,
    fingerprint_sha256,
    is_complete,
    list_shards,
    normalise,
    recorded_stamps,
    shard_problem,
    write_json_atomic,
    write_text_atomic,
)
from pipeline.io.storage import listing, location, parallel_map, rmtree
from pipeline.runtime.log import get as log

STANDARD_OUTPUTS = (MANIFEST, STAMPS, REJECTS, SUMMARY, CARD, SUCCESS)


class StageFolder:
    """One stage's output folder: writable check, fingerprint and drift, skip-if-complete, stale temp files,
    ``summary.json`` and ``_SUCCESS``. Used by :func:`run_stage` and directly by train and report."""

    def __init__(self, path: Path, stage: str, extra_outputs: Sequence[str] = ()):
        self.path = location(path)
        self.stage = stage
        self.extra_outputs = tuple(extra_outputs)
        self.lease: Optional[Lease] = None

    def acquire(self) -> None:
        """Take the folder's lease (once): every change to the folder comes after this, so a second run refuses
        before it touches anything, a live writer's temp files included."""
        if self.lease is None:
            self.lease = Lease(self.path, self.stage).acquire()

    def check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def ensure_writable(self) -> None:
        """Fail before any work when the folder cannot be created or written."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-probe-{uuid.uuid4().hex[:8]}"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise PermissionError(f"output folder {self.path} is not writable: {err.strerror or err}") from None

    def has_output(self) -> bool:
        return (bool(list_shards(self.path)) or is_complete(self.path)
                or any((self.path / p).exists() for p in self.extra_outputs))

    def previous_summary(self, fingerprint: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """The summary of a complete run with this fingerprint whose shards are all still the ones its manifest
        lists, else None. One listing of the folder proves each shard whose size and stamp equal its entry's
        (pipeline.io.shards.stamp_matches) without reading it; only a shard that differs is read and checked the
        full way, footer, rows and sha256 (a damaged data page has a good footer). What this cannot see, and
        `blockpilot validate` can: pipeline.io.shards' module docstring."""
        if fingerprint is None or not is_complete(self.path):
            return None
        try:
            if json.loads((self.path / FINGERPRINT).read_text()) != normalise(fingerprint):
                return None
            summary = json.loads((self.path / SUMMARY).read_text())
            manifest_path = self.path / MANIFEST
            if manifest_path.exists():
                manifest = json.loads(manifest_path.read_text())
                sha, listed = fingerprint_sha256(fingerprint), listing(self.path)
                stamps = recorded_stamps(self.path, listed)

                def problem(f: Dict[str, Any]) -> str:
                    recorded = {**f, "fingerprint_sha256": manifest.get("fingerprint_sha256"),
                                "stamp": stamps.get(f["file"])}
                    return shard_problem(self.path / f["file"], f["rows"], sha, f.get("sha256"), recorded,
                                         listed.get(f["file"]))

                if any(parallel_map(problem, manifest["files"])):
                    return None
        except Exception:  # noqa: BLE001 - anything unreadable means: not complete, redo what is needed
            return None
        return summary

    def skipped(self, summary: Dict[str, Any], t0: float) -> Dict[str, Any]:
        rows = f" ({summary['rows']} rows)" if "rows" in summary else ""
        log(self.stage).info(f"done: skipped, {self.path} is complete{rows}")
        return {**summary, "status": "skipped: complete", "skipped": True,
                "wall_seconds": round(time.monotonic() - t0, 2)}

    def bind(self, fingerprint: Optional[Dict[str, Any]], force: bool) -> None:
        """Record the fingerprint; refuse output of another config unless ``force`` (which discards it)."""
        self.acquire()
        if fingerprint is None:
            return
        if check_fingerprint(self.path, fingerprint, force, self.has_output()):
            log(self.stage).warning(f"force=true: config changed, discarding the earlier output in {self.path}")
            self.discard()

    def discard(self) -> None:
        for p in list_shards(self.path):
            p.unlink()
        rmtree(self.path / REJECTS_DIR)
        rmtree(self.path / CHECKSUMS_DIR)
        for name in (*STANDARD_OUTPUTS, *self.extra_outputs):
            p = self.path / name
            rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)

    def start(self, cfg) -> str:
        """The folder is about to change: no longer complete, temp files of killed writers gone, this run's
        resolved config written. Returns the config's sha256."""
        from pipeline.runtime.config import write_resolved

        self.acquire()
        (self.path / SUCCESS).unlink(missing_ok=True)
        for folder in (self.path, self.path / REJECTS_DIR, self.path / CHECKSUMS_DIR):
            # Ours to delete: this run holds the lease, so no live writer has a temp file here; they are left by a
            # writer that was killed mid-write (and whose lease was given up or taken over).
            for stale in folder.glob(".*.tmp-*"):
                stale.unlink(missing_ok=True)
        return write_resolved(cfg, self.path)

    def complete(self, summary: Dict[str, Any], card: Optional[str] = None) -> None:
        """``card``: the whole card, front matter included (pipeline.executor.card.front_matter)."""
        self.check_lease()
        if card is not None:
            write_text_atomic(card, self.path / CARD)
        write_json_atomic(summary, self.path / SUMMARY)
        mark_complete(self.path)  # last: everything above is in place
        self.release()


def mark_complete(folder: Path) -> None:
    write_text_atomic("", location(folder) / SUCCESS)


def require_complete(required: Iterable[Tuple[Path, str]]) -> None:
    for folder, command in required:
        if not is_complete(folder):
            raise FileNotFoundError(f"no complete output in {folder} (run `{command}` first)")
