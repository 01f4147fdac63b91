"""Shard-folder mechanics shared by every stage (datatrove style).

A stage folder holds rank-named shards ``part-00000.parquet`` ..., each written under a temporary name and renamed
atomically (in object storage: one PUT, see :mod:`pipeline.io.storage`), a ``manifest.json`` and, once the stage is complete, an empty ``_SUCCESS`` marker. These are the
primitives; :mod:`pipeline.executor.driver` is the one place that writes manifests, reject files and ``_SUCCESS``.

**Keeping a shard without reading it.** Each shard's sidecar records its sha256 (before the shard is published) and
then its *stamp* (:func:`pipeline.io.storage.stamp`: size plus mtime_ns locally, the ETag in an object store); the
manifest copies the sha256, and ``_stamps.json`` beside it the stamps (the manifest stays the same bytes for the same
shards). Skip-if-complete and resume keep a shard whose listed size and stamp equal the recorded
ones (:func:`stamp_matches`) without reading a byte of it: at a million label rows the shards are ~250 GB. Any other
shard (rewritten, replaced, touched, or with no recorded stamp) gets the full check, footer and sha256
(:func:`shard_problem`). What the stamp cannot see is damage that changes neither the mtime nor the ETag: bytes
corrupted in place on the medium, or a rewrite whose mtime is set back (``os.utime``) or lands in the same clock
tick as the write it replaces with the same size. Object stores checksum data at rest themselves; ``blockpilot
validate`` (pipeline/data/validate.py) hashes every shard against the manifest and is the full check a user runs.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.io.storage import (is_remote, listing, location, parquet_bytes, parquet_file, published_locally, stamp,
                                 write_bytes_atomic)

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


from pipeline.io.layout import FINGERPRINT, MANIFEST, STAMPS, SUCCESS  # noqa: E402,F401 - the shard folder's names


def shard_name(index: int, suffix: str = ".parquet") -> str:
    return f"part-{index:05d}{suffix}"


# part-00000 .. part-99999, then part-100000 and up: shard_name pads to five digits, never truncates.
SHARD = re.compile(r"part-(\d{5,})\.parquet")


def shard_names(names: Iterable[str]) -> list:
    """The shard names among ``names``, in the order of their index (part-99999 before part-100000)."""
    return sorted((n for n in names if SHARD.fullmatch(n)), key=lambda n: int(SHARD.fullmatch(n).group(1)))


def list_shards(folder) -> list:
    """The folder's shards, in index order, from one listing."""
    folder = location(folder)
    return [folder / n for n in shard_names(listing(folder))]


def write_parquet_atomic(table: pa.Table, path, checksum=None, stats: Optional[Dict[str, Any]] = None,
                         **options: Any) -> str:
    """Write ``table`` at ``path`` all at once and return the file's sha256.

    With ``checksum`` (a sidecar path, :func:`read_sidecar`), that sha256 is published there BEFORE the shard: a
    shard on disk then always has the checksum it was written with, so resume can prove the bytes it keeps. A kill
    between the two leaves a checksum whose shard is missing or older, and the older one fails the check. Once the
    shard is published the sidecar is written again with the shard's stamp added, so that later checks can keep it
    from a listing (module docstring); a kill between those two leaves a sidecar without a stamp, and that shard
    alone is hashed on resume."""
    path = location(path)
    if is_remote(path):  # one PUT of the finished file (pipeline/io/storage.py)
        data = parquet_bytes(table, **options)
        side = _write_sidecar(table, path, hashlib.sha256(data).hexdigest(), len(data), stats, checksum)
        write_bytes_atomic(data, path)
    else:
        with published_locally(path) as tmp:
            pq.write_table(table, tmp, **options)
            # just written: read back from the page cache
            side = _write_sidecar(table, path, file_sha256(tmp), tmp.stat().st_size, stats, checksum)
    if checksum:
        write_json_atomic({**side, "stamp": stamp(path)["stamp"]}, checksum)
    return side["sha256"]


def _write_sidecar(table: pa.Table, path, sha256: str, size: int, stats: Optional[Dict[str, Any]],
                   checksum) -> Dict[str, Any]:
    """The shard's sidecar before its stamp, published at ``checksum`` (when given) before the shard."""
    side = {"file": path.name, "sha256": sha256, "bytes": size, "rows": table.num_rows, "stats": stats,
            "fingerprint_sha256": decode_metadata(table.schema.metadata).get("fingerprint_sha256")}
    if checksum:
        write_json_atomic(side, checksum)
    return side


