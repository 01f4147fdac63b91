"""Compare-and-swap on one small file, the primitive a lease needs: create it only if absent, replace or delete it
only if it still holds the version this process read. ``version`` is opaque to callers.

* **Local (or shared) disk.** Create: the content goes to a private file which is then hard-linked to the name;
  ``link`` fails when the name exists, so creation is exclusive and a reader never sees a half-written lease (an
  ``O_EXCL`` create would be exclusive too, but empty until written). Replace and delete: under ``flock`` on a
  sibling lock file (never deleted, so every contender locks the same inode), the current content is compared and
  then swapped with ``os.replace``. The version is the content's sha256 (a lease's content holds its owner's token
  and heartbeat, so two versions never share bytes).
* **S3 (s3fs).** Conditional requests: ``PUT If-None-Match: *`` creates, ``PUT``/``DELETE If-Match: ETAG``
  replace and delete; the server decides, so it holds across hosts. The version is the object's ETag.
* **Other object stores (gcsfs, adlfs).** The nearest thing fsspec offers without store-specific code:
  ``pipe_file(mode="create")`` where the backend implements it, and for replace and delete a read-compare-write,
  which is NOT atomic (two contenders in the same few milliseconds can both win). Said here plainly; a takeover
  race there needs two runs started within that window on a folder whose owner is already gone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import uuid
from typing import Optional, Tuple

from pipeline.io.storage import is_remote, location, raise_naming


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Local:
    def __init__(self, path, lock_name: str):
        self.path, self.lock = path, path.with_name(lock_name)

    def create(self, data: bytes) -> Optional[str]:
        # Not named like a temp file (.*.tmp-*): the owner's stale-temp cleanup must not race a contender here.
        private = self.path.with_name(f".{self.path.name}.new-{uuid.uuid4().hex[:8]}")
        try:
            with open(private, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.link(private, self.path)
        except FileExistsError:
            return None
        except OSError as err:  # a full disk names no file: say which folder the lease was for
            raise_naming(err, self.path)
            raise
        finally:
            private.unlink(missing_ok=True)
        return _sha(data)

    def read(self) -> Optional[Tuple[bytes, str]]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return data, _sha(data)

    def _locked(self):
        fh = open(self.lock, "a")
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # released when fh closes
        return fh

    def replace(self, data: bytes, version: str) -> Optional[str]:
        with self._locked():
            now = self.read()
            if now is None or now[1] != version:
                return None
            private = self.path.with_name(f".{self.path.name}.new-{uuid.uuid4().hex[:8]}")
            private.write_bytes(data)
            os.replace(private, self.path)
        return _sha(data)

    def delete(self, version: str) -> bool:
        with self._locked():
            now = self.read()
            if now is None or now[1] != version:
                return False
            self.path.unlink()
        return True


class _S3:
    def __init__(self, path):
        self.fs, self.path = path.fs, path.path
        self.bucket, self.key = self.path.split("/", 1)

    def create(self, data: bytes) -> Optional[str]:
        try:
            return self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data, IfNoneMatch="*")["ETag"]
        except FileExistsError:  # s3fs maps 412 Precondition Failed on If-None-Match to FileExistsError
            return self._landed(data)

    def _landed(self, data: bytes) -> Optional[str]:
        """After a 412: the object's version if it holds exactly ``data``, else None. The client retries a PUT whose
        answer was lost (a reset, a timeout); if the first attempt landed, the retry's precondition fails on our
        own write. A lease record holds its owner's token and heartbeat time, so no other writer has these bytes."""
        current = self.read()
        return current[1] if current is not None and current[0] == data else None

    def read(self) -> Optional[Tuple[bytes, str]]:
        try:
            with self.fs.open(self.path, "rb") as fh:  # s3fs pins the ETag it opened: data and version agree
                return fh.read(), fh.details["ETag"]
        except FileNotFoundError:
            return None

    def replace(self, data: bytes, version: str) -> Optional[str]:
        try:
            return self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data, IfMatch=version)["ETag"]
        except FileNotFoundError:
            return None
        except OSError as err:  # 412 arrives as EINVAL; anything else (the store down) is the caller's to see
            if "pre-condition" in str(err).lower() or "precondition" in str(err).lower():
                return self._landed(data)
            raise

    def delete(self, version: str) -> bool:
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=version)
        except Exception:  # noqa: BLE001 - 412 (not ours any more), gone, or the store down or unreachable
            return False   # (botocore's EndpointConnectionError is no OSError): the caller's lease then expires
        return True


class _Fsspec:
    """Read-compare-write (see the module docstring: not atomic)."""

    def __init__(self, path):
        self.fs, self.path = path.fs, path.path

    def create(self, data: bytes) -> Optional[str]:
        try:
            self.fs.pipe_file(self.path, data, mode="create")
        except FileExistsError:
            return None
        except (TypeError, NotImplementedError):  # a backend without mode=: check, then write
            if self.fs.exists(self.path):
                return None
            self.fs.pipe_file(self.path, data)
        return _sha(data)

    def read(self) -> Optional[Tuple[bytes, str]]:
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        return data, _sha(data)

    def replace(self, data: bytes, version: str) -> Optional[str]:
        now = self.read()
        if now is None or now[1] != version:
            return None
        self.fs.pipe_file(self.path, data)
        return _sha(data)

    def delete(self, version: str) -> bool:
        now = self.read()
        if now is None or now[1] != version:
            return False
        self.fs.rm_file(self.path)
        return True


def exclusive_file(path, lock_name: str):
    """The compare-and-swap store for ``path``: ``create(data)``, ``read()``, ``replace(data, version)`` and
    ``delete(version)``; create and replace return the new version, or None when the precondition failed."""
    path = location(path)
    if not is_remote(path):
        return _Local(path, lock_name)
    protocol = path.fs.protocol if isinstance(path.fs.protocol, str) else path.fs.protocol[0]
    return _S3(path) if protocol in ("s3", "s3a") else _Fsspec(path)
