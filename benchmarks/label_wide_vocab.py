"""A random-weight pair at Qwen3's vocabulary (V = 151,936) through prepare -> label -> validate, batch 1 vs batched;
and (``precision``) the bytes a label row costs there at each label.logits_precision.

    python benchmarks/label_wide_vocab.py                        # 32 prompts, max_new_tokens 64, batch 16
    python benchmarks/label_wide_vocab.py --hidden 512 --prompts 16 --logits-precision bf16
    python benchmarks/label_wide_vocab.py precision              # fp16 vs bf16 rows, synthetic logits (seconds)
    python benchmarks/label_wide_vocab.py precision --write      # and benchmarks/results/label-wide-vocab.md

``precision`` writes the same rows twice through the label writer (pipeline.labelling.shard: label_table and
parquet_options, as the label stage writes them), once per precision, and prints bytes per row on disk, bytes per
logit, write and read ms per row and the max |rounding error| against the float32 logits; also, for comparison
only, bf16 under zstd (the codec not chosen) and as raw uint16 bit patterns (the encoding not chosen). What compresses is the sign and exponent byte (the mantissa byte is noise),
so the bytes depend on the values' distribution: the logits are the tiny target's real ones resampled to V (see
synthetic_logits), and a zero-centred Gaussian as the harder case. The other columns are those of a default-config
row (k = 4, max_new_tokens 128, a trace at b_max 20 as Qwen3's B = 16 gives).

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


def synthetic_logits(rows: int, vocab: int, shape: str = "tiny", seed: int = 0):
    """[rows, vocab] float32 logits. ``tiny``: each row's values drawn (with replacement) from one real prefill-logit
    row of the bundled tiny target (V = 4,096) on a bundled prompt, so the values' spread, sign mix and tail are a
    real LM's, only at Qwen3's V. ``gaussian``: N(0, 2.5), a zero-centred bulk (the harder case for bf16: the sign
    bit is a coin toss)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if shape == "gaussian":
        return (rng.normal(0.0, 2.5, (rows, vocab))).astype(np.float32)
    import torch

    from pipeline.data.sources import build_prompts
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import ModelConfig, load_config

    m = load_models(ModelConfig(device="cpu", dtype="float32"))
    cfg = load_config()
    prompts, _, _ = build_prompts(cfg.prepare.sources, m.tokenizer, cfg.prepare.max_prompt_tokens, limit=min(rows, 16))
    with torch.inference_mode():  # the float32 logits, before any rounding (what logits_to_numpy rounds)
        real = [m.target(torch.tensor(r["input_ids"])[None], logits_to_keep=1).logits[0, -1].float().numpy()
                for r in prompts]
    return np.stack([rng.choice(real[i % len(real)], vocab) for i in range(rows)]).astype(np.float32)


