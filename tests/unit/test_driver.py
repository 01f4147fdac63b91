"""The stage driver on its own: no Ray, no models (datatrove tests its executor with a trivial pipeline).

A toy stage squares integers: input shards of numbers -> output shards of squares; a negative number is a bad row
(rejected with its id), and chosen shards fail on purpose. Every test runs the real driver on real Parquet files.
"""

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.runtime.config import load_config
from pipeline.io.shards import decode_metadata
from pipeline.executor.card import LAYOUT_DOC
from pipeline.executor.driver import run_stage
from pipeline.executor.folder import mark_complete
from pipeline.executor.local import LocalExecutor
from pipeline.executor.manifest import MANIFEST_VERSION
from pipeline.executor.stage import Plan, ShardStage, tasks_from_shards
from pipeline.io.layout import INPUT_REJECTS, REJECTS_DIR
from pipeline.io.shards import list_shards, shard_name, write_parquet_atomic
from pipeline.io.storage import location, read_table

SCHEMA = pa.schema([("prompt_id", pa.string()), ("source", pa.string()), ("x", pa.int64())])
OUT_SCHEMA = pa.schema([("prompt_id", pa.string()), ("square", pa.int64())])


class Squares(ShardStage):
    name = "squares"
    unit = "numbers"
    schema_version = "7"

    def __init__(self, cfg, inputs: Path, folder: Path, power: int = 2, fail=(), fail_times: int = 10**6,
                 input_rejects=()):
        super().__init__(cfg, folder)
        self.inputs, self.power = inputs, power
        self.fail, self.fail_times = set(fail), fail_times  # shard names that raise, how many times each
        self.input_rejects = list(input_rejects)
        self.calls = []  # (shard name) per process_shard call, in order
        self.setups = 0

    def requires(self):
        return [(self.inputs, "make the inputs")]

    def fingerprint(self):
        return {"power": self.power, "schema_version": self.schema_version}

    def plan(self):
        return Plan(tasks_from_shards(self.inputs), self.input_rejects)

    def setup(self, worker):
        self.setups += 1

    def process_shard(self, input, rejects):
        name = location(input).name  # local or object storage: the same stage code
        self.calls.append(name)
        if name in self.fail and self.calls.count(name) <= self.fail_times:
            raise OSError(f"disk on fire while writing {name}")
        out = {"prompt_id": [], "square": []}
        for row in read_table(input).to_pylist():
            if row["x"] < 0:
                rejects.add(row, "negative", f"x={row['x']}")
                continue
            out["prompt_id"].append(row["prompt_id"])
            out["square"].append(row["x"] ** self.power)
        return pa.table(out, schema=OUT_SCHEMA)

    def summarize(self, shards):
        total = sum(sum(read_table(p)["square"].to_pylist()) for p in shards)
        return {"sum_of_squares": total}

    def card(self, manifest):
        return "# Squares\n"


def make_inputs(root: Path, shards=((1, 2, 3), (4, -5, 6), (7, 8))) -> Path:
    folder = root / "in"
    folder.mkdir(parents=True)
    for i, xs in enumerate(shards):
        rows = [{"prompt_id": f"p{i}-{j}", "source": "toy", "x": x} for j, x in enumerate(xs)]
        write_parquet_atomic(pa.Table.from_pylist(rows, schema=SCHEMA), folder / shard_name(i))
    mark_complete(folder)
    return folder


def cfg_for(*extra):
    return load_config(["progress=false", *extra])


@pytest.fixture
def inputs(tmp_path):
    return make_inputs(tmp_path)


def run(stage, retries=0):
    return run_stage(stage, LocalExecutor(retries))


def mtimes(folder: Path):
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


# ---- the manifest and the rejects layout ---------------------------------------------------------------------------

