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
    """The same rows without the trace columns, marked v2, as a set written before v3 holds them."""
    for name in (S0, S1):
        t = pq.read_table(labels / name)
        meta = dict(t.schema.metadata)
        meta[b"blockpilot.schema_version"] = json.dumps("2").encode()
        pq.write_table(t.drop_columns(TRACE).replace_schema_metadata(meta), labels / name)
        refresh_manifest(labels, name)
    assert validate(labels, capsys) == (0, [])