def synthetic_rows(logits, max_new_tokens: int = 128, trace_block_size: int = 20, seed: int = 0):
    """label_row-shaped rows around ``logits``: k = 4 candidates, a full-length trace of draft confidences."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cands = list(range(12, 21))
    starts = max_new_tokens - 1
    rows = []
    for i, x in enumerate(logits):
        tau = sorted(rng.uniform(1.0, 6.0, len(cands)).round(4).tolist())
        conf = rng.beta(4.0, 0.7, (starts, trace_block_size - 1)).astype(np.float32)
        rows.append({"prompt_id": f"{i:024x}", "source": "synthetic", "prompt_tokens": 200, "logits": x,
                     "candidates": cands, "tau": tau, "steps": [max_new_tokens // 4] * len(cands),
                     "new_tokens": [max_new_tokens] * len(cands), "decode_seconds": [0.5] * len(cands),
                     "label_block_size": cands[-1], "label_index": len(cands) - 1, "label_speedup_block_size": 16,
                     "prefill_seconds": 0.1, "worker": "node/gpu0", "trace_block_size": trace_block_size,
                     "trace_stopped": False, "trace_match": rng.integers(0, trace_block_size, starts).tolist(),
                     "trace_confidence": conf.tolist(), "trace_seconds": 0.2})
    return rows


def precision_main(args) -> int:
    import time

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.schemas import round_logits
    from pipeline.labelling.shard import label_table, parquet_options

    lines = [f"{args.rows} rows at V = {args.vocab:,}, k = 4, max_new_tokens 128, trace b_max 20; byte-stream-split, "
             "the label writer's codecs (parquet_options) unless the row says otherwise", "",
             "| logits | stored as | bytes / row | of which logits (bytes / logit) | write ms / row | read ms / row "
             "| max abs error vs float32 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.parquet"

        def size(table, **options):
            t0 = time.perf_counter()
            pq.write_table(table, path, **options)
            t1 = time.perf_counter()
            pq.read_table(path)
            return path.stat().st_size, (t1 - t0) * 1e3 / table.num_rows, (time.perf_counter() - t1) * 1e3 / table.num_rows

        for shape in ("tiny", "gaussian"):
            x = synthetic_logits(args.rows, args.vocab, shape)
            rows = synthetic_rows(x)
            rest = label_table([{**r, "logits": r["logits"][:1]} for r in rows], 1, {})  # all but the logits
            no_logits = size(rest, **parquet_options(rest))[0]
            name = {"tiny": f"tiny target's, resampled (max abs {np.abs(x).max():.1f})",
                    "gaussian": "N(0, 2.5)"}[shape]
            variants = ["fp16 (zstd)", "bf16 (brotli 10)", "bf16, zstd"] + (["bf16 as uint16 bits, zstd"]
                                                                           if shape == "tiny" else [])
            for precision in variants:
                p = precision.split()[0].rstrip(",")
                table = label_table(rows, args.vocab, {"logits_precision": p})
                opts = parquet_options(table)
                if precision.endswith("zstd") and p == "bf16":  # the codec not chosen for bf16
                    opts = {**opts, "compression": "zstd", "compression_level": None}
                if "bits" in precision:  # the encoding not chosen: the raw 16-bit patterns, a uint16 list
                    bits = (round_logits(x, "bf16").view(np.uint32) >> 16).astype(np.uint16).reshape(-1)
                    i = table.schema.get_field_index("logits")
                    table = table.set_column(i, pa.field("logits", pa.list_(pa.uint16(), args.vocab)),
                                             pa.FixedSizeListArray.from_arrays(pa.array(bits), args.vocab))
                nbytes, write_ms, read_ms = size(table, **opts)
                err = np.abs(round_logits(x, p) - x).max()
                logit_bytes = (nbytes - no_logits) / args.rows
                lines.append(f"| {name} | {precision} | {nbytes / args.rows:,.0f} | {logit_bytes:,.0f} "
                             f"({logit_bytes / args.vocab:.3f}) | {write_ms:.0f} | {read_ms:.0f} | {err:.4f} |")
            lines.append(f"| {name} | (every column but logits) | {no_logits / args.rows:,.0f} | | | | |")
    print("\n".join(lines))
    if args.write:
        out = ROOT / "benchmarks" / "results" / "label-wide-vocab.md"
        out.write_text(RESULTS_HEAD + "\n".join(lines) + "\n" + RESULTS_TAIL.format(
            command=f"python benchmarks/label_wide_vocab.py precision --rows {args.rows} --write"))
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


RESULTS_HEAD = """# A label row at V = 151,936 (Qwen3's vocabulary): fp16 vs bf16 logits

`label.logits_precision` (pipeline/runtime/config.py) rounds the stored prefill logits to fp16 (the default) or
bf16; both are stored as float32 (pipeline/data/schemas.py, "Logits precision" in the label card), written by the
label stage's own writer (pipeline/labelling/shard.py: zstd, and brotli quality 10 for bf16 logits). The goal: at
most 200 KB (200,000 bytes) per row.

"""

RESULTS_TAIL = """
**bf16 meets the 200 KB goal on a real LM's logits, at a write cost**: ~197 KB a row against fp16's ~268 KB (-26 %),
1.25 bytes per logit. That is brotli's doing, not bf16's alone: with zstd, bf16 rows are ~209 KB. Once
byte-stream-split, each float32 is four byte streams: two all zero (free), the byte of 7 mantissa bits and the
exponent's low bit (noise, ~7.94 bits of entropy), and the sign-and-exponent byte (~2.04 bits of entropy on the tiny
target's values). zstd codes literals with Huffman codes, ~2.6 bits on that stream; brotli at quality >= 10 gets to
~2.0, its entropy. Quality 9 and below gain nothing (1.334 bytes per logit at 9). The price is the writer's CPU: a
few hundred ms per row at V = 151,936 on this machine (the write column), against a few ms for zstd; reads stay as
fast. On a GPU node that is CPU time beside each row's decoding (seconds per row at 8B scale), and fp16, the
default, keeps zstd. On the zero-centred Gaussian (the sign a coin toss, a harder case than a real LM's logits),
bf16 stays above the goal, ~211 KB.

Reading it: bf16 keeps 8 significant bits against fp16's 11, so its rounding error is 8x fp16's (relative
<= 2^-8 = 0.39 %, i.e. <= 0.031 absolute below |x| = 16 and <= 0.0625 up to 32, far below the spread of a row); it
also keeps float32's range, where fp16 overflows beyond 65,504. The uint16 row shows why the column stays float32:
the raw bit patterns cost no fewer bytes (byte-stream-split turns the float32's two all-zero low bytes into two
constant streams that compress to almost nothing), and every reader would have to decode them. Timings were taken
with other work on the machine's 2 cores: read the ratios, not the milliseconds.

Measured on this project's 2-core CPU machine with:

    {command}
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["precision"]:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--rows", type=int, default=32)
        ap.add_argument("--vocab", type=int, default=151936)
        ap.add_argument("--write", action="store_true", help="write benchmarks/results/label-wide-vocab.md")
        return precision_main(ap.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logits-precision", default="fp16", choices=["fp16", "bf16"])
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
                f"prepare.shard_size={args.prompts}", "label.k=1", "label.mode=replay",
                f"label.logits_precision={args.logits_precision}"]
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
