"""Where stage folders live: a local (or shared) disk, or object storage (``s3://``, ``gs://``, ``az://``, ...).

Every stage reaches its folder through :func:`location`, which returns a :class:`pathlib.Path` for a local path and
a ``universal_pathlib`` ``UPath`` (fsspec underneath: ``s3fs``, ``gcsfs``, ``adlfs``) for a URI. ``UPath`` has the
``pathlib`` interface (``/``, ``exists``, ``glob``, ``read_text``, ``open``, ``unlink``), so the stages' code is the
same for both; this module holds only what differs:

* **Atomic writes.** Locally: a hidden temporary file, fsync, ``os.replace`` (:mod:`pipeline.io.shards`). In an object
  store a rename is a copy, but a PUT is already atomic: the object becomes visible only once its upload completes,
  and a multipart upload that is never completed (a killed writer) is never visible. So remote writes serialise to
  memory and upload with one ``pipe_file`` (a single PUT, or a multipart upload completed last); fsspec's buffered
  file objects are not used for outputs, because closing one after an error would publish a partial object.
* **Recursive deletes**, and a ``pyarrow.fs`` view of the same filesystem for Ray Data and Ray Train
  (``storage_filesystem``), so that every reader and writer goes through one configured client.

Credentials and endpoints come from the standard environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL`` for an S3-compatible server such as MinIO, ``GOOGLE_APPLICATION_CREDENTIALS``, ...), which
Ray's workers inherit from the job or the node; none is ever written into a config or an output.
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Tuple, Union

import pyarrow as pa
import pyarrow.parquet as pq

PathLike = Union[str, os.PathLike]


def is_uri(path: PathLike) -> bool:
    """``scheme://...`` other than ``file://``."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def location(path: PathLike):
    """A ``pathlib.Path`` (local) or a ``UPath`` (object storage) for ``path``; idempotent."""
    if isinstance(path, Path) or getattr(path, "fs", None) is not None:  # already a location
        return path
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if text.startswith("file://"):
        return Path(text[len("file://"):])
    if is_uri(text):
        from upath import UPath

        # No listing cache: shards are written by other processes (Ray actors), and a cached listing would hide
        # them from the driver's done checks and manifest.
        return UPath(text, use_listings_cache=False)
    return Path(text)


def is_remote(path: Any) -> bool:
    """True for a location in object storage (a ``UPath`` whose filesystem is not the local one)."""
    if isinstance(path, (str, bytes)):
        return is_uri(path)
    fs = getattr(path, "fs", None)
    if fs is None:
        return False
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol not in ("file", "local")


def resolve(path: PathLike):
    """An absolute location: local paths are resolved against the working directory; URIs are already absolute."""
    loc = location(path)
    return loc if is_remote(loc) else loc.resolve()


def tmp_path(path: Path) -> Path:
    # A leading dot and a unique suffix: readers that glob part-*.parquet never see half-written files.
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


def replace_durably(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_bytes_atomic(data: bytes, path) -> None:
    """Publish ``data`` at ``path`` all at once (see the module docstring). Local paths use a temp file + rename."""
    path = location(path)
    if is_remote(path):
        path.fs.pipe_file(path.path, data)
        return
    tmp = tmp_path(path)
    try:
        tmp.write_bytes(data)
        replace_durably(tmp, path)
    except OSError as err:
        raise_naming(err, path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def raise_naming(err: OSError, path) -> None:
    """Re-raise a failed local write naming the file it was for: a full disk (ENOSPC, from a plain write or from
    pyarrow) names no file, and the user must learn which folder is out of space. No errno, or a file already
    named: left to the caller's bare ``raise``."""
    if err.errno and not err.filename:
        raise OSError(err.errno, os.strerror(err.errno), str(path)) from err


def parquet_bytes(table: pa.Table, **options: Any) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **options)
    return sink.getvalue().to_pybytes()


def rmtree(path) -> None:
    """Delete a folder and everything under it; nothing happens when it does not exist."""
    path = location(path)
    if is_remote(path):
        if path.exists():
            path.fs.rm(path.path, recursive=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def parquet_file(path) -> pq.ParquetFile:
    """A ``ParquetFile`` (footer read, row groups on demand) for a local path or an object."""
    path = location(path)
    if is_remote(path):
        return pq.ParquetFile(path.path, filesystem=arrow_filesystem(path)[0])
    return pq.ParquetFile(path)


def read_table(path, columns=None) -> pa.Table:
    path = location(path)
    if is_remote(path):
        fs, inner = arrow_filesystem(path)
        return pq.read_table(inner, columns=columns, filesystem=fs)
    return pq.read_table(path, columns=columns)


def size(path) -> int:
    path = location(path)
    return int(path.fs.size(path.path)) if is_remote(path) else path.stat().st_size


def arrow_filesystem(path) -> Tuple[Any, str]:
    """``(pyarrow.fs.FileSystem, path inside it)`` for Ray Data and Ray Train: the fsspec filesystem that the
    stages use, wrapped by ``pyarrow.fs.FSSpecHandler``, so both see the same objects with the same client."""
    import pyarrow.fs as pafs

    path = location(path)
    if is_remote(path):
        return pafs.PyFileSystem(pafs.FSSpecHandler(path.fs)), path.path
    return pafs.LocalFileSystem(), str(path)


def savefig(fig, path, **options: Any) -> None:
    """matplotlib's savefig into any location (it writes to a file object; the upload is one atomic write)."""
    buf = io.BytesIO()
    fmt = options.pop("format", None) or location(path).suffix.lstrip(".") or "png"
    fig.savefig(buf, format=fmt, **options)
    write_bytes_atomic(buf.getvalue(), path)
