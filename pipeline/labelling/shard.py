"""A label shard (pipeline.data.schemas.labels_schema): its table from the labelled prompts, and how it is written."""

from __future__ import annotations

from typing import Any, Dict, Iterable

import numpy as np
import pyarrow as pa

from pipeline.data.schemas import labels_schema, round_logits
from pipeline.io.shards import decode_metadata, encode_metadata


def label_row(rec: Dict[str, Any], out: Any, logits: np.ndarray, worker: str) -> Dict[str, Any]:
    """The row of one prompt (``rec``: its prompt shard row) from its labelling (``out``: a
    pipeline.labelling.labels result) and its prefill logits as numpy."""
    return {"prompt_id": rec["prompt_id"], "source": rec["source"], "prompt_tokens": rec["prompt_tokens"],
            "logits": logits, "candidates": out.candidates, "tau": out.tau, "steps": out.steps,
            "new_tokens": out.new_tokens, "decode_seconds": out.decode_seconds,
            "label_block_size": out.label_block_size, "label_index": out.label_index,
            "label_speedup_block_size": out.candidates[out.label_speedup_index],
            "prefill_seconds": out.prefill_seconds, "worker": worker, **trace_columns(out),
            "tau_expected": getattr(out, "tau_expected", None) or out.tau}


def trace_columns(out: Any) -> Dict[str, Any]:
    """The ``trace_*`` columns of a labelling result (all null without a trace)."""
    t = getattr(out, "trace", None)
    if t is None:
        return {"trace_block_size": None, "trace_stopped": None, "trace_match": None, "trace_confidence": None,
                "trace_seconds": None}
    return {"trace_block_size": t.block_size, "trace_stopped": t.stopped, "trace_match": t.match,
            "trace_confidence": t.confidence, "trace_seconds": out.trace_seconds}


def label_table(rows: Iterable[Dict[str, Any]], vocab_size: int, metadata: Dict[str, Any]) -> pa.Table:
    """The shard's table from :func:`label_row` rows, with ``metadata`` (``blockpilot.*`` keys). The logits are
    rounded to ``metadata["logits_precision"]`` (fp16 where absent) here, so the values always match the key."""
    schema = labels_schema(vocab_size)
    precision = metadata.get("logits_precision", "fp16")
    columns: Dict[str, list] = {name: [] for name in schema.names}
    for row in rows:
        for name in schema.names:
            columns[name].append(row[name])
    arrays = []
    for f in schema:
        if f.name == "logits":
            # fp16- or bf16-rounded values stored as float32: every reader reads float32 with byte-stream-split, and
            # the low mantissa bytes, all zero, cost almost nothing once split. Rounding values that already are at
            # the precision (logits_to_numpy's) changes nothing.
            flat = round_logits(np.concatenate(columns["logits"]), precision) if columns["logits"] else \
                np.zeros(0, dtype=np.float32)
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float32()), vocab_size))
        else:
            arrays.append(pa.array(columns[f.name], type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema.with_metadata(encode_metadata(metadata)))


def parquet_options(table: pa.Table) -> Dict[str, Any]:
    """Byte-stream-split logits and trace confidences (~10 % fewer trace bytes than plain zstd: the probabilities'
    exponent bytes compress apart), dictionary-coded strings, and row groups of ~128 MB of logits, so that a
    reader's memory stays bounded at a full vocabulary.

    bf16 logits are brotli-coded (quality 10) where everything else is zstd: once split, their sign-and-exponent
    stream holds ~2 bits of entropy a value, which zstd's Huffman literals code in ~2.6 and brotli's in ~2.0. That
    is what takes a row at V = 151,936 under 200 KB; it costs write time, not read time
    (benchmarks/results/label-wide-vocab.md). Every Parquet reader decodes brotli."""
    vocab = table.schema.field("logits").type.list_size
    split = ["logits.list.element"] + (["trace_confidence.list.element.list.element"]
                                       if "trace_confidence" in table.schema.names else [])
    compression: Any = "zstd"
    level: Any = None
    if decode_metadata(table.schema.metadata).get("logits_precision") == "bf16":
        compression = {path: "zstd" for path in leaf_paths(table.schema)} | {"logits.list.element": "brotli"}
        level = {path: (10 if codec == "brotli" else pa.Codec.default_compression_level("zstd"))
                 for path, codec in compression.items()}
    return dict(compression=compression, compression_level=level, use_byte_stream_split=split,
                use_dictionary=["source", "worker"],
                row_group_size=max(1, min(max(1, table.num_rows), (128 << 20) // (4 * vocab))))


def leaf_paths(schema: pa.Schema) -> list:
    """Parquet's dotted leaf-column paths (``logits.list.element``): what per-column write options are keyed on."""
    def walk(name: str, t: pa.DataType):
        if pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t):
            return walk(f"{name}.list.element", t.value_type)
        if pa.types.is_struct(t):
            return [p for f in t for p in walk(f"{name}.{f.name}", f.type)]
        return [name]
    return [p for f in schema for p in walk(f.name, f.type)]
