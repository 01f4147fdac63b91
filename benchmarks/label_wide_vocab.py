"""A random-weight pair at Qwen3's vocabulary (V = 151,936) through prepare -> label -> validate, batch 1 vs batched.

    python benchmarks/label_wide_vocab.py                        # 32 prompts, max_new_tokens 64, batch 16
    python benchmarks/label_wide_vocab.py --hidden 512 --prompts 16

Builds a random Qwen3 target (2 layers) + DFlash draft (1 layer, B = 4) with V = 151,936 (the lm_head tilted as
in tests/random_pair.py so that acceptance varies), saves them as checkpoints, prepares the bundled prompts with
the tiny pair's tokenizer, then labels them twice in replay mode, label.batch_size=1 and =--batch-size, each in a
child process running the label stage in-process (stages.label.LabelStage with the driver's LocalExecutor: the
child does exactly what one label actor does), and validates both label sets (`blockpilot validate`'s code).

Prints per run: rows, bytes per row on disk (the shards' sizes / rows), the child's peak resident memory (what a
label actor needs), labelling throughput (rows / the rows' prefill + decode seconds) and wall (models loaded, cost
profile, shards written), and whether both runs' labels agree row for row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from benchmarks.label_scaling import busy_throughput  # noqa: E402
from random_pair import save_wide_pair  # noqa: E402  (the V = 151,936 pair, shared with its test)

CHILD = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
torch.set_num_threads(1)
from pipeline.runtime.config import load_config
from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from stages.label import LabelStage
cfg = load_config(json.loads(sys.argv[1]))
t0 = time.perf_counter()
run_stage(LabelStage(cfg), LocalExecutor())
print(json.dumps({{"wall": time.perf_counter() - t0}}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--out", default=None, help="working folder (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    torch.set_num_threads(1)
    from pipeline.runtime.config import load_config
    from pipeline.executor.driver import run_stage
    from pipeline.executor.local import LocalExecutor
    from pipeline.data.validate import validate_dataset
    from stages.prepare import PrepareStage

    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bp-wide-"))
    try:
        target, draft = save_wide_pair(work, args.hidden)
        base = ["progress=false", f"model.target={target}", f"model.draft={draft}",
                "model.tokenizer=bundled:tiny-target", "model.dtype=float32", "model.device=cpu",
                f"decode.max_new_tokens={args.max_new_tokens}", f"prepare.limit={args.prompts}",
                f"prepare.shard_size={args.prompts}", "label.k=1", "label.mode=replay"]
        run_stage(PrepareStage(load_config([f"output_dir={work / 'prepared'}", *base])), LocalExecutor())
        rows_of = {}
        for bs in (1, args.batch_size):
            out = work / f"batch-{bs}"
            shutil.copytree(work / "prepared" / "prompts", out / "prompts")
            overrides = [f"output_dir={out}", *base, f"label.batch_size={bs}"]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
            proc = subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(ROOT)), json.dumps(overrides)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
            stdout, stderr = proc.stdout.read(), proc.stderr.read()
            if status != 0:
                print(stderr[-3000:])
                return 1
            wall = json.loads(stdout.strip().splitlines()[-1])["wall"]
            labels = out / "labels"
            report = validate_dataset(str(labels))
            shards = sorted(labels.glob("part-*.parquet"))
            t = pa.concat_tables([pq.read_table(p) for p in shards])
            _, rate, _ = busy_throughput(labels)  # one actor: rows / its labelling seconds
            nbytes = sum(p.stat().st_size for p in shards)
            rows_of[bs] = t.select(["prompt_id", "tau", "steps", "new_tokens", "label_block_size"]).to_pylist()
            print(f"batch {bs}: {t.num_rows} rows, V={t.schema.field('logits').type.list_size}, "
                  f"{nbytes / t.num_rows / 1024:.1f} KiB/row on disk, peak RSS {usage.ru_maxrss / 1024:.0f} MiB, "
                  f"labelling {rate:.2f} prompts/s, wall {wall:.1f} s; validate: "
                  f"{'OK' if report.ok else report.render()}", flush=True)
        same = sum(a == b for a, b in zip(rows_of[1], rows_of[args.batch_size]))
        print(f"labels batch 1 vs batch {args.batch_size}: {same}/{len(rows_of[1])} rows identical")
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