def test_manifest_format_rejects_layout_and_shards(tmp_path, inputs):
    out = tmp_path / "squares"
    stage = Squares(cfg_for(), inputs, out, input_rejects=[{"prompt_id": None, "source": "toy", "reason": "empty",
                                                           "detail": "blank line 9"}])
    summary = run(stage)
    assert [p.name for p in list_shards(out)] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["manifest_version"] == MANIFEST_VERSION and m["stage"] == "squares" and m["schema_version"] == "7"
    assert [(f["file"], f["rows"], f["rejects"], f["input_rows"]) for f in m["files"]] == [
        ("part-00000.parquet", 3, 0, 3), ("part-00001.parquet", 2, 1, 3), ("part-00002.parquet", 2, 0, 2)]
    for f in m["files"]:  # each shard's sha256 and size, from its bytes here
        data = (out / f["file"]).read_bytes()
        assert f["sha256"] == hashlib.sha256(data).hexdigest() and f["bytes"] == len(data)
    assert m["rows"] == 7 and m["shards"] == 3 and m["rejects"] == 2 and m["rejects_file"] == "rejects.jsonl"
    assert m["rejects_by_reason"] == {"empty": 1, "negative": 1} and m["rejects_by_source"] == {"toy": 2}
    assert m["rejects_by_worker"] == {"driver": 1}  # the input reject names no worker
    assert m["fingerprint"] == {"power": 2, "schema_version": "7"}
    assert json.loads((out / "fingerprint.json").read_text()) == m["fingerprint"]
    # the fingerprint's sha256: of its canonical JSON (sorted keys, compact), recomputed here
    fingerprint_sha = hashlib.sha256(b'{"power": 2, "schema_version": "7"}').hexdigest()
    assert m["fingerprint_sha256"] == fingerprint_sha
    assert m["summary"] == {"sum_of_squares": 1 + 4 + 9 + 16 + 36 + 49 + 64}
    # rejects: one file per shard (written before the shard), the input rejects, and all of them in one file
    assert (out / REJECTS_DIR / "part-00001.jsonl").read_text().count("\n") == 1
    assert (out / REJECTS_DIR / "part-00000.jsonl").read_text() == ""
    assert json.loads((out / REJECTS_DIR / INPUT_REJECTS).read_text())["detail"] == "blank line 9"
    all_rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in all_rejects] == ["empty", "negative"]  # input first, then shard by shard
    assert all_rejects[1] == {"prompt_id": "p1-1", "source": "toy", "reason": "negative", "detail": "x=-5",
                              "worker": "driver"}
    # every shard carries the stamp the done check reads
    meta = decode_metadata(pq.read_schema(out / "part-00001.parquet").metadata)
    assert meta["fingerprint_sha256"] == fingerprint_sha and meta["input_shard"] == "part-00001.parquet"
    assert meta["stage"] == "squares" and "package_version" in meta
    # the resolved config's sha256: of config.yaml's bytes, as config.sha256 records it
    config_sha = hashlib.sha256((out / "config.yaml").read_bytes()).hexdigest()
    assert meta["config_sha256"] == config_sha == (out / "config.sha256").read_text().strip()
    # the summary, the card (with the shared layout section), the resolved config, _SUCCESS
    saved = json.loads((out / "summary.json").read_text())
    assert saved == {k: v for k, v in summary.items()}  # summary.json is what the stage returned
    assert (summary["rows"], summary["rejects"], summary["shards"], summary["status"]) == (7, 2, 3, "done")
    assert summary["sum_of_squares"] == 1 + 4 + 9 + 16 + 36 + 49 + 64  # the squares of the 7 accepted numbers
    # The card: YAML front matter naming the shards as the only data files (load_dataset(DIR) reads nothing else)
    # and carrying the folder's content hash (the sorted "name sha256" lines of the shards, hashed here), then the
    # stage's own card and the shared layout section.
    card = (out / "README.md").read_text()
    _, yaml_text, body = card.split("---\n", 2)
    (config,) = yaml.safe_load(yaml_text)["configs"]
    assert config["data_files"] == [{"split": "train", "path": "part-*.parquet"}]
    shards = [f"part-0000{i}.parquet" for i in range(3)]
    content = "\n".join(f"{n} {hashlib.sha256((out / n).read_bytes()).hexdigest()}" for n in shards)
    assert config["description"] == f"blockpilot squares shards, content sha256 " \
        f"{hashlib.sha256(content.encode()).hexdigest()}"
    assert body.startswith("# Squares\n") and LAYOUT_DOC.strip() in body
    assert (out / "config.yaml").exists() and (out / "_SUCCESS").exists()
    assert stage.setups == 1  # once per worker, not per shard