def read_sidecar(path) -> Optional[Dict[str, Any]]:
    """A shard's whole sidecar (written by :func:`write_parquet_atomic`: its sha256, size and stamp, the shard's
    fingerprint, and, so that the driver's closing bookkeeping reads none of the shards again, its row count and
    the stage's per-shard statistics, ShardStage.shard_stats); None when there is none or it is unreadable. One
    read, no existence check first."""
    try:
        side = json.loads(location(path).read_text())
    except (ValueError, OSError):
        return None
    return side if isinstance(side, dict) else None


def write_text_atomic(text: str, path) -> None:
    write_bytes_atomic(text.encode(), path)


def write_json_atomic(obj: Any, path) -> None:
    write_text_atomic(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", path)


def write_jsonl_atomic(rows: Iterable[Dict[str, Any]], path) -> None:
    write_text_atomic("".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows), path)


def read_jsonl(path) -> list:
    try:
        text = location(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_listed_jsonl(path, listed: Optional[Dict[str, Any]]) -> list:
    """:func:`read_jsonl` of a file whose listing entry the caller holds (:func:`pipeline.io.storage.listing`):
    absent or empty (a shard without rejects) costs no request."""
    return read_jsonl(path) if listed and listed["size"] else []


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


def same_object(recorded: Optional[Dict[str, Any]], listed: Optional[Dict[str, Any]]) -> bool:
    """The listing entry ``listed`` is the very file ``recorded`` (a sidecar or a manifest entry) describes: the same
    size and stamp. No recorded stamp (a kill between the shard and its sidecar's second write, or a folder written
    before stamps) never matches."""
    return bool(recorded and listed and recorded.get("stamp") and recorded["stamp"] == listed["stamp"]
                and recorded.get("bytes") == listed["size"])


def stamp_matches(recorded: Optional[Dict[str, Any]], listed: Optional[Dict[str, Any]], rows: int,
                  fp_sha: str) -> bool:
    """The listing shows the very shard that ``recorded`` (its sidecar, or its manifest entry with the manifest's
    fingerprint) describes (:func:`same_object`), and it holds ``rows`` rows of this config: it can be kept without
    reading it."""
    return (same_object(recorded, listed) and recorded.get("rows") == rows
            and recorded.get("fingerprint_sha256") == fp_sha)


def shard_problem(path: Path, rows: int, fp_sha: str, sha256: Optional[str],
                  recorded: Optional[Dict[str, Any]] = None, listed: Optional[Dict[str, Any]] = None) -> str:
    """Why the shard at ``path`` cannot be kept ('' when it can): missing, a bad footer, other rows or config, or
    bytes that are not the ones recorded when it was written (``sha256``: its checksum sidecar or manifest entry).

    With ``recorded`` and ``listed`` (its listing entry) matching (:func:`stamp_matches`), it is kept unread.
    Otherwise: the footer alone misses a damaged data page, so a kept shard must also match ``sha256``; one with
    no recorded sha256 proves nothing and is redone. Costs one read of the whole file."""
    if stamp_matches(recorded, listed, rows, fp_sha):
        return ""
    if not location(path).exists():
        return "missing"
    if not shard_intact(path, rows, fp_sha):
        return "unreadable footer, other row count or other config"
    if sha256 is None:
        return "no recorded sha256 to check it against"
    if file_sha256(path) != sha256:
        return "sha256 differs from the one recorded when it was written (damaged or changed)"
    return ""


def output_shard_problem(out_path: Path, input_rows: int, rejects: Sequence[Dict[str, Any]], fp_sha: str,
                         rows_per_input: int = 1, sha256: Optional[str] = None, retried: Sequence[str] = (),
                         recorded: Optional[Dict[str, Any]] = None, listed: Optional[Dict[str, Any]] = None) -> str:
    """'' when the output shard counts as done: it checks out (:func:`shard_problem`), its rows plus its
    ``rejects`` (its reject file's records) account for every input row, and none of its rejects has a reason a
    rerun retries (``retried``: a decoding failure, pipeline.executor.failures.RETRIED_REASONS); else why not."""
    again = sorted({r.get("reason") for r in rejects if r.get("reason") in retried})
    problem = shard_problem(out_path, (input_rows - len(rejects)) * rows_per_input, fp_sha, sha256, recorded, listed)
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


def recorded_stamps(folder, listed: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """file -> stamp from the folder's ``_stamps.json`` ({} without one: every shard is then checked the full way)."""
    if STAMPS not in listed:
        return {}
    try:
        return dict(json.loads((location(folder) / STAMPS).read_text()))
    except (OSError, ValueError, TypeError):
        return {}
