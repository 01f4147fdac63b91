"""Shard-folder mechanics shared by every stage (datatrove style).

A stage folder holds rank-named shards ``part-00000.parquet`` ..., each written under a temporary name and renamed
atomically (in object storage: one PUT, see :mod:`pipeline.io.storage`), a ``manifest.json`` and, once the stage is complete, an empty ``_SUCCESS`` marker. These are the
primitives; :mod:`pipeline.executor.driver` is the one place that writes manifests, reject files and ``_SUCCESS``.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.io.storage import (is_remote, location, parquet_bytes, parquet_file, raise_naming, replace_durably,
                                 tmp_path, write_bytes_atomic)

# Key-value schema metadata of every shard the pipeline writes: blockpilot.KEY -> JSON value.
META_PREFIX = "blockpilot."


def encode_metadata(meta: Dict[str, Any]) -> Dict[bytes, bytes]:
    return {(META_PREFIX + k).encode(): json.dumps(v, default=str).encode() for k, v in meta.items()}


def decode_metadata(raw: Optional[Dict[bytes, bytes]]) -> Dict[str, Any]:
    out = {}
    for k, v in (raw or {}).items():
        key = k.decode()
        if key.startswith(META_PREFIX):
            out[key[len(META_PREFIX):]] = json.loads(v.decode())
    return out


from pipeline.io.layout import FINGERPRINT, MANIFEST, SUCCESS  # noqa: E402,F401 - the shard folder's names


def shard_name(index: int, suffix: str = ".parquet") -> str:
    return f"part-{index:05d}{suffix}"


def list_shards(folder) -> list:
    return sorted(location(folder).glob("part-[0-9][0-9][0-9][0-9][0-9].parquet"), key=lambda p: p.name)


def write_parquet_atomic(table: pa.Table, path, checksum=None, stats: Optional[Dict[str, Any]] = None,
                         **options: Any) -> str:
    """Write ``table`` at ``path`` all at once and return the file's sha256.

    With ``checksum`` (a sidecar path, :func:`write_checksum`), that sha256 is published there BEFORE the shard: a
    shard on disk then always has the checksum it was written with, so resume can prove the bytes it keeps. A kill
    between the two leaves a checksum whose shard is missing or older, and the older one fails the check."""
    path = location(path)
    if is_remote(path):  # one PUT of the finished file (pipeline/io/storage.py)
        data = parquet_bytes(table, **options)
        sha = hashlib.sha256(data).hexdigest()
        if checksum:
            write_checksum(checksum, path.name, sha, len(data), table.num_rows, stats)
        write_bytes_atomic(data, path)
        return sha
    tmp = tmp_path(path)
    try:
        pq.write_table(table, tmp, **options)
        sha = file_sha256(tmp)  # just written: read back from the page cache
        if checksum:
            write_checksum(checksum, path.name, sha, tmp.stat().st_size, table.num_rows, stats)
        replace_durably(tmp, path)
    except OSError as err:
        raise_naming(err, path)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return sha


def write_checksum(path, file: str, sha256: str, size: int, rows: Optional[int] = None,
                   stats: Optional[Dict[str, Any]] = None) -> None:
    """The shard's sidecar: its sha256 and size, and (so that the driver's closing bookkeeping reads none of the
    shards again) its row count and the stage's per-shard statistics (ShardStage.shard_stats)."""
    write_json_atomic({"file": file, "sha256": sha256, "bytes": size, "rows": rows, "stats": stats}, path)


def read_sidecar(path) -> Optional[Dict[str, Any]]:
    """A shard's whole sidecar (:func:`write_checksum`), None when there is none or it is unreadable."""
    path = location(path)
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (ValueError, OSError):
        return None


def read_checksum(path) -> Optional[str]:
    """The sha256 a shard was written with (its sidecar), None when there is none or it is unreadable."""
    path = location(path)
    try:
        return json.loads(path.read_text())["sha256"] if path.exists() else None
    except (ValueError, KeyError, TypeError, OSError):
        return None


def write_text_atomic(text: str, path) -> None:
    write_bytes_atomic(text.encode(), path)


def write_json_atomic(obj: Any, path) -> None:
    write_text_atomic(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", path)


def write_jsonl_atomic(rows: Iterable[Dict[str, Any]], path) -> None:
    write_text_atomic("".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows), path)