# ---- skip-if-complete and resume -----------------------------------------------------------------------------------

def test_skip_if_complete_touches_nothing(tmp_path, inputs):
    out = tmp_path / "squares"
    run(Squares(cfg_for(), inputs, out))
    before = mtimes(out)
    again = Squares(cfg_for(), inputs, out)
    s = run(again)
    assert s["skipped"] is True and s["status"] == "skipped: complete" and s["rows"] == 7
    assert again.calls == [] and again.setups == 0
    assert mtimes(out) == before


def test_a_damaged_shard_of_a_complete_folder_is_redone_alone(tmp_path, inputs):
    out = tmp_path / "squares"
    run(Squares(cfg_for(), inputs, out))
    bad = out / "part-00002.parquet"
    original = pq.read_table(bad).to_pylist()
    bad.write_bytes(bad.read_bytes()[:200])  # truncated after _SUCCESS was written
    again = Squares(cfg_for(), inputs, out)
    run(again)
    assert again.calls == ["part-00002.parquet"]
    assert pq.read_table(bad).to_pylist() == original and (out / "_SUCCESS").exists()


def test_missing_input_is_refused_before_any_write(tmp_path):
    with pytest.raises(FileNotFoundError, match="make the inputs"):
        run(Squares(cfg_for(), tmp_path / "nothing", tmp_path / "squares"))
    assert not (tmp_path / "squares").exists()


# ---- drift -------------------------------------------------------------------------------------------------------

def test_drift_is_refused_naming_the_key_and_force_discards(tmp_path, inputs):
    out = tmp_path / "squares"
    run(Squares(cfg_for(), inputs, out))
    before = mtimes(out)
    with pytest.raises(FileExistsError, match="changed: power"):
        run(Squares(cfg_for(), inputs, out, power=3))
    assert mtimes(out) == before  # the refusal touched nothing
    forced = Squares(cfg_for("force=true"), inputs, out, power=3)
    run(forced)
    assert forced.calls == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert pq.read_table(out / "part-00000.parquet")["square"].to_pylist() == [1, 8, 27]
    assert json.loads((out / "fingerprint.json").read_text())["power"] == 3


def test_a_stale_shard_beyond_the_plan_is_removed(tmp_path):
    inputs = make_inputs(tmp_path)
    out = tmp_path / "squares"
    run(Squares(cfg_for(), inputs, out))
    (inputs / "part-00002.parquet").unlink()  # the input now has two shards
    (out / "_SUCCESS").unlink()
    run(Squares(cfg_for(), inputs, out))
    assert [p.name for p in list_shards(out)] == ["part-00000.parquet", "part-00001.parquet"]
    assert not (out / REJECTS_DIR / "part-00002.jsonl").exists()
    assert json.loads((out / "manifest.json").read_text())["rows"] == 5


# ---- stale temp files --------------------------------------------------------------------------------------------

def test_stale_temp_files_of_a_killed_writer_are_removed(tmp_path, inputs):
    out = tmp_path / "squares"
    (out / REJECTS_DIR).mkdir(parents=True)
    stale = [out / ".part-00001.parquet.tmp-deadbeef", out / REJECTS_DIR / ".part-00001.jsonl.tmp-0badf00d"]
    for p in stale:
        p.write_bytes(b"half a file")
    keep = out / "notes.txt"  # not ours: left alone
    keep.write_text("a user's file")
    run(Squares(cfg_for(), inputs, out))
    assert not any(p.exists() for p in stale) and keep.exists()
    assert not list(out.glob(".*tmp*"))


