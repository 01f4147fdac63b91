"""label.logits_precision (issue #26, item 3): a bf16 label set, written by the real label stage (prepare + label on
the bundled tiny pair, the driver's in-process executor, no Ray), holds exactly the bf16 rounding of the target's
float32 prefill logits, says so in its metadata and card, and is read back by train's reader and by validate; the
fp16 path (the default) is unchanged; validate refuses a set whose values are not at the precision its metadata
names. The rounding itself is checked against torch's own casts.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data.schemas import LOGITS_PRECISION_DOCS, at_precision, labels_schema, round_logits
from pipeline.data.validate import validate_dataset
from pipeline.io.shards import MANIFEST, decode_metadata, file_sha256, list_shards
from pipeline.runtime.config import LOGITS_PRECISIONS, ConfigError, _choices, load_config
from conftest import ONE_SOURCE

COMMON = ["progress=false", "decode.max_new_tokens=16", "prepare.shard_size=4", "prepare.limit=8", "label.k=2",
          "label.batch_size=1", "profile.steps=2", "profile.min_repeats=1", "profile.max_repeats=1",
          "profile.context_lengths=[16]", "profile.concurrency=[1]", "evaluate.concurrency=[1]", *ONE_SOURCE]
TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16}


def torch_rounding(x: np.ndarray, precision: str) -> np.ndarray:
    """The reference: torch's own cast to the 16-bit type and back (round to nearest even)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(TORCH[precision]).float().numpy()


# ---- the rounding ------------------------------------------------------------------------------------------------

def hard_values() -> np.ndarray:
    """Ordinary logits, exact ties at both precisions' halfway points, subnormals, range edges, inf and NaN."""
    rng = np.random.default_rng(0)
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(1 + 2.0 ** -8)],
                    dtype=np.float32)  # halfway between two bf16 (fp16) values: ties go to the even one
    edges = np.array([0.0, -0.0, 1e-40, -1e-42, 6e-8, 65504.0, 65520.0, 7e4, 3.3e38, 3.4e38, np.inf, -np.inf],
                     dtype=np.float32)
    return np.concatenate([rng.normal(0, 3, 20000).astype(np.float32), ties, edges])


@pytest.mark.parametrize("precision", LOGITS_PRECISIONS)
def test_round_logits_is_torchs_cast(precision):
    x = hard_values()
    with np.errstate(over="ignore"):
        ours, ref = round_logits(x, precision), torch_rounding(x, precision)
    assert ours.dtype == np.float32
    assert np.array_equal(ours, ref)
    assert np.isnan(round_logits(np.array([np.nan], np.float32), precision)).all()
    assert at_precision(ours, precision).all() and np.array_equal(round_logits(ours, precision), ours)  # idempotent


def test_fp16_values_are_mostly_not_bf16_values():
    """What validate's precision check can tell: fp16 keeps 3 more mantissa bits, so fp16-rounded logits claimed to
    be bf16 fail it. (bf16 values within fp16's range are fp16 values too, so the converse holds only past it.)"""
    x = np.random.default_rng(1).normal(0, 3, 4096).astype(np.float32)
    assert at_precision(round_logits(x, "fp16"), "bf16").mean() < 0.5
    assert at_precision(round_logits(x, "bf16"), "fp16").all()
    assert not at_precision(np.float32([1e5]), "fp16").all()  # beyond fp16's range: a bf16 value only
    with pytest.raises(ValueError, match="fp8"):
        round_logits(x, "fp8")


def test_the_config_key_and_its_documented_choices():
    assert load_config().label.logits_precision == "fp16"
    assert load_config(["label.logits_precision=bf16"]).label.logits_precision == "bf16"
    with pytest.raises(ConfigError, match="label.logits_precision"):
        load_config(["label.logits_precision=fp8"])
    assert _choices()["label.logits_precision"] is LOGITS_PRECISIONS
    assert tuple(LOGITS_PRECISION_DOCS) == LOGITS_PRECISIONS  # every choice documented in the card