def read_jsonl(path) -> list:
    path = location(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with location(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_complete(folder) -> bool:
    return (location(folder) / SUCCESS).exists()


def check_fingerprint(folder: Path, fingerprint: Dict[str, Any], force: bool,
                      has_output: Optional[bool] = None) -> bool:
    """Refuse to mix outputs of different configs in one folder.

    ``fingerprint`` holds the config values that change a stage's output (models, candidates, temperature, ...).
    The first run records it; a later run with a different one raises unless ``force``. Returns True when the
    folder holds outputs of another config that the caller must discard (force was given).
    """
    folder = location(folder)
    path = folder / FINGERPRINT
    previous = json.loads(path.read_text()) if path.exists() else None
    normalised = normalise(fingerprint)
    # A folder with no output yet (a first run that failed before writing any shard) binds nothing.
    if has_output is None:
        has_output = bool(list_shards(folder)) or is_complete(folder)
    if previous is not None and previous != normalised and has_output:
        changed = sorted(k for k in set(previous) | set(normalised) if previous.get(k) != normalised.get(k))
        if not force:
            raise FileExistsError(
                f"{folder} was written with a different config (changed: "
                f"{', '.join(_change(k, previous.get(k), normalised.get(k)) for k in changed)}); "
                "use a new output_dir, or force=true to overwrite")
    if previous != normalised:
        write_json_atomic(normalised, path)
    return previous is not None and previous != normalised and has_output


def _change(key: str, before: Any, now: Any) -> str:
    """``key`` with its two values when they are short (a revision, a dtype, a number): what a user needs to see."""
    def short(v):
        text = json.dumps(v, sort_keys=True, default=str)
        return text if len(text) <= 90 else None  # a sha256 revision (73) fits

    a, b = short(before), short(now)
    return f"{key} {a} -> {b}" if a is not None and b is not None else key


def normalise(fingerprint: Dict[str, Any]) -> Dict[str, Any]:
    """The one JSON form of a fingerprint: what fingerprint.json holds and what its sha256 is taken of."""
    return json.loads(json.dumps(fingerprint, sort_keys=True, default=str))


def fingerprint_sha256(fingerprint: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(normalise(fingerprint), sort_keys=True).encode()).hexdigest()


def shard_intact(path: Path, rows: int, fp_sha: str) -> bool:
    """The shard's footer reads, it holds ``rows`` rows, and it carries this config's fingerprint (schema metadata
    ``blockpilot.fingerprint_sha256``). Reads the footer only."""
    path = location(path)
    if not path.exists():
        return False
    try:
        pf = parquet_file(path)
        info = decode_metadata(pf.schema_arrow.metadata)
    except Exception:  # truncated or corrupted: regenerate
        return False
    return pf.metadata.num_rows == rows and info.get("fingerprint_sha256") == fp_sha


def shard_problem(path: Path, rows: int, fp_sha: str, sha256: Optional[str]) -> str:
    """Why the shard at ``path`` cannot be kept ('' when it can): missing, a bad footer, other rows or config, or
    bytes that are not the ones recorded when it was written (``sha256``: its checksum sidecar or manifest entry).
    The footer alone misses a damaged data page, so a kept shard must also match ``sha256``; one with no recorded
    sha256 proves nothing and is redone. Costs one read of the whole file."""
    if not location(path).exists():
        return "missing"
    if not shard_intact(path, rows, fp_sha):
        return "unreadable footer, other row count or other config"
    if sha256 is None:
        return "no recorded sha256 to check it against"
    if file_sha256(path) != sha256:
        return "sha256 differs from the one recorded when it was written (damaged or changed)"
    return ""


def output_shard_problem(out_path: Path, input_rows: int, rejects_path: Path, fp_sha: str,
                         rows_per_input: int = 1, sha256: Optional[str] = None, retried: Sequence[str] = ()) -> str:
    """'' when the output shard counts as done: it checks out (:func:`shard_problem`), its rows plus its rejects
    account for every input row, and none of its rejects has a reason a rerun retries (``retried``: a decoding
    failure, pipeline.executor.failures.RETRIED_REASONS); else why not."""
    rejects = read_jsonl(rejects_path)
    again = sorted({r.get("reason") for r in rejects if r.get("reason") in retried})
    problem = shard_problem(out_path, (input_rows - len(rejects)) * rows_per_input, fp_sha, sha256)
    if again and not problem:
        n = sum(r.get("reason") in retried for r in rejects)
        return f"{n} reject(s) to retry ({', '.join(again)})"
    return problem


def labels_revisions(labels) -> Dict[str, str]:
    """``target_revision`` and ``draft_revision`` from a label folder's fingerprint.json ({} when there is none):
    the models the labels were made with, which every later stage and the deployment pin (issue #51)."""
    from pipeline.io.layout import FINGERPRINT

    path = location(labels) / FINGERPRINT
    if not path.exists():
        return {}
    fp = json.loads(path.read_text())
    return {k: fp[k] for k in ("target_revision", "draft_revision") if fp.get(k)}
