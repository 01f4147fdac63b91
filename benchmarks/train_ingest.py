"""How a small label set reaches Ray Train's workers: the object store (stages.train's path for a set of at most
SMALL_LABEL_BYTES), Ray Data over the same in-memory columns (the path before it: ``ray.data.from_arrow``, split by
Ray Data), and Ray Data streaming over the shards (the path of a larger set). One train per repeat and path, each in
a fresh process with its own local Ray, the paths interleaved; per path the median wall time of ``train.run`` and the
CPU seconds of every process the run started (polled with psutil, so a process's last fraction of a second before it
exits is missed alike on every path).

    python benchmarks/train_ingest.py RUN_DIR [--repeats 3]

RUN_DIR holds prompts/ and labels/ (e.g. a tiny run: ``blockpilot prepare`` and ``blockpilot label`` with
prepare.limit=16); each train writes under a fresh copy. Results: benchmarks/results/train-in-memory.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATHS = ("object store", "Ray Data in memory", "Ray Data streamed")
SETTINGS = ["model.device=cpu", "progress=false", "train.use_gpu=false", "train.model=mlp", "train.epochs=2",
            "train.checkpoint_every=2", "train.hidden=64"]


def one(path: str, run_dir: str) -> None:
    """In the child: start Ray, then time one train of ``run_dir`` by ``path``."""
    import numpy as np

    from pipeline.executor.ray.runtime import init_ray
    from pipeline.runtime.config import load_config
    from stages import train

    cfg = load_config([f"output_dir={run_dir}", *SETTINGS])
    ray = init_ray(cfg.ray)
    if path == "Ray Data streamed":
        train.SMALL_LABEL_BYTES = 0
    elif path == "Ray Data in memory":  # the columns in memory, handed over as Ray Datasets (the former path)
        import pyarrow as pa
        import ray.data

        def as_table(cols):
            return pa.table({k: pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(v).reshape(-1)), v.shape[1])
                             if np.asarray(v).ndim == 2 else pa.array(np.asarray(v).tolist()) for k, v in cols.items()})

        columns = train._datasets
        train._datasets = lambda *a: {k: ray.data.from_arrow(as_table(v)) for k, v in columns(*a).items()}
    t0 = time.perf_counter()
    train.run(cfg)
    print(json.dumps({"wall_s": time.perf_counter() - t0}), flush=True)
    ray.shutdown()


def measure(path: str, source: Path) -> dict:
    import psutil

    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        for name in ("prompts", "labels"):
            shutil.copytree(source / name, run / name)
        before = {p.pid for p in psutil.process_iter()}
        proc = subprocess.Popen([sys.executable, __file__, "--one", path, str(run)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        cpu = {}
        while proc.poll() is None:
            for p in psutil.process_iter(["cpu_times"]):
                if p.pid not in before and p.info["cpu_times"] is not None:
                    t = p.info["cpu_times"]
                    cpu[p.pid] = t.user + t.system
            time.sleep(0.2)
        out = [line for line in proc.stdout.read().splitlines() if line.startswith("{")]
        if proc.returncode or not out:
            raise RuntimeError(f"{path}: the train failed ({proc.returncode})")
        return {"wall_s": json.loads(out[-1])["wall_s"], "cpu_s": sum(cpu.values()), "processes": len(cpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.run_dir)
    got = {p: [] for p in PATHS}
    for r in range(args.repeats):
        for path in PATHS:  # interleaved: a machine that slows down slows every path alike
            got[path].append(measure(path, Path(args.run_dir)))
            print(f"repeat {r + 1} {path}: {got[path][-1]}", flush=True)
    base = {k: statistics.median(x[k] for x in got[PATHS[0]]) for k in ("wall_s", "cpu_s")}
    print("\n| path | train wall s (median, min-max) | CPU s of the run's processes (median) | processes | "
          "wall / object store | CPU / object store |\n|---|---:|---:|---:|---:|---:|")
    for path in PATHS:
        w = [x["wall_s"] for x in got[path]]
        c = statistics.median(x["cpu_s"] for x in got[path])
        print(f"| {path} | {statistics.median(w):.1f} ({min(w):.1f}-{max(w):.1f}) | {c:.1f} | "
              f"{statistics.median(x['processes'] for x in got[path]):.0f} | "
              f"{statistics.median(w) / base['wall_s']:.2f} | {c / base['cpu_s']:.2f} |")


if __name__ == "__main__":
    main()
