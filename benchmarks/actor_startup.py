"""Start-up of N workers on one node, before and after #51 point 4 (models once per node): what a label actor does
before its first shard, fingerprinting its model folders (pipeline.decoding.provenance) and loading the pair
(pipeline.decoding.models.load_models), in N processes started at once on one node.

- before: every process hashes every weight file itself (the digest cache's per-file lock replaced by none: all of
  them missed the cache, written only once a hash ended), and from_pretrained builds the model in host memory and
  copies it (no ``device_map``);
- after: as shipped: the first process hashes each file and the others read its digest; each tensor goes straight
  to the device as it is read (``device_map={"": device}``).

Side by side and interleaved, a fresh digest cache per round; printed: the slowest process's start-up, the hashes
done, each process's peak resident memory, and the after/before ratios. On this CPU-only machine "the device" is
the CPU, so the straight-to-device half changes nothing measurable here (host memory is the device's); what it
saves is the host copy of each GPU actor's weights, which only a GPU node shows.

    .venv/bin/python benchmarks/actor_startup.py --workers 2 --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests", ROOT / "benchmarks"):
    sys.path.insert(0, str(p))


def start_up(target: str, draft: str, before: bool, log: str, start: str) -> tuple:
    """One worker's start-up in a fresh process: (seconds, peak RSS in MB)."""
    import torch
    from digest_once_per_node import counted_and_ready

    from pipeline.decoding import models, provenance
    from pipeline.runtime.config import ModelConfig

    torch.set_num_threads(1)
    if before:
        models.straight_to = lambda device: {}
    counted_and_ready(not before, log, start)  # the hashes counted; "before" without the per-file lock
    t0 = time.perf_counter()
    provenance.model_provenance(target, None, "model.target")
    provenance.model_provenance(draft, None, "model.draft")
    models.load_models(ModelConfig(target=target, draft=draft, tokenizer="bundled:tiny-target", device="cpu",
                                   dtype="float32"))
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def round_of(target: str, draft: str, workers: int, before: bool) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = tmp  # a fresh digest cache: a node starting its first job
        log, start = Path(tmp) / "hashed", Path(tmp) / "start"
        log.touch()
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            jobs = [pool.apply_async(start_up, (target, draft, before, str(log), str(start))) for _ in range(workers)]
            time.sleep(8.0)  # every process imported and waiting (spawned interpreters)
            start.touch()
            got = [j.get() for j in jobs]
        return max(s for s, _ in got), len(log.read_text().splitlines()), max(m for _, m in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from random_pair import save_real_shaped_pair

    from pipeline.decoding.models import locate

    with tempfile.TemporaryDirectory() as tmp:
        real = [str(p) for p in save_real_shaped_pair(Path(tmp) / "real")]
        pairs = {"bundled tiny pair": [locate(f"bundled:tiny-{k}", None, k).path for k in ("target", "draft")],
                 "real shapes (V = 151,936)": real}
        print(f"{args.workers} workers starting at once on one node, {args.repeats} interleaved repeats each")
        for name, (target, draft) in pairs.items():
            size = sum(f.stat().st_size for d in (target, draft) for f in Path(d).glob("*.safetensors")) / 2 ** 20
            got = {"before": [], "after": []}
            for _ in range(args.repeats):
                for variant in ("before", "after"):
                    got[variant].append(round_of(target, draft, args.workers, variant == "before"))
            print(f"\n{name}: weights {size:.0f} MiB")
            for variant, runs in got.items():
                walls = [w for w, _, _ in runs]
                print(f"  {variant:<6} start-up of the slowest {statistics.median(walls):6.2f} s "
                      f"(min {min(walls):.2f}, max {max(walls):.2f}); hashes per round "
                      f"{sorted({h for _, h, _ in runs})}; peak RSS per process "
                      f"{statistics.median(m for _, _, m in runs):.0f} MB")
            ratio = statistics.median(w for w, _, _ in got["after"]) / statistics.median(w for w, _, _ in got["before"])
            print(f"  after/before (median start-up): {ratio:.2f}x")


if __name__ == "__main__":
    main()
