"""How to store the label set's `logits` column: bytes per value and which readers read it, measured side by side.

    python benchmarks/logits_storage.py                 # 256 bundled label prompts through the tiny target
    python benchmarks/logits_storage.py --labels DIR    # the logits of an existing label set

Each candidate writes the same rows (zstd, byte-stream-split where the type allows it) and is read back with
pyarrow and DuckDB; values are compared with the float16 source. Label schema v2 stores float32 holding the
float16-rounded values: no information lost against v1, and every reader reads it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402


def prefill_logits(n: int) -> np.ndarray:
    import torch

    from pipeline.runtime.config import ModelConfig, load_config
    from pipeline.labelling.labels import logits_to_numpy
    from pipeline.decoding.models import load_models
    from pipeline.data.sources import build_prompts

    m = load_models(ModelConfig(device="cpu", dtype="float32"))
    cfg = load_config()
    rows, _, _ = build_prompts(cfg.prepare.sources, m.tokenizer, cfg.prepare.max_prompt_tokens, limit=n)
    out = []
    with torch.inference_mode():
        for r in rows:
            logits = m.target(torch.tensor(r["input_ids"])[None], logits_to_keep=1).logits[0, -1]
            out.append(logits_to_numpy(logits))
    return np.stack(out)


def bf16_round(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even, keep 8 mantissa bits
    return bits.view(np.float32)


CANDIDATES = {
    "float16 (schema v1)": (lambda x: x.astype(np.float16), pa.float16(), True),
    "float32 holding the float16 values (schema v2)": (lambda x: x.astype(np.float16).astype(np.float32),
                                                       pa.float32(), True),
    "float32 rounded to bf16 precision": (lambda x: bf16_round(x), pa.float32(), True),
    "float32 holding the float16 values, no byte-stream-split": (
        lambda x: x.astype(np.float16).astype(np.float32), pa.float32(), False),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", help="a label folder to take the logits from")
    ap.add_argument("--prompts", type=int, default=256)
    args = ap.parse_args(argv)
    if args.labels:
        t = pa.concat_tables([pq.read_table(p, columns=["logits"]) for p in sorted(Path(args.labels)
                                                                                   .glob("part-*.parquet"))])
        x = np.stack(t.column("logits").to_numpy(zero_copy_only=False)).astype(np.float32)
    else:
        x = prefill_logits(args.prompts)
    n, v = x.shape
    print(f"{n} rows x V={v} logits; zstd; one row group")
    print(f"{'storage':<58} {'B/value':>8} {'max |err| vs fp16':>18}  duckdb")
    src16 = x.astype(np.float16).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        for name, (convert, typ, bss) in CANDIDATES.items():
            vals = convert(x)
            col = pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1), type=typ), v)
            path = Path(d) / "t.parquet"
            # As the label stage writes it: no dictionary (it would pre-empt byte-stream-split on small data).
            pq.write_table(pa.table({"logits": col}), path, compression="zstd", use_dictionary=False,
                           use_byte_stream_split=["logits.list.element"] if bss else False)
            size = path.stat().st_size
            back = np.stack(pq.read_table(path).column("logits").to_numpy(zero_copy_only=False)).astype(np.float32)
            err = float(np.abs(back - src16).max())
            try:
                import duckdb

                got = duckdb.sql(f"SELECT logits FROM read_parquet('{path}')").fetchall()
                duck = "reads" if len(got) == n and np.allclose(np.array(got[0][0], dtype=np.float32), back[0]) \
                    else "WRONG VALUES"
            except Exception as e:  # noqa: BLE001 - the finding is which reader fails, and how
                duck = f"fails: {str(e).splitlines()[0][:70]}"
            print(f"{name:<58} {size / (n * v):>8.3f} {err:>18.4g}  {duck}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
