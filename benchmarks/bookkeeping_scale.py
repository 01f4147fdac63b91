"""The driver's own work per shard as the shard count grows (issue #25, item 10): a synthetic stage (no models) of
N one-row shards, run by the real driver in this process. Per N it times the first run's planning (every shard
missing), its closing (the manifest and the summary: from the sidecars, no shard read again), the full first run,
and a rerun of the complete folder (skip-if-complete, which checks every shard's sha256). Prints seconds per shard;
flat columns mean linear total cost.

Usage: python benchmarks/bookkeeping_scale.py [N ...]   (default 1000 4000 20000; the 20,000 case takes minutes)
"""
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
import pipeline.executor.driver as driver_mod  # noqa: E402
import pipeline.executor.manifest as manifest_mod  # noqa: E402
from pipeline.executor.folder import mark_complete  # noqa: E402
from pipeline.executor.local import LocalExecutor  # noqa: E402
from pipeline.executor.driver import run_stage  # noqa: E402
from pipeline.io.shards import shard_name, write_parquet_atomic  # noqa: E402
from test_bookkeeping import StatSquares  # noqa: E402
from test_driver import SCHEMA, cfg_for  # noqa: E402


def timed(module, name, bucket):
    real = getattr(module, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            bucket[name] = bucket.get(name, 0.0) + time.perf_counter() - t0
    setattr(module, name, wrapper)
    return real


def case(n: int, root: Path):
    inputs = root / "in"
    inputs.mkdir()
    for i in range(n):
        write_parquet_atomic(pa.Table.from_pylist([{"prompt_id": f"p{i}", "source": "toy", "x": i}], schema=SCHEMA),
                             inputs / shard_name(i))
    mark_complete(inputs)
    out, spent = root / "out", {}
    reals = [timed(driver_mod, "_place", spent), timed(driver_mod, "write_manifest", spent)]
    try:
        t0 = time.perf_counter()
        run_stage(StatSquares(cfg_for(), inputs, out), LocalExecutor(0))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_stage(StatSquares(cfg_for(), inputs, out), LocalExecutor(0))  # complete: skipped
        skip = time.perf_counter() - t0
    finally:
        driver_mod._place, driver_mod.write_manifest = reals
    return {"planning": spent["_place"] / n, "closing": spent["write_manifest"] / n, "first run": first / n,
            "skip": skip / n}


if __name__ == "__main__":
    import logging

    logging.disable(logging.INFO)
    sizes = [int(a) for a in sys.argv[1:]] or [1000, 4000, 20000]
    print("| shards | planning ms/shard | closing ms/shard | first run ms/shard | skip-if-complete ms/shard |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        with tempfile.TemporaryDirectory() as d:
            r = case(n, Path(d))
        print(f"| {n} | {r['planning'] * 1e3:.3f} | {r['closing'] * 1e3:.3f} | {r['first run'] * 1e3:.3f} | "
              f"{r['skip'] * 1e3:.3f} |", flush=True)
