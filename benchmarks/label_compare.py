"""Two label folders of the same prompts, row by row: how many rows differ in each exact column, and the largest
difference of the float ones (logits, trace confidences). Exit 1 when any exact column differs.

    blockpilot prepare output_dir=/tmp/bar/greedy
    cp -r /tmp/bar/greedy/prompts /tmp/bar/vllm/
    blockpilot label output_dir=/tmp/bar/greedy
    blockpilot label output_dir=/tmp/bar/vllm label.continuation=vllm
    python benchmarks/label_compare.py /tmp/bar/greedy /tmp/bar/vllm

(the bar check of benchmarks/results/vllm-continuation.md).
"""

from __future__ import annotations

import argparse
import glob
import sys

import numpy as np
import pyarrow.parquet as pq

EXACT = ("label_block_size", "label_index", "tau", "steps", "new_tokens", "trace_block_size", "trace_match",
         "trace_stopped")


def rows(run: str) -> dict:
    out = {}
    for path in sorted(glob.glob(f"{run}/labels/part-*.parquet")):
        for r in pq.read_table(path).to_pylist():
            out[r["prompt_id"]] = r
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args(argv)
    a, b = rows(args.a), rows(args.b)
    if sorted(a) != sorted(b):
        print(f"different prompts: {len(a)} rows against {len(b)}, {len(set(a) ^ set(b))} not in both")
        return 1
    differ = {k: sum(a[p][k] != b[p][k] for p in a) for k in EXACT}
    logits = max(float(np.abs(np.asarray(a[p]["logits"]) - np.asarray(b[p]["logits"])).max()) for p in a)
    conf = max((float(np.abs(np.asarray(x) - np.asarray(y)).max()) for p in a
                for x, y in zip(a[p]["trace_confidence"] or [], b[p]["trace_confidence"] or [])), default=0.0)
    print(f"{len(a)} rows; rows differing per column: {differ}; max |logits diff| {logits:.3g} (stored rounded to "
          f"fp16/bf16: one rounding step); max |trace confidence diff| {conf:.3g}")
    return 1 if any(differ.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