# ---- a real label set at each precision --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def label_sets(tmp_path_factory):
    """prepare once, then label the same prompts at fp16 and at bf16 (batch 1: each row's logits come from the
    engine's own prefill of that prompt alone, which the tests recompute)."""
    from pipeline.executor.driver import run_stage
    from pipeline.executor.local import LocalExecutor
    from stages.label import LabelStage
    from stages.prepare import PrepareStage

    root = tmp_path_factory.mktemp("precision")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread here and in the recomputation: the same float32 sums, bit for bit
    try:
        run_stage(PrepareStage(load_config([f"output_dir={root / 'fp16'}", *COMMON])), LocalExecutor())
        shutil.copytree(root / "fp16" / "prompts", root / "bf16" / "prompts")
        for p in LOGITS_PRECISIONS:
            cfg = load_config([f"output_dir={root / p}", *COMMON, f"label.logits_precision={p}"])
            run_stage(LabelStage(cfg), LocalExecutor())
    finally:
        torch.set_num_threads(threads)
    return root


def stored(labels: Path):
    t = pq.read_table(labels / "part-00000.parquet")
    return t, decode_metadata(t.schema.metadata)


@pytest.fixture(scope="module")
def float32_logits(label_sets):
    """prompt_id -> the target's float32 last-position prefill logits, from the engine label uses."""
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models

    cfg = load_config([f"output_dir={label_sets / 'fp16'}", *COMMON])
    models = load_models(cfg.model)
    engine = Engine(models.target, models.draft, models.stop_token_ids)
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for shard in list_shards(label_sets / "fp16" / "prompts"):
                for r in pq.read_table(shard, columns=["prompt_id", "input_ids"]).to_pylist():
                    state = engine.prefill(torch.tensor(r["input_ids"], dtype=torch.long)[None])
                    out[r["prompt_id"]] = state.logits.float().cpu().numpy()
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("precision", LOGITS_PRECISIONS)
def test_the_rows_hold_the_rounding_of_the_float32_logits(label_sets, float32_logits, precision):
    t, meta = stored(label_sets / precision / "labels")
    assert meta["logits_precision"] == precision
    V = meta["vocab_size"]
    assert t.schema.remove_metadata().equals(labels_schema(V))  # float32 column at both precisions
    got = np.stack(t.column("logits").to_numpy(zero_copy_only=False)).astype(np.float32)
    ref = np.stack([float32_logits[pid] for pid in t.column("prompt_id").to_pylist()])
    assert np.array_equal(got, torch_rounding(ref, precision))
    if precision == "fp16":  # unchanged: what the writer stored before the option (float16 of the float32)
        assert np.array_equal(got, ref.astype(np.float16).astype(np.float32))
    else:
        assert not np.array_equal(got, ref.astype(np.float16).astype(np.float32))
        assert np.abs(got - ref).max() <= np.abs(ref).max() * 2.0 ** -8


def test_train_reads_both_precisions_as_stored(label_sets):
    from pipeline.training.data import read_logits, to_arrays

    for p in LOGITS_PRECISIONS:
        labels = label_sets / p / "labels"
        shards = list_shards(labels)
        tables = [pq.read_table(s) for s in shards]
        want = np.concatenate([np.stack(t.column("logits").to_numpy(zero_copy_only=False)) for t in tables])
        assert np.array_equal(read_logits(shards), want)
        t = tables[0]
        batch = {"logits": list(t.column("logits").to_numpy(zero_copy_only=False)),
                 "tau": [np.array(v) for v in t.column("tau").to_pylist()],
                 "label_block_size": np.array(t.column("label_block_size").to_pylist())}
        x, _, _ = to_arrays(batch, t.column("candidates")[0].as_py())
        assert x.dtype == np.float32 and np.array_equal(x, want[:t.num_rows])
        assert at_precision(x, p).all()


def test_validate_passes_both_and_the_card_documents_the_key(label_sets):
    for p in LOGITS_PRECISIONS:
        labels = label_sets / p / "labels"
        report = validate_dataset(str(labels))
        assert report.ok, report.render()
        card = (labels / "README.md").read_text()
        assert "`blockpilot.logits_precision`" in card and "## Logits precision" in card


