"""Workers starting together on one node fingerprint a local model folder: before, each hashed every weight file
(the digest cache was written only after a hash ended, so all of them missed it); now a per-file lock beside the
cache lets the first hash and the others read its digest (pipeline.decoding.provenance.file_digest, issue #51).

Side by side, interleaved: N processes (fork) digest the same file at once, each with the lock ("after") or with it
replaced by no lock ("before"), a fresh digest cache per round; wall time of the slowest and the hashes done.

    .venv/bin/python benchmarks/digest_once_per_node.py --mb 512 --workers 4 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.decoding import provenance  # noqa: E402


def counted_and_ready(lock: bool, log: str, start: str) -> None:
    """In a benchmark's worker process: the per-file lock off where ``lock`` is false ("before"), each hash
    appended to ``log``, then wait for ``start`` to exist (every process released at once). benchmarks/
    actor_startup.py's workers do the same."""
    if not lock:
        provenance._lock = lambda real: contextlib.nullcontext()
    hashed = provenance._sha256_file

    def counted(real):
        with open(log, "a") as f:
            f.write("x\n")
        return hashed(real)

    provenance._sha256_file = counted
    while not os.path.exists(start):
        time.sleep(0.001)


def digest(path: str, lock: bool, log: str, start: str) -> float:
    counted_and_ready(lock, log, start)
    t0 = time.perf_counter()
    provenance.file_digest(Path(path))
    return time.perf_counter() - t0


def round_of(path: Path, workers: int, lock: bool) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = tmp  # a fresh digest cache: a node starting its first job
        log, start = Path(tmp) / "hashed", Path(tmp) / "start"
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            jobs = [pool.apply_async(digest, (str(path), lock, str(log), str(start))) for _ in range(workers)]
            time.sleep(0.5)
            start.touch()
            walls = [j.get() for j in jobs]
        return max(walls), len(log.read_text().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        with open(path, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        provenance._sha256_file(str(path))  # page cache warm: both modes read from memory
        results = {"before (no lock)": [], "after (lock)": []}
        for r in range(args.repeats):
            for name, lock in (("before (no lock)", False), ("after (lock)", True)) if r % 2 == 0 else \
                    (("after (lock)", True), ("before (no lock)", False)):
                results[name].append(round_of(path, args.workers, lock))
    print(f"{args.workers} processes digest one {args.mb} MB file at once, {args.repeats} interleaved repeats")
    for name, rounds in results.items():
        walls = [w for w, _ in rounds]
        print(f"  {name:<18} wall of the slowest: median {statistics.median(walls):.2f} s (min {min(walls):.2f}, "
              f"max {max(walls):.2f}); hashes per round {[h for _, h in rounds]}")
    b = statistics.median(w for w, _ in results["before (no lock)"])
    a = statistics.median(w for w, _ in results["after (lock)"])
    print(f"  ratio before/after (medians): {b / a:.2f}x")


if __name__ == "__main__":
    main()
