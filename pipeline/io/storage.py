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
* **What a listing says** (:func:`listing`, :func:`stamp`): each object's size and *stamp*, a value that changes
  whenever the object is rewritten (locally ``st_mtime_ns``; in an object store its ``ETag``), so that the driver's
  bookkeeping can tell that a shard is the one a sidecar or manifest describes from one listing of the folder,
  without reading it; and :func:`parallel_map`, the one pool through which the driver's remaining per-shard reads go.
* **A failing store, in one line** (:func:`store_failure`): what the command line prints when the store stays down
  or keeps failing past the client's retries, naming the store's endpoint and the folder, instead of a traceback.

Retries and timeouts are the client's own, and bounded: s3fs with botocore retries 5xx, throttling, resets and
timeouts (botocore: 5 attempts with backoff; s3fs repeats the whole call up to 5 times on throttling and timeouts),
connect timeout 5 s, read timeout 15 s, so a stalled request ends and is retried; the proxy tests in
tests/integration/test_store_faults.py inject each of these faults. They are tuned per deployment with fsspec's own
configuration, which Ray's workers inherit like the credentials, e.g.
``FSSPEC_S3='{"config_kwargs": {"read_timeout": 60, "retries": {"max_attempts": 10, "mode": "standard"}}}'``.

Credentials and endpoints come from the standard environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL`` for an S3-compatible server such as MinIO, ``GOOGLE_APPLICATION_CREDENTIALS``, ...), which
Ray's workers inherit from the job or the node; none is ever written into a config or an output.
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

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
        _quiet_orphan_tasks()
        return UPath(text, use_listings_cache=False)
    return Path(text)


_QUIETED = []


def _quiet_orphan_tasks() -> None:
    """fsspec runs s3fs/aiohttp on its own event loop. A request that fails while the store is down can leave an
    aiohttp write task whose connection error nobody retrieves, and asyncio's default handler then prints its whole
    traceback ("Task exception was never retrieved") beside the stage's own one-line error. The failure itself
    reaches the stage through the request it awaits; only that orphan's traceback is dropped (to the debug log)."""
    if _QUIETED:
        return
    import logging

    import fsspec.asyn

    loop = fsspec.asyn.get_loop()

    def handler(loop, context):
        if isinstance(context.get("exception"), ConnectionError) and "never retrieved" in context.get("message", ""):
            logging.getLogger(__name__).debug("orphan storage task: %s", context["exception"])
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    _QUIETED.append(loop)


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


@contextmanager
def published_locally(path: Path) -> Iterator[Path]:
    """A hidden temporary file beside local ``path`` for the block to write; once the block ends it is published over
    ``path`` (fsync, rename), and in any case it is gone. A failed write names the file (:func:`raise_naming`)."""
    tmp = tmp_path(path)
    try:
        yield tmp
        replace_durably(tmp, path)
    except OSError as err:
        raise_naming(err, path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(data: bytes, path) -> None:
    """Publish ``data`` at ``path`` all at once (see the module docstring). Local paths use a temp file + rename."""
    path = location(path)
    if is_remote(path):
        path.fs.pipe_file(path.path, data)
        return
    with published_locally(path) as tmp:
        tmp.write_bytes(data)


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


# ---- listings and the driver's parallel reads --------------------------------------------------------------------

# How many per-shard reads (sidecars, reject files, footers) the driver keeps in flight. Each is one small request
# that mostly waits on the store (20-50 ms on S3), so 15,625 shards x 30 ms, 8 minutes one after another, take
# about 15 s at 32; s3fs (one event loop behind a thread-safe sync API) and pyarrow's readers are safe to call from
# threads for reads, and more than this only queues on the client's connection pool (botocore's default is 10-50).
PARALLEL_READS = 32

# The keys that say an object was rewritten, by client: s3fs 'ETag' (a new object always gets a new one; for a
# single PUT the MD5 of its bytes), gcsfs and adlfs 'etag', gcsfs also 'generation'. None of them: no stamp, and
# every check of that object reads it.
STAMP_KEYS = ("ETag", "etag", "generation")


def parallel_map(fn: Callable[[Any], Any], items: Iterable[Any]) -> List[Any]:
    """``[fn(x) for x in items]``, at most :data:`PARALLEL_READS` at a time, in order; the first error is raised."""
    items = list(items)
    if len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(PARALLEL_READS, len(items))) as pool:
        return list(pool.map(fn, items))