def test_the_precision_is_in_the_fingerprint_only_when_not_the_default(label_sets):
    """A folder labelled before the option (fp16) keeps its fingerprint, so it resumes; bf16 shards never mix into
    an fp16 folder."""
    from pipeline.executor.driver import run_stage
    from pipeline.executor.local import LocalExecutor
    from stages.label import LabelStage

    fp = {p: json.loads((label_sets / p / "labels" / MANIFEST).read_text())["fingerprint"] for p in LOGITS_PRECISIONS}
    assert "logits_precision" not in fp["fp16"] and fp["bf16"]["logits_precision"] == "bf16"
    cfg = load_config([f"output_dir={label_sets / 'fp16'}", *COMMON, "label.logits_precision=bf16"])
    with pytest.raises(FileExistsError, match="logits_precision"):
        run_stage(LabelStage(cfg), LocalExecutor())


def set_precision_key(folder: Path, name: str, precision) -> None:
    """Rewrite one shard with ``precision`` as its logits_precision metadata (None: no key, as a shard written
    before it), values untouched, and the manifest's entry refreshed as the driver would."""
    p = folder / name
    t = pq.read_table(p)
    meta = {k: v for k, v in t.schema.metadata.items() if k != b"blockpilot.logits_precision"}
    if precision is not None:
        meta[b"blockpilot.logits_precision"] = json.dumps(precision).encode()
    pq.write_table(t.replace_schema_metadata(meta), p)
    m = json.loads((folder / MANIFEST).read_text())
    next(f for f in m["files"] if f["file"] == name).update(sha256=file_sha256(p), bytes=p.stat().st_size)
    (folder / MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def test_validate_refuses_values_not_at_the_named_precision(label_sets, tmp_path):
    folder = Path(shutil.copytree(label_sets / "fp16" / "labels", tmp_path / "labels"))
    set_precision_key(folder, "part-00001.parquet", "bf16")  # fp16 values claimed to be bf16
    problems = validate_dataset(str(folder)).problems
    assert len(problems) == 1 and problems[0].startswith("part-00001.parquet: ") and \
        "not at the precision bf16" in problems[0], problems
    set_precision_key(folder, "part-00001.parquet", "fp8")
    problems = validate_dataset(str(folder)).problems
    assert len(problems) == 1 and "logits_precision 'fp8'" in problems[0], problems


def test_a_set_written_before_the_key_validates_as_fp16(label_sets, tmp_path):
    folder = Path(shutil.copytree(label_sets / "fp16" / "labels", tmp_path / "labels"))
    for shard in list_shards(folder):
        set_precision_key(folder, shard.name, None)
    assert "logits_precision" not in decode_metadata(pq.read_schema(folder / "part-00000.parquet").metadata)
    report = validate_dataset(str(folder))
    assert report.ok, report.render()


def test_bf16_logits_are_brotli_coded_and_every_reader_decodes_them(label_sets):
    """The codec that takes a V = 151,936 row under 200 KB (pipeline.labelling.shard.parquet_options): brotli on the
    bf16 logits column alone, zstd everywhere else and at fp16; polars, DuckDB and pandas read the brotli column
    back as pyarrow does."""
    import duckdb
    import pandas as pd
    import polars as pl

    for p in LOGITS_PRECISIONS:
        path = label_sets / p / "labels" / "part-00000.parquet"
        rg = pq.ParquetFile(path).metadata.row_group(0)
        codecs = {rg.column(i).path_in_schema: rg.column(i).compression for i in range(rg.num_columns)}
        want = {c: "ZSTD" for c in codecs} | ({"logits.list.element": "BROTLI"} if p == "bf16" else {})
        assert codecs == want
        ref = np.stack(pq.read_table(path, columns=["logits"]).column("logits").to_numpy(zero_copy_only=False))
        got = {"polars": np.stack(pl.read_parquet(path, columns=["logits"])["logits"].to_numpy()),
               "duckdb": np.array(duckdb.sql(f"SELECT logits FROM '{path}'").fetchnumpy()["logits"].tolist()),
               "pandas": np.stack(pd.read_parquet(path, columns=["logits"])["logits"].to_numpy())}
        for reader, x in got.items():
            assert np.array_equal(x.astype(np.float32), ref), (p, reader)