# ---- failures and retries ----------------------------------------------------------------------------------------

def test_a_failing_shard_fails_the_run_alone_and_a_rerun_does_only_it(tmp_path, inputs):
    out = tmp_path / "squares"
    failing = Squares(cfg_for(), inputs, out, fail={"part-00001.parquet"})
    with pytest.raises(RuntimeError, match=r"1 shard\(s\) failed.*part-00001.parquet: OSError: disk on fire"):
        run(failing)
    assert [p.name for p in list_shards(out)] == ["part-00000.parquet", "part-00002.parquet"]
    assert not (out / "_SUCCESS").exists()
    m = json.loads((out / "manifest.json").read_text())  # describes what is on disk
    assert [f["file"] for f in m["files"]] == ["part-00000.parquet", "part-00002.parquet"]
    done = {p.name: p.stat().st_mtime_ns for p in list_shards(out)}
    rerun = Squares(cfg_for(), inputs, out)
    run(rerun)
    assert rerun.calls == ["part-00001.parquet"]
    assert {p.name: p.stat().st_mtime_ns for p in list_shards(out) if p.name in done} == done
    assert (out / "_SUCCESS").exists() and json.loads((out / "manifest.json").read_text())["rows"] == 7


def test_a_flaky_shard_succeeds_on_retry(tmp_path, inputs):
    out = tmp_path / "squares"
    stage = Squares(cfg_for(), inputs, out, fail={"part-00000.parquet"}, fail_times=1)
    s = run(stage, retries=1)
    assert stage.calls == ["part-00000.parquet", "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert s["rows"] == 7 and (out / "_SUCCESS").exists()


def test_retries_exhausted(tmp_path, inputs):
    out = tmp_path / "squares"
    stage = Squares(cfg_for(), inputs, out, fail={"part-00000.parquet"}, fail_times=3)
    with pytest.raises(RuntimeError, match="part-00000.parquet"):
        run(stage, retries=2)
    assert stage.calls.count("part-00000.parquet") == 3  # the first try and two retries
    assert not (out / "part-00000.parquet").exists() and not (out / "_SUCCESS").exists()
    assert (out / "part-00001.parquet").exists()  # the others carried on


def test_every_row_rejected_is_an_error(tmp_path):
    inputs = make_inputs(tmp_path, shards=((-1, -2),))
    with pytest.raises(RuntimeError, match="every row failed.*x=-1"):
        run(Squares(cfg_for(), inputs, tmp_path / "squares"))
    assert not (tmp_path / "squares" / "_SUCCESS").exists()


def test_a_stage_that_loses_rows_is_caught(tmp_path, inputs):
    class Lossy(Squares):
        def process_shard(self, input, rejects):
            return super().process_shard(input, rejects).slice(0, 1)  # drops rows without rejecting them

    with pytest.raises(RuntimeError, match="expected 3"):
        run(Lossy(cfg_for(), inputs, tmp_path / "squares"))


def test_unwritable_folder_fails_before_any_work(tmp_path, inputs):
    blocker = tmp_path / "afile"
    blocker.write_text("a file where the stage folder's parent should be")
    stage = Squares(cfg_for(), inputs, blocker / "squares")
    with pytest.raises(PermissionError, match="not writable"):
        run(stage)
    assert stage.calls == [] and stage.setups == 0


def test_only_the_driver_writes_manifests_rejects_and_success():
    """The acceptance grep, as a test: stage modules write none of the bookkeeping files themselves."""
    repo = Path(__file__).resolve().parents[2]
    needles = ("mark_complete(", "MANIFEST)", '"_SUCCESS"', "rejects.jsonl", "write_manifest(", "_rejects")
    offenders = []
    for path in [*sorted((repo / "stages").glob("*.py")), *sorted((repo / "pipeline").glob("*.py"))]:
        if path.name in ("driver.py", "shards.py"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(n in code for n in needles) and "write" in code:
                offenders.append(f"{path.name}:{i}: {line.strip()}")
    assert not offenders, offenders