def _remote_stamp(info: Dict[str, Any]) -> str:
    return next((str(info[k]) for k in STAMP_KEYS if info.get(k)), "")


def listing(folder) -> Dict[str, Dict[str, Any]]:
    """``{name: {"size", "stamp"}}`` of the files directly in ``folder``, from ONE listing ({} when it does not
    exist): ``os.scandir`` locally (stamp ``st_mtime_ns``), ``fs.ls(detail=True)`` in an object store (stamp the
    ETag; a paged listing, 1,000 keys a request on S3, but no request per object)."""
    folder = location(folder)
    try:
        if is_remote(folder):
            return {e["name"].rstrip("/").rsplit("/", 1)[-1]: {"size": int(e.get("size") or 0),
                                                                "stamp": _remote_stamp(e)}
                    for e in folder.fs.ls(folder.path, detail=True) if e.get("type") != "directory"}
        with os.scandir(folder) as entries:
            return {e.name: _local_stamp(e.stat()) for e in entries if e.is_file()}
    except (FileNotFoundError, NotADirectoryError):
        return {}


def _local_stamp(st: os.stat_result) -> Dict[str, Any]:
    return {"size": st.st_size, "stamp": str(st.st_mtime_ns)}


def stamp(path) -> Dict[str, Any]:
    """``{"size", "stamp"}`` of one file, as :func:`listing` gives it (one stat, or one HEAD): what the writer of a
    shard records once it is published."""
    path = location(path)
    if is_remote(path):
        info = path.fs.info(path.path)
        return {"size": int(info["size"]), "stamp": _remote_stamp(info)}
    return _local_stamp(path.stat())


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


# ---- a failing object store, in one line ------------------------------------------------------------------------

# Where each object store's client errors come from, by the output's scheme. s3fs, once its retries (and botocore's)
# are spent, raises botocore's error or an OSError whose __cause__ is botocore's ClientError; an unreachable endpoint
# is botocore's EndpointConnectionError, which is no OSError. Other HTTP clients (requests, httpx, aiohttp on their
# own: a model hub, a dataset download) are left out: their failures are not the output store's.
STORE_CLIENTS = {"s3": ("botocore", "aiobotocore", "s3fs"), "s3a": ("botocore", "aiobotocore", "s3fs"),
                 "gs": ("gcsfs", "google"), "gcs": ("gcsfs", "google"),
                 "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure")}


def store_failure(err: BaseException, output_dir) -> Optional[str]:
    """One line for a stage that failed because the object store under ``output_dir`` did (unreachable, 5xx or
    timeouts after the client's retries, missing credentials): what the command line prints instead of a
    traceback. None for anything else (a local folder, another error, a bug), which keeps its traceback.

    The store's error is recognised by the package it comes from (:data:`STORE_CLIENTS`), on ``err`` or anywhere in
    its chain of causes; the line names the store's endpoint, the folder and the client's own words."""
    text = str(output_dir)
    if not is_uri(text):
        return None
    clients = STORE_CLIENTS.get(text.split("://", 1)[0].lower())
    cause, seen = err, set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if type(cause).__module__.split(".", 1)[0] in (clients or ()):
            words = " ".join(str(cause).split())
            words = words if len(words) <= 400 else words[:400] + "..."
            return (f"the object store at {store_endpoint(text)} failed for {text} after the storage client's "
                    f"retries: {type(cause).__name__}: {words}. What was written is kept: rerun the stage once the "
                    "store answers")
        cause = cause.__cause__ or cause.__context__
    return None


def store_endpoint(path) -> str:
    """The URL at which the client reaches the store behind ``path`` (for messages): the S3 client's endpoint (an
    ``AWS_ENDPOINT_URL`` or the region's), else the scheme and bucket."""
    text = str(path)
    try:
        fs = location(text).fs
        client = getattr(fs, "_s3", None)  # s3fs, once connected (the stage's own instance: fsspec caches it)
        url = getattr(getattr(client, "meta", None), "endpoint_url", None) or getattr(fs, "endpoint_url", None)
        if url:
            return str(url)
    except Exception:  # noqa: BLE001 - a message must not fail: fall back on the URI's scheme and bucket
        pass
    scheme, rest = text.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"

