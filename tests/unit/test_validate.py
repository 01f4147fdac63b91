"""``blockpilot validate DIR`` catches what the README promises, one defect at a time.

A REAL label set (tests/conftest.py's ``real_labels``: prepare + label on the bundled tiny pair, 2 shards of 4
prompts, the driver's in-process executor, no Ray) is built once per session; every test copies it, damages the copy in exactly one way (keeping each
rewritten shard's schema and schema metadata, and refreshing the manifest where the defect is about content only),
runs the real CLI and checks: exit status 1, exactly one problem, and that problem names the file and the defect.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.cli import main
from pipeline.io.shards import MANIFEST, file_sha256

S0, S1 = "part-00000.parquet", "part-00001.parquet"


@pytest.fixture
def labels(real_labels, tmp_path):
    """A fresh copy of the real label set."""
    return Path(shutil.copytree(real_labels, tmp_path / "labels"))


# ---- helpers -----------------------------------------------------------------------------------------------------

def validate(folder: Path, capsys):
    """Run the real CLI; returns (exit status, the PROBLEM lines it printed)."""
    capsys.readouterr()
    rc = main(["validate", str(folder)])
    out = capsys.readouterr().out
    return rc, [line.split("PROBLEM: ", 1)[1] for line in out.splitlines() if "PROBLEM: " in line]


def only_problem(folder: Path, capsys) -> str:
    rc, problems = validate(folder, capsys)
    assert rc == 1, problems
    assert len(problems) == 1, problems  # exactly one defect, reported once
    return problems[0]


def load_manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def save_manifest(folder: Path, manifest: dict) -> None:
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def entry(manifest: dict, name: str) -> dict:
    return next(f for f in manifest["files"] if f["file"] == name)


def refresh_manifest(folder: Path, name: str) -> None:
    """Make the manifest agree with a rewritten shard (sha256, bytes, rows, total rows), as the driver would."""
    m = load_manifest(folder)
    p = folder / name
    entry(m, name).update(sha256=file_sha256(p), bytes=p.stat().st_size, rows=pq.read_metadata(p).num_rows)
    m["rows"] = sum(f["rows"] for f in m["files"])
    save_manifest(folder, m)


def rewrite(folder: Path, name: str, change, refresh: bool = True) -> pa.Table:
    """Rewrite a shard as ``change(table)``, keeping its schema and schema metadata."""
    p = folder / name
    table = pq.read_table(p)
    new = change(table)
    assert new.schema.equals(table.schema, check_metadata=True)
    pq.write_table(new, p)
    if refresh:
        refresh_manifest(folder, name)
    return table


def set_column(table: pa.Table, name: str, values) -> pa.Table:
    i = table.schema.get_field_index(name)
    f = table.schema.field(i)
    return table.set_column(i, f, pa.array(values, type=f.type))


def set_row(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = value
    return set_column(table, name, values)


def first_id(folder: Path, name: str, row: int = 0) -> str:
    return pq.read_table(folder / name, columns=["prompt_id"]).column("prompt_id")[row].as_py()


# ---- the undamaged copy ------------------------------------------------------------------------------------------

def test_real_label_set_passes(labels, capsys):
    rc, problems = validate(labels, capsys)
    assert (rc, problems) == (0, [])


def test_helpers_alone_change_nothing_validate_checks(labels, capsys):
    """A rewrite with no change plus a refreshed manifest is still valid: the damage below is the only defect."""
    rewrite(labels, S0, lambda t: t)
    assert validate(labels, capsys) == (0, [])


# ---- manifest: files, rows, sha256 -------------------------------------------------------------------------------

def test_sha256_mismatch_alone(labels, capsys):
    before = (labels / S0).read_bytes()
    rewrite(labels, S0, lambda t: t, refresh=False)  # same rows, same schema and metadata, other compression
    assert (labels / S0).read_bytes() != before
    assert pq.read_metadata(labels / S0).num_rows == entry(load_manifest(labels), S0)["rows"]
    msg = only_problem(labels, capsys)
    assert S0 in msg and "sha256" in msg


def test_row_count_disagrees_with_manifest(labels, capsys):
    m = load_manifest(labels)
    entry(m, S1)["rows"] = 5
    save_manifest(labels, m)
    msg = only_problem(labels, capsys)
    assert S1 in msg and "4 rows" in msg and "manifest says 5" in msg


def test_missing_shard(labels, capsys):
    (labels / S1).unlink()
    msg = only_problem(labels, capsys)
    assert S1 in msg and "missing on disk" in msg


def test_extra_shard_not_in_manifest(labels, capsys):
    extra = "part-00002.parquet"
    shutil.copy(labels / S1, labels / extra)  # a real shard, with ids of its own so only its presence is wrong
    rewrite(labels, extra, lambda t: set_column(t, "prompt_id", [f"extra{i}" for i in range(t.num_rows)]),
            refresh=False)
    msg = only_problem(labels, capsys)
    assert extra in msg and "not in the manifest" in msg


# ---- accounting: rows + rejects == input_rows ---------------------------------------------------------------------

def test_rows_plus_rejects_short_of_input_rows(labels, capsys):
    """A row lost without a reject: the manifest matches the shard (rows 3, sha256), input_rows says 4."""
    rewrite(labels, S0, lambda t: t.slice(0, 3))
    m = load_manifest(labels)
    assert (entry(m, S0)["rows"], entry(m, S0)["rejects"], entry(m, S0)["input_rows"]) == (3, 0, 4)
    msg = only_problem(labels, capsys)
    assert S0 in msg and "input_rows" in msg and "3 rows + 0 rejects" in msg


def test_reject_file_and_rows_over_input_rows(labels, capsys):
    """A reject recorded for a prompt whose row is still there: 4 rows + 1 reject for 4 inputs."""
    rejects = labels / "_rejects" / "part-00001.jsonl"
    rejects.write_text(json.dumps({"prompt_id": first_id(labels, S1), "reason": "decode_error", "detail": "x"}) + "\n")
    m = load_manifest(labels)
    entry(m, S1)["rejects"] = 1  # the manifest agrees with the reject file: only the accounting is wrong
    save_manifest(labels, m)
    msg = only_problem(labels, capsys)
    assert S1 in msg and "4 rows + 1 rejects" in msg and "input_rows" in msg


def test_manifest_without_input_rows_is_not_checked(labels, capsys):
    """A manifest written before input_rows existed: valid, the check is skipped and the summary says so."""
    m = load_manifest(labels)
    for f in m["files"]:
        del f["input_rows"]
    save_manifest(labels, m)
    rewrite(labels, S0, lambda t: t.slice(0, 3))  # would fail the check if it were made
    capsys.readouterr()
    assert main(["validate", str(labels)]) == 0
    assert "input_rows_check: skipped" in capsys.readouterr().out


def test_manifest_with_input_rows_on_some_entries_only(labels, capsys):
    m = load_manifest(labels)
    del entry(m, S1)["input_rows"]
    save_manifest(labels, m)
    msg = only_problem(labels, capsys)
    assert S1 in msg and "no input_rows" in msg


# ---- content: ids, labels, tau, logits ----------------------------------------------------------------------------

def test_duplicate_prompt_ids_across_shards(labels, capsys):
    dup = first_id(labels, S0)
    rewrite(labels, S1, lambda t: set_row(t, "prompt_id", 2, dup))
    msg = only_problem(labels, capsys)
    assert S0 in msg and S1 in msg and "duplicate prompt_id" in msg and dup in msg


def test_label_outside_candidates(labels, capsys):
    pid = first_id(labels, S1, 1)
    rewrite(labels, S1, lambda t: set_row(t, "label_block_size", 1, max(t.column("candidates")[1].as_py()) + 1))
    msg = only_problem(labels, capsys)
    assert S1 in msg and pid in msg and "label 11" in msg and "not within candidates" in msg


def test_tau_below_one(labels, capsys):
    pid = first_id(labels, S0, 2)
    rewrite(labels, S0, lambda t: set_row(t, "tau", 2, [0.5] + t.column("tau")[2].as_py()[1:]))
    msg = only_problem(labels, capsys)
    assert S0 in msg and pid in msg and "tau < 1" in msg and "b=[6]" in msg


def test_tau_expected_below_one_or_short(labels, capsys):
    pid = first_id(labels, S0, 1)
    rewrite(labels, S0, lambda t: set_row(t, "tau_expected", 1, [0.5] + t.column("tau_expected")[1].as_py()[1:]))
    msg = only_problem(labels, capsys)
    assert S0 in msg and pid in msg and "tau_expected" in msg and ">= 1 per candidate" in msg
    rewrite(labels, S0, lambda t: set_row(t, "tau_expected", 1, t.column("tau")[1].as_py()[:-1]))
    msg = only_problem(labels, capsys)
    assert pid in msg and "tau_expected" in msg


def test_tau_nan(labels, capsys):
    pid = first_id(labels, S1, 3)
    rewrite(labels, S1, lambda t: set_row(t, "tau", 3, t.column("tau")[3].as_py()[:-1] + [math.nan]))
    msg = only_problem(labels, capsys)
    assert S1 in msg and pid in msg and "tau not finite" in msg and "b=[10]" in msg


def test_nan_logits(labels, capsys):
    pid = first_id(labels, S0, 1)

    def poison(t):
        col = t.column("logits").combine_chunks()
        vocab = col.type.list_size
        flat = col.flatten().to_numpy(zero_copy_only=False).copy()
        flat[1 * vocab + 7] = np.nan  # one value of row 1
        i = t.schema.get_field_index("logits")
        arr = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=col.type.value_type), vocab)
        return t.set_column(i, t.schema.field(i), arr)

    rewrite(labels, S0, poison)
    msg = only_problem(labels, capsys)
    assert S0 in msg and pid in msg and "non-finite logits" in msg and "1 row(s)" in msg


# ---- the per-step trace (schema v3) and older versions -----------------------------------------------------------

TRACE = ["trace_block_size", "trace_stopped", "trace_match", "trace_confidence", "trace_seconds"]


def test_trace_shorter_than_the_generation(labels, capsys):
    pid = first_id(labels, S1, 1)
    rewrite(labels, S1, lambda t: set_row(t, "trace_match", 1, t.column("trace_match")[1].as_py()[:-1]))
    msg = only_problem(labels, capsys)
    assert S1 in msg and pid in msg and "trace" in msg and "confidence lists" in msg


def test_trace_confidence_outside_zero_one(labels, capsys):
    pid = first_id(labels, S0, 3)

    def damage(t):
        conf = t.column("trace_confidence")[3].as_py()
        conf[0][0] = 1.5
        return set_row(t, "trace_confidence", 3, conf)

    rewrite(labels, S0, damage)
    msg = only_problem(labels, capsys)
    assert S0 in msg and pid in msg and "outside [0, 1]" in msg


def test_trace_null_in_part_only_and_a_row_without_trace(labels, capsys):
    def no_trace(t):  # a row without a trace (exhaustive mode at T > 0): every trace column null
        for name in TRACE:
            t = set_row(t, name, 0, None)
        return t

    rewrite(labels, S0, no_trace)
    assert validate(labels, capsys) == (0, [])
    pid = first_id(labels, S0, 2)
    rewrite(labels, S0, lambda t: set_row(t, "trace_stopped", 2, None))
    msg = only_problem(labels, capsys)
    assert S0 in msg and pid in msg and "null only in part" in msg


def test_a_schema_v2_set_still_validates(labels, capsys):
    """The same rows without the trace columns (and v4's tau_expected), marked v2, as a set written before v3 holds
    them."""
    for name in (S0, S1):
        t = pq.read_table(labels / name)
        meta = dict(t.schema.metadata)
        meta[b"blockpilot.schema_version"] = json.dumps("2").encode()
        pq.write_table(t.drop_columns(TRACE + ["tau_expected"]).replace_schema_metadata(meta), labels / name)
        refresh_manifest(labels, name)
    assert validate(labels, capsys) == (0, [])


# ---- the folder's own files: manifest, reject files (issue #25, item 8) --------------------------------------------

def test_manifest_missing(labels, capsys):
    (labels / MANIFEST).unlink()
    msg = only_problem(labels, capsys)
    assert msg == "manifest.json is missing (the label stage has not finished)"


@pytest.mark.parametrize("text, defect", [
    ("{not json", "is not valid JSON"),
    (json.dumps({"rows": 8}), "no valid 'files' list"),
    (json.dumps({"rows": 8, "files": [{"rows": 4}]}), "no valid 'files' list"),  # an entry without a file name
])
def test_manifest_invalid(labels, capsys, text, defect):
    (labels / MANIFEST).write_text(text)
    msg = only_problem(labels, capsys)
    assert msg.startswith("manifest.json") and defect in msg, msg


def test_reject_file_missing(labels, capsys):
    (labels / "_rejects" / "part-00001.jsonl").unlink()
    msg = only_problem(labels, capsys)
    assert msg.startswith(S1) and "reject file _rejects/part-00001.jsonl is missing" in msg


def test_reject_file_invalid(labels, capsys):
    (labels / "_rejects" / "part-00000.jsonl").write_text('{"prompt_id": "x", "reason": \n')
    msg = only_problem(labels, capsys)
    assert msg.startswith(S0) and "reject file _rejects/part-00000.jsonl is not valid JSON lines" in msg


def test_folder_reject_log_invalid(labels, capsys):
    (labels / "rejects.jsonl").write_text("not json\n")
    msg = only_problem(labels, capsys)
    assert msg.startswith("rejects.jsonl is not valid JSON lines"), msg


def test_reject_count_differs_from_the_manifest(labels, capsys):
    """One row rejected (3 rows + 1 reject = its 4 inputs, so the accounting holds), the manifest's count says 0."""
    dropped = first_id(labels, S1, 3)
    rewrite(labels, S1, lambda t: t.slice(0, 3))
    (labels / "_rejects" / "part-00001.jsonl").write_text(
        json.dumps({"prompt_id": dropped, "reason": "decode_error", "detail": "x"}) + "\n")
    assert entry(load_manifest(labels), S1)["rejects"] == 0
    msg = only_problem(labels, capsys)
    assert msg == f"{S1}: reject file _rejects/part-00001.jsonl holds 1 reject(s), manifest says 0"


# ---- the schema ----------------------------------------------------------------------------------------------------

def _with_metadata(key: str, value):
    def change(t):
        meta = dict(t.schema.metadata)
        meta[f"blockpilot.{key}".encode()] = json.dumps(value).encode()
        return t.replace_schema_metadata(meta)
    return change


def test_wrong_schema_version(labels, capsys):
    p = labels / S0
    pq.write_table(_with_metadata("schema_version", "9")(pq.read_table(p)), p)
    refresh_manifest(labels, S0)
    msg = only_problem(labels, capsys)
    assert msg == f"{S0}: schema_version '9', expected one of 1, 2, 3, 4"


def test_a_column_of_another_type_is_a_wrong_schema(labels, capsys):
    p = labels / S1
    t = pq.read_table(p)
    i = t.schema.get_field_index("label_index")
    t = t.set_column(i, pa.field("label_index", pa.int32()), t.column(i).cast(pa.int32()))  # int64 -> int32
    pq.write_table(t, p)
    refresh_manifest(labels, S1)
    msg = only_problem(labels, capsys)
    assert msg == f"{S1}: schema does not match label schema v4"


def test_an_extra_column_is_a_wrong_schema(labels, capsys):
    p = labels / S0
    t = pq.read_table(p)
    pq.write_table(t.append_column("extra", pa.array([1] * t.num_rows)), p)
    refresh_manifest(labels, S0)
    msg = only_problem(labels, capsys)
    assert msg == f"{S0}: schema does not match label schema v4"


# ---- the rows ------------------------------------------------------------------------------------------------------

def test_nulls_outside_the_trace_columns(labels, capsys):
    rewrite(labels, S1, lambda t: set_row(t, "label_speedup_block_size", 2, None))
    msg = only_problem(labels, capsys)
    assert msg == f"{S1}: null values in {{'label_speedup_block_size': 1}}"


def test_candidates_differ_from_the_metadata(labels, capsys):
    """One row's candidates reversed, its label index moved with them: only the candidates are wrong."""
    pid = first_id(labels, S0, 1)

    def reverse(t):
        cands = t.column("candidates")[1].as_py()
        li = t.column("label_index")[1].as_py()
        t = set_row(t, "candidates", 1, cands[::-1])
        return set_row(t, "label_index", 1, len(cands) - 1 - li)

    rewrite(labels, S0, reverse)
    msg = only_problem(labels, capsys)
    assert msg == f"{S0}: row {pid} candidates [10, 9, 8, 7, 6] differ from the metadata [6, 7, 8, 9, 10]"


def test_tau_length_differs_from_the_candidates(labels, capsys):
    pid = first_id(labels, S1, 0)
    rewrite(labels, S1, lambda t: set_row(t, "tau", 0, t.column("tau")[0].as_py()[:-1]))
    msg = only_problem(labels, capsys)
    assert msg == f"{S1}: row {pid} has 4 tau values for 5 candidates"


@pytest.mark.parametrize("shift", [1, 5])  # another candidate's index; past the end
def test_label_index_inconsistent_with_the_label(labels, capsys, shift):
    pid = first_id(labels, S0, 2)
    t0 = pq.read_table(labels / S0)
    lb, li = t0.column("label_block_size")[2].as_py(), t0.column("label_index")[2].as_py()
    bad = (li + shift) % 5 if shift < 5 else li + shift
    rewrite(labels, S0, lambda t: set_row(t, "label_index", 2, bad))
    msg = only_problem(labels, capsys)
    assert msg == f"{S0}: row {pid} label {lb} (index {bad}) not within candidates [6, 7, 8, 9, 10]"


def test_speed_label_outside_the_candidates(labels, capsys):
    pid = first_id(labels, S1, 2)
    rewrite(labels, S1, lambda t: set_row(t, "label_speedup_block_size", 2, 99))
    msg = only_problem(labels, capsys)
    assert msg == f"{S1}: row {pid} speedup label 99 not within candidates [6, 7, 8, 9, 10]"


# ---- a v1 label set: validate and train's readers read it -----------------------------------------------------------

def _as_v1(labels: Path) -> Path:
    """The real rows as schema v1 stored them: float16 logits, no trace columns, schema_version "1" (the schema
    built from pipeline.data.schemas, the rows cast to it)."""
    from pipeline.data.schemas import labels_schema

    for name in (S0, S1):
        t = pq.read_table(labels / name)
        meta = dict(t.schema.metadata)
        meta[b"blockpilot.schema_version"] = json.dumps("1").encode()
        vocab = json.loads(meta[b"blockpilot.vocab_size"])
        v1 = labels_schema(vocab, "1")
        assert v1.field("logits").type.value_type == pa.float16() and "trace_match" not in v1.names
        pq.write_table(t.select(v1.names).cast(v1).replace_schema_metadata(meta), labels / name)
        refresh_manifest(labels, name)
    return labels


def test_a_schema_v1_set_validates_and_trains_reader_reads_it(labels, capsys):
    from dataclasses import replace

    from pipeline.runtime.config import TrainConfig
    from pipeline.training.data import LABEL_COLUMN, read_logits, to_arrays
    from pipeline.training.problem import load_problem

    original = {n: pq.read_table(labels / n) for n in (S0, S1)}
    _as_v1(labels)
    assert pq.read_schema(labels / S0).field("logits").type.value_type == pa.float16()
    assert validate(labels, capsys) == (0, [])
    # A v1 shard marked as v3 is not: the version decides the schema it is checked against.
    for version in ("3", "1"):
        pq.write_table(_with_metadata("schema_version", version)(pq.read_table(labels / S1)), labels / S1)
        refresh_manifest(labels, S1)
        if version == "3":
            assert only_problem(labels, capsys) == f"{S1}: schema does not match label schema v3"
    assert validate(labels, capsys) == (0, [])

    # train's driver-side reader: the problem (candidates, splits, baselines) and the logits, as float32.
    problem = load_problem(replace(TrainConfig(), val_fraction=0.25), labels)
    assert problem.candidates == [6, 7, 8, 9, 10] and len(problem.splits.split) == 8
    tau = np.concatenate([np.array(original[n].column("tau").to_pylist(), dtype=np.float32) for n in (S0, S1)])
    assert np.array_equal(problem.splits.tau, tau)
    want = np.concatenate([np.stack(original[n].column("logits").to_numpy(zero_copy_only=False)) for n in (S0, S1)])
    got = read_logits(problem.shards)
    assert got.dtype == np.float32 and np.array_equal(got, want.astype(np.float16).astype(np.float32))
    # and the workers' batch conversion, on a batch of the v1 shard as read
    batch = pq.read_table(labels / S0, columns=["logits", "tau", LABEL_COLUMN]).to_pydict()
    batch = {k: [np.asarray(v) for v in vs] for k, vs in batch.items()}
    x, y, t = to_arrays(batch, problem.candidates, LABEL_COLUMN)
    assert x.dtype == np.float32 and np.array_equal(x, got[:4])
    assert y.tolist() == original[S0].column("label_index").to_pylist()
