"""The label stage with 1 vs 2 CPU actors, through the real stage on a local Ray, on the same prompt shards.

    python benchmarks/label_scaling.py                          # 128 prompts in 4 shards, max_new_tokens 128
    python benchmarks/label_scaling.py --prompts 64 --shard-size 16 label.batch_size=16

Prepares the bundled prompts once (in-process), then runs `label` (stages.label.LabelStage through
pipeline.executor.ray.executor.execute: Ray actors, one torch thread each, workers.cpus_per_worker=1) twice into fresh folders, with
label.num_workers=1 and =2. Prints, for each:

* labelling throughput: rows / the busiest actor's labelling seconds (the sum of its rows' prefill_seconds and
  decode_seconds, which add up to its batches' wall time): the steady state, without actor start-up;
* wall: the whole stage (Ray actors started, models loaded, each actor's cost profile, shards written).

Ends with `ratio 2 actors/1 actor = X.XX (labelling throughput; wall incl. start-up Y.YY)`. Extra key=value
arguments are config overrides for both runs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def busy_throughput(labels: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.concat_tables([pq.read_table(p, columns=["worker", "prefill_seconds", "decode_seconds"])
                          for p in sorted(labels.glob("part-*.parquet"))])
    busy = defaultdict(float)
    for w, pre, dec in zip(t.column("worker").to_pylist(), t.column("prefill_seconds").to_pylist(),
                           t.column("decode_seconds").to_pylist()):
        busy[w] += pre + sum(dec)
    return t.num_rows, t.num_rows / max(busy.values()), dict(busy)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="working folder (default: a temporary one, removed)")
    ap.add_argument("overrides", nargs="*", help="config key=value for both runs")
    args = ap.parse_args(argv)

    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from pipeline.runtime.config import load_config
    from pipeline.executor.driver import run_stage
    from pipeline.executor.local import LocalExecutor
    from pipeline.executor.ray.executor import execute
    from stages.label import LabelStage
    from stages.prepare import PrepareStage

    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bp-scaling-"))
    base = ["progress=false", f"prepare.limit={args.prompts}", f"prepare.shard_size={args.shard_size}",
            f"decode.max_new_tokens={args.max_new_tokens}", "workers.cpus_per_worker=1", "ray.num_cpus=2",
            *args.overrides]
    try:
        run_stage(PrepareStage(load_config([f"output_dir={work / 'prepared'}", *base])), LocalExecutor())
        results = {}
        for n in (1, 2):
            out = work / f"actors-{n}"
            shutil.copytree(work / "prepared" / "prompts", out / "prompts")
            cfg = load_config([f"output_dir={out}", *base, f"label.num_workers={n}"])
            t0 = time.perf_counter()
            execute(LabelStage(cfg))
            wall = time.perf_counter() - t0
            rows, rate, busy = busy_throughput(out / "labels")
            results[n] = (rate, rows / wall)
            print(f"{n} actor(s): {rows} rows, batch {cfg.label.batch_size}; labelling throughput {rate:.2f} "
                  f"prompts/s (busiest actor {max(busy.values()):.1f} s of {len(busy)}); wall {wall:.1f} s "
                  f"({rows / wall:.2f} prompts/s incl. start-up)", flush=True)
        print(f"ratio 2 actors/1 actor = {results[2][0] / results[1][0]:.2f} (labelling throughput; wall incl. "
              f"start-up {results[2][1] / results[1][1]:.2f})")
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
