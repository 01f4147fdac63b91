"""One writer per stage folder: the lease (``_lease.json``).

A run takes its stage folder's lease before it changes anything there (fingerprint, temp-file cleanup, shards) and
gives it back when it ends. The lease records the owner's host, pid, the pid's process start time (so a reused pid
is not mistaken for the owner), when it was taken and a heartbeat that a daemon thread renews every
:data:`HEARTBEAT_SECONDS`. It is taken atomically (:mod:`pipeline.io.exclusive`: exclusive create locally, a
conditional PUT on S3). A second run finds it and refuses, naming the owner, unless the owner is gone:

* its pid is not running on this host (or is another process now), or it is this very process (an earlier stage
  run here that raised before giving it back: stages of one process run one after another);
* its heartbeat is older than :data:`EXPIRY_SECONDS` (an owner on another host, whose pid cannot be checked).

Then the lease is taken over by a compare-and-swap against the version read, so of two runs that both find a dead
owner one wins and the other refuses; the log says whose lease was taken and why. A heartbeat that finds the lease
no longer its own marks it lost, and :meth:`Lease.check` makes the run stop before its manifest and ``_SUCCESS``.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Dict, Optional

from pipeline.io.exclusive import exclusive_file
from pipeline.io.layout import LEASE, LEASE_LOCK
from pipeline.io.storage import location
from pipeline.runtime.log import get as log

# Module constants, not config keys: they bound how long a crashed run on another host blocks a rerun.
HEARTBEAT_SECONDS = 30.0
EXPIRY_SECONDS = 300.0  # ten missed heartbeats: long enough for a stalled object store, short enough to wait out

_HELD: Dict[str, "Lease"] = {}  # folder -> the lease this process holds there


class LeaseHeld(FileExistsError):
    """Another live run owns the folder. A FileExistsError (its lease file exists), so that the CLI reports it as
    it reports drift: one clear line, exit 1, no traceback."""


def _process_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused pid from the owner."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> Optional[str]:
    """Linux's pid namespace of this process: containers may share a host name (host networking) but not pids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _when(t: Any) -> str:
    try:
        return datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError):
        return "?"


def _parse(data: bytes) -> Optional[Dict[str, Any]]:
    try:
        owner = json.loads(data)
    except ValueError:
        return None
    return owner if isinstance(owner, dict) else None


def describe(owner: Optional[Dict[str, Any]]) -> str:
    if owner is None:
        return "an unreadable lease"
    return (f"{owner.get('stage', '?')} run pid {owner.get('pid')} on host {owner.get('host')} (started "
            f"{_when(owner.get('started'))}, last heartbeat {_when(owner.get('heartbeat'))})")


class Lease:
    def __init__(self, folder, stage: str, heartbeat_s: float = HEARTBEAT_SECONDS, expiry_s: float = EXPIRY_SECONDS):
        self.folder, self.stage = location(folder), stage
        self.heartbeat_s, self.expiry_s = heartbeat_s, expiry_s
        self.store = exclusive_file(self.folder / LEASE, LEASE_LOCK)
        self.token = uuid.uuid4().hex
        self.started = time.time()
        self.version: Optional[str] = None
        self.lost: Optional[str] = None
        self._mutex = threading.Lock()  # the heartbeat thread and release() never swap at once
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "pid_namespace": _pid_namespace(),
                           "process_start": _process_start(os.getpid()), "stage": self.stage, "token": self.token, "started": self.started,
                           "heartbeat": time.time(), "folder": str(self.folder)}, sort_keys=True).encode()

    def _gone(self, owner: Optional[Dict[str, Any]]) -> str:
        """Why the lease's owner no longer writes (empty: it is alive, or may be)."""
        if owner is None:
            return "its lease file is unreadable"
        # Its pid can be checked only from the same host and pid namespace; elsewhere the heartbeat decides.
        here = owner.get("host") == socket.gethostname() and owner.get("pid_namespace") == _pid_namespace()
        pid = owner.get("pid")
        if here and pid == os.getpid():
            return "it is this process, whose earlier run did not give it back"
        if here and isinstance(pid, int):
            if not _pid_running(pid):
                return f"pid {pid} is not running on {owner['host']}"
            if owner.get("process_start") and _process_start(pid) not in (None, owner["process_start"]):
                return f"pid {pid} on {owner['host']} is another process now"
        try:
            silent = time.time() - float(owner.get("heartbeat"))
        except (TypeError, ValueError):
            return "its lease records no heartbeat"
        if silent > self.expiry_s:
            return f"no heartbeat for {silent:.0f} s (expiry {self.expiry_s:.0f} s)"
        return ""

    def acquire(self) -> "Lease":
        for _ in range(5):  # each pass loses only to another run that changed the lease meanwhile
            version = self.store.create(self._record())
            if version is not None:
                return self._held(version)
            current = self.store.read()
            if current is None:  # given back between our create and our read
                continue
            owner = _parse(current[0])
            why = self._gone(owner)
            if not why:
                left = self.expiry_s - (time.time() - float(owner["heartbeat"]))
                raise LeaseHeld(
                    f"{self.folder} is being written by {describe(owner)}: one writer per folder. Wait for that "
                    f"run to end, stop it, or use another output_dir (if it died where this run cannot check its "
                    f"pid, its lease {self.folder / LEASE} expires in {max(left, 0):.0f} s)")
            earlier = _HELD.get(str(self.folder))
            if earlier is not None:
                earlier._halt("taken over by a later run in the same process")
            version = self.store.replace(self._record(), current[1])
            if version is not None:
                log(self.stage).warning(f"took over the lease of {self.folder} from {describe(owner)}: {why}")
                return self._held(version)
        raise LeaseHeld(f"{self.folder}: could not take the lease, other runs keep changing {self.folder / LEASE}")

    def _held(self, version: str) -> "Lease":
        self.version = version
        _HELD[str(self.folder)] = self
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self.stage}", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._mutex:
                if self._stop.is_set():
                    return
                try:
                    version = self.store.replace(self._record(), self.version)
                    if version is None:
                        current = self.store.read()
                        why = f"now held by {describe(_parse(current[0]))}" if current else "its file was removed"
                except Exception as err:  # noqa: BLE001 - the store unreachable: ours until it expires, so retry
                    log(self.stage).warning(f"lease heartbeat for {self.folder} failed: {err}")
                    continue
                if version is None:
                    self._halt(why)
                    log(self.stage).error(f"lost the lease of {self.folder}: {why}")
                    return
                self.version = version

    def _halt(self, why: str) -> None:
        self.lost = why
        self._stop.set()
        self._forget()

    def _forget(self) -> None:
        if _HELD.get(str(self.folder)) is self:
            del _HELD[str(self.folder)]

    def check(self) -> None:
        """Raise if another run took the lease: this run must not publish a manifest or ``_SUCCESS`` over its."""
        if self.lost:
            raise LeaseHeld(f"{self.folder}: this run lost its lease ({self.lost}); stopping before it marks the "
                            "folder complete")

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        with self._mutex:
            if not self.lost:
                try:
                    self.store.delete(self.version)
                except OSError as err:  # it expires on its own
                    log(self.stage).warning(f"could not give back the lease of {self.folder}: {err}")
            self._forget()
        self._thread = None


@atexit.register
def _release_all() -> None:  # a stage that raised (train, report) gives its lease back when the process ends
    for lease in list(_HELD.values()):
        lease.release()
