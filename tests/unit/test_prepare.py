"""prepare: prompt sources -> prompt shards, on real files (tests/data/bad_inputs) and the bundled tiny tokenizer."""

import glob
import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.cli import main
from pipeline.runtime.config import REPO_ROOT, ConfigError, ModelConfig, SourceConfig, load_config
from pipeline.data.schemas import PROMPTS_SCHEMA, prompt_id
from pipeline.data.chat import format_prompt
from pipeline.decoding.models import load_tokenizer
from pipeline.io.shards import file_sha256, read_jsonl
from pipeline.data.sources import REJECT_REASONS, build_prompts, bundled_split
from stages import prepare

DATA = REPO_ROOT / "tests" / "data"
BAD = DATA / "bad_inputs"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def src(name, kind, path, **kw):
    return SourceConfig(name=name, kind=kind, path=str(path), **kw)


def sources_override(sources):
    """A `prepare.sources=[...]` dotlist override (flow-style YAML)."""
    items = []
    for s in sources:
        fields = ", ".join(f"{k}: {json.dumps(v)}" for k, v in s.items())
        items.append("{" + fields + "}")
    return "prepare.sources=[" + ", ".join(items) + "]"


def cfg_for(tmp_path, sources, *extra):
    return load_config([f"output_dir={tmp_path / 'run'}", "progress=false", sources_override(sources), *extra])


def reasons(rejects):
    out = {}
    for r in rejects:
        out[r["reason"]] = out.get(r["reason"], 0) + 1
    return out


# ---- end to end --------------------------------------------------------------------------------------------------

def test_end_to_end_bundled(tmp_path, tok):
    cfg = load_config([f"output_dir={tmp_path}", "progress=false", "prepare.limit=16", "prepare.shard_size=6",
                       "prepare.sources=[{name: he, kind: bundled, path: humaneval}]"])
    summary = prepare.run(cfg)
    out = tmp_path / "prompts"
    assert summary["status"] == "done" and summary["rows"] == 16 and summary["shards"] == 3
    assert sorted(p.name for p in out.glob("part-*.parquet")) == ["part-00000.parquet", "part-00001.parquet",
                                                                  "part-00002.parquet"]
    for name in ("_SUCCESS", "manifest.json", "rejects.jsonl", "README.md", "config.yaml", "config.sha256"):
        assert (out / name).exists(), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == 16 and [f["rows"] for f in manifest["files"]] == [6, 6, 4]
    for f in manifest["files"]:
        assert file_sha256(out / f["file"]) == f["sha256"]
        assert pq.read_schema(out / f["file"]).remove_metadata() == PROMPTS_SCHEMA
    assert manifest["sources"]["he"]["accepted"] == 16 and manifest["sources"]["he"]["limit_reached"]
    assert manifest["tokenizer"] == "bundled:tiny-target"
    assert "prompt_tokens" in (out / "README.md").read_text()
    assert load_config([], str(out / "config.yaml")).prepare.limit == 16  # the resolved config reloads

    df = pl.read_parquet(str(out / "*.parquet"))
    assert df.height == 16 and df["prompt_id"].n_unique() == 16
    first = df.row(0, named=True)
    from pipeline.data.bundled import load_bundled

    he = load_bundled("humaneval")
    assert first["text"] == he[0]["text"] and first["source_row"] == 0 and first["source"] == "he"
    assert first["prompt_id"] == prompt_id("he", he[0]["text"])
    assert first["prompt"] == format_prompt(tok, he[0]["text"])
    assert first["input_ids"] == tok(first["prompt"], add_special_tokens=False)["input_ids"]
    assert first["prompt_tokens"] == len(first["input_ids"])
    assert df["source_row"].to_list() == list(range(16))  # source order


def test_every_reject_reason_from_real_bad_files(tmp_path, tok):
    huge = tmp_path / "huge.jsonl"  # ~1 MB prompt: too_long, generated here rather than committed
    huge.write_text(json.dumps({"prompt": "x = 1 + y\n" * 100_000}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    sources = [
        {"name": "jsonl", "kind": "jsonl", "path": str(BAD / "prompts.jsonl")},
        {"name": "empty-file", "kind": "jsonl", "path": str(BAD / "empty.jsonl")},
        {"name": "json", "kind": "json", "path": str(BAD / "rows.json"), "field": "question"},
        {"name": "broken", "kind": "json", "path": str(BAD / "broken.json"), "field": "question"},
        {"name": "lines", "kind": "text", "path": str(BAD / "lines.txt")},
        {"name": "mixed", "kind": "jsonl", "path": str(BAD / "mixed_folder")},
        {"name": "txtdir", "kind": "text", "path": str(BAD / "txt_folder")},
        {"name": "huge", "kind": "jsonl", "path": str(huge)},
    ]
    summary = prepare.run(cfg_for(tmp_path, sources, "prepare.max_prompt_tokens=512"))
    out = tmp_path / "run" / "prompts"
    rejects = read_jsonl(out / "rejects.jsonl")
    assert set(reasons(rejects)) == set(REJECT_REASONS)  # every reason, from real files
    assert summary["rejects_by_reason"] == reasons(rejects) and summary["rejects"] == len(rejects)
    assert summary["duplicates"] == 1
    assert summary["sources"] == {"jsonl": 3, "empty-file": 0, "json": 2, "broken": 0, "lines": 2, "mixed": 2,
                                  "txtdir": 2, "huge": 1}
    df = pl.read_parquet(str(out / "*.parquet"))
    assert df["text"].to_list() == [
        "What is 2 + 2?", "Write a haiku about the sea.", "Name three prime numbers. \u2713 \u00fcn\u00efc\u00f6d\u00e9",
        "Why is the sky blue?", "How do magnets work?",
        "Explain recursion in one sentence.", "Summarise the plot of Hamlet.",
        "Folder prompt A", "Folder prompt B",
        "First file prompt.\nSecond line of the same prompt.", "Second file prompt.",
        "short"]
    by = {(r["source"], r["source_row"], r["reason"]) for r in rejects}
    # jsonl: one line with invalid UTF-8 bytes is rejected and every other line is kept
    assert ("jsonl", 6, "undecodable") in by and ("jsonl", 5, "undecodable") in by  # raw \xe9; \ud800 escape
    assert {("jsonl", 1, "empty"), ("jsonl", 2, "empty"), ("jsonl", 3, "nul_bytes"), ("jsonl", 4, "nul_bytes"),
            ("jsonl", 7, "wrong_type"), ("jsonl", 8, "wrong_type"), ("jsonl", 9, "missing_field"),
            ("jsonl", 10, "missing_field"), ("jsonl", 11, "malformed_json"), ("jsonl", 12, "wrong_type"),
            ("jsonl", 13, "duplicate")} <= by
    assert ("json", 4, "undecodable") in by and ("broken", None, "malformed_json") in by
    assert ("lines", 1, "undecodable") in by and ("lines", 2, "nul_bytes") in by
    assert ("huge", 0, "too_long") in by and ("txtdir", 0, "empty") in by
    wrong_format = sorted(Path(r["file"]).name for r in rejects if r["reason"] == "wrong_format")
    assert wrong_format == ["data.csv", "notes.md", "readme.md"]  # .hidden.jsonl ignored
    dup = next(r for r in rejects if r["reason"] == "duplicate")
    assert dup["prompt_id"] == prompt_id("jsonl", "What is 2 + 2?")
    for r in rejects:
        assert set(r) >= {"source", "source_row", "prompt_id", "reason", "detail"} and len(r["detail"]) <= 200
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"]["empty-file"]["empty_files"] == [str(BAD / "empty.jsonl")]
    assert any("empty.jsonl has no rows" in n for n in summary["notes"])
    assert manifest["rejects_by_source"]["jsonl"] == 13
    assert manifest["duplicates"] == 1


def test_missing_path_is_a_clear_error_before_any_work(tmp_path, capsys):
    sources = [{"name": "good", "kind": "bundled", "path": "humaneval"},
               {"name": "ghost", "kind": "jsonl", "path": str(tmp_path / "nope.jsonl")}]
    with pytest.raises(FileNotFoundError, match="source 'ghost'.*does not exist"):
        prepare.run(cfg_for(tmp_path, sources))
    out = tmp_path / "run" / "prompts"
    assert not list(out.glob("part-*")) and not (out / "fingerprint.json").exists()
    # the CLI: exit 1, the message, no traceback
    rc = main(["prepare", f"output_dir={tmp_path / 'run'}", sources_override(sources)])
    err = capsys.readouterr().err
    assert rc == 1 and "ghost" in err and "Traceback" not in err
    # a fixed config then runs (the failed first attempt left nothing to protect)
    assert prepare.run(cfg_for(tmp_path, sources[:1], "prepare.limit=2"))["rows"] == 2


def test_nothing_accepted_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no prompt accepted"):
        prepare.run(cfg_for(tmp_path, [{"name": "e", "kind": "jsonl", "path": str(BAD / "empty.jsonl")}]))
    assert not (tmp_path / "run" / "prompts" / "_SUCCESS").exists()
    # nothing was written, so a corrected config is not refused as drift
    fixed = [{"name": "p", "kind": "jsonl", "path": str(BAD / "prompts.jsonl")}]
    assert prepare.run(cfg_for(tmp_path, fixed))["rows"] == 3


# ---- source kinds ------------------------------------------------------------------------------------------------

def test_hf_kind_on_a_local_dataset_folder_with_template(tmp_path, tok):
    folder = tmp_path / "copa"
    folder.mkdir()
    pq.write_table(pa.table({"premise": ["The man turned on the faucet.", "I coughed.", "The bell rang."],
                             "choice1": ["The toilet filled.", "I inhaled smoke.", "x"],
                             "choice2": ["Water flowed.", "I lowered my voice.", None]}), folder / "train.parquet")
    s = src("copa", "hf", folder, template="{premise} A: {choice1} B: {choice2}")
    rows, rejects, stats = build_prompts([s], tok, 512)
    assert [r["text"] for r in rows] == ["The man turned on the faucet. A: The toilet filled. B: Water flowed.",
                                         "I coughed. A: I inhaled smoke. B: I lowered my voice."]
    assert [(r["source_row"], r["reason"]) for r in rejects] == [(2, "missing_field")]  # null choice2
    # split: an unknown split is a clear error naming the source
    with pytest.raises(ValueError, match="source 'copa'.*split 'validation'"):
        build_prompts([src("copa", "hf", folder, split="validation", template="{premise}")], tok, 512)
    # field instead of template; a parquet FILE path
    rows, _, _ = build_prompts([src("p", "hf", folder / "train.parquet", field="premise")], tok, 512)
    assert len(rows) == 3


def test_parquet_kind_and_an_unreadable_parquet_file(tmp_path, tok):
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["one", "two", "three"], "n": [1, 2, 3]}), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"this is not parquet")
    rows, rejects, _ = build_prompts([src("pq", "parquet", folder)], tok, 512)
    assert [r["text"] for r in rows] == ["one", "two", "three"]
    assert [(r["reason"], Path(r["file"]).name) for r in rejects] == [("wrong_format", "b.parquet")]


def test_sharegpt_first_human_turn(tok):
    rows, rejects, _ = build_prompts([src("sg", "sharegpt", DATA / "sharegpt.jsonl")], tok, 512)
    assert [(r["source_row"], r["text"]) for r in rows] == [
        (0, "Hello, who are you?"), (1, "A human question after a gpt turn"), (2, "Role/content style turn")]
    assert [(r["source_row"], r["reason"]) for r in rejects] == [
        (3, "missing_field"), (4, "missing_field"), (5, "wrong_type"), (6, "wrong_type")]
    # a template sees the row's fields and `text` = the first human turn
    rows, _, _ = build_prompts([src("sg", "sharegpt", DATA / "sharegpt.jsonl", template="[{id}] {text}")], tok, 512)
    assert rows[0]["text"] == "[a] Hello, who are you?"


def test_templates_index_missing_keys_and_wrong_types(tmp_path, tok):
    f = tmp_path / "mt.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": ["First turn", "Second turn"], "cat": "writing"},
        {"prompt": [], "cat": "x"},
        {"prompt": "a plain string", "cat": "x"},
        {"cat": "no prompt"},
        {"prompt": [{"nested": 1}], "cat": "x"},
    ]) + "\n")
    rows, rejects, _ = build_prompts([src("mt", "jsonl", f, template="{prompt[0]}")], tok, 512)
    assert [r["text"] for r in rows] == ["First turn"]
    assert [(r["source_row"], r["reason"]) for r in rejects] == [
        (1, "missing_field"), (2, "wrong_type"), (3, "missing_field"), (4, "wrong_type")]
    rows, rejects, _ = build_prompts([src("mt", "jsonl", f, template="({cat}) {nothere}")], tok, 512,
                                     require_any=False)
    assert rows == [] and {r["reason"] for r in rejects} == {"missing_field"}
    assert "nothere" in rejects[0]["detail"]
    rows, _, _ = build_prompts([src("mt", "jsonl", f, template="{cat}: {{literal}}")], tok, 512)
    assert rows[0]["text"] == "writing: {literal}"
    for bad in ("{prompt", "{} and {0}"):
        with pytest.raises(ConfigError, match=r"prepare.sources\[0\].template"):
            build_prompts([src("mt", "jsonl", f, template=bad)], tok, 512)


def test_text_kind_one_prompt_per_line_or_per_file(tok):
    rows, _, _ = build_prompts([src("l", "text", BAD / "lines.txt")], tok, 512)
    assert [r["text"] for r in rows] == ["Explain recursion in one sentence.", "Summarise the plot of Hamlet."]
    rows, _, _ = build_prompts([src("d", "text", BAD / "txt_folder")], tok, 512)
    assert len(rows) == 2 and "\n" in rows[0]["text"]


def test_bundled_split_is_a_fixed_90_10_partition(tok):
    from pipeline.data.bundled import load_bundled

    he = load_bundled("humaneval")
    ev, _, _ = build_prompts([src("he", "bundled", "humaneval", split="eval")], tok, 2048)
    lab, _, _ = build_prompts([src("he", "bundled", "humaneval", split="label")], tok, 2048)
    allp, _, _ = build_prompts([src("he", "bundled", "humaneval")], tok, 2048)
    ids_eval = {he[r["source_row"]]["id"] for r in ev}
    assert ids_eval == {x["id"] for x in he if int(__import__("hashlib").sha256(x["id"].encode()).hexdigest()[:8], 16)
                        % 10 == 0}
    assert all(bundled_split(he[r["source_row"]]["id"]) == "label" for r in lab)
    assert len(ev) + len(lab) == len(allp) == len(he) and 0 < len(ev) < len(lab)
    with pytest.raises(ConfigError, match="split"):
        build_prompts([src("he", "bundled", "humaneval", split="train")], tok, 512)
    with pytest.raises(ConfigError, match="unknown bundled"):
        build_prompts([src("x", "bundled", "no-such-set")], tok, 512)


def test_limit_counts_accepted_prompts_and_per_source_limit_wins(tok):
    sources = [src("p", "jsonl", BAD / "prompts.jsonl"), src("sg", "sharegpt", DATA / "sharegpt.jsonl", limit=1)]
    rows, rejects, stats = build_prompts(sources, tok, 512, limit=2)
    assert [r["text"] for r in rows] == ["What is 2 + 2?", "Write a haiku about the sea.", "Hello, who are you?"]
    assert stats["sources"]["p"]["limit_reached"] and stats["sources"]["sg"]["limit"] == 1
    assert {r["source"] for r in rejects} == {"p"}  # sharegpt stopped after its first accepted prompt
    assert max(r["source_row"] for r in rejects) < 14  # rows after the cap are not read


def test_dedup_within_a_source_and_ids_differ_across_sources(tmp_path, tok):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a b", "c d", "a b", "a b"]))
    rows, rejects, stats = build_prompts([src("x", "jsonl", f), src("y", "jsonl", f)], tok, 512)
    assert [r["text"] for r in rows] == ["a b", "c d", "a b", "c d"]
    assert stats["duplicates"] == 4 and stats["sources"]["x"]["duplicates"] == 2
    assert len({r["prompt_id"] for r in rows}) == 4


def test_utf8_bom_and_crlf(tmp_path, tok):
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "first"}\r\n{"prompt": "second"}\r\n')
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    (tmp_path / "bom.json").write_bytes(b'\xef\xbb\xbf[{"prompt": "third"}]')
    rows, rejects, _ = build_prompts([src("a", "jsonl", tmp_path / "bom.jsonl"), src("b", "text", tmp_path / "bom.txt"),
                                      src("c", "json", tmp_path / "bom.json")], tok, 512)
    assert rejects == [] and [r["text"] for r in rows] == ["first", "second", "line one", "line two", "third"]


# ---- reruns ------------------------------------------------------------------------------------------------------

def test_rerun_skips_drift_is_refused_and_force_rewrites(tmp_path):
    sources = [{"name": "he", "kind": "bundled", "path": "humaneval"}]
    base = ["prepare.limit=10", "prepare.shard_size=3"]
    first = prepare.run(cfg_for(tmp_path, sources, *base))
    out = tmp_path / "run" / "prompts"
    assert first["shards"] == 4
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare.run(cfg_for(tmp_path, sources, *base))
    assert again["status"] == "skipped: complete" and again["rows"] == 10
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing rewritten
    with pytest.raises(FileExistsError, match="max_prompt_tokens"):
        prepare.run(cfg_for(tmp_path, sources, *base, "prepare.max_prompt_tokens=300"))
    assert (out / "_SUCCESS").exists()  # refusal touches nothing
    forced = prepare.run(cfg_for(tmp_path, sources, "prepare.limit=10", "prepare.shard_size=8", "force=true"))
    assert forced["status"] == "done" and forced["shards"] == 2
    assert sorted(p.name for p in out.glob("part-*.parquet")) == ["part-00000.parquet", "part-00001.parquet"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [f["file"] for f in manifest["files"]] == ["part-00000.parquet", "part-00001.parquet"]
    assert pl.read_parquet(str(out / "*.parquet")).height == 10


def test_identical_rerun_with_force_writes_an_identical_manifest(tmp_path):
    sources = [{"name": "he", "kind": "bundled", "path": "humaneval"}]
    prepare.run(cfg_for(tmp_path, sources, "prepare.limit=4"))
    out = tmp_path / "run" / "prompts"
    sha = file_sha256(out / "manifest.json")
    (out / "_SUCCESS").unlink()  # an interrupted folder is redone
    assert prepare.run(cfg_for(tmp_path, sources, "prepare.limit=4"))["status"] == "done"
    assert file_sha256(out / "manifest.json") == sha  # label's fingerprint of the prompts stays valid


# ---- CLI, job entrypoint, configs --------------------------------------------------------------------------------

def test_cli_unwritable_output_dir_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("a regular file, so nothing can be created under it")
    assert main(["prepare", f"output_dir={blocker / 'sub'}", "prepare.limit=2"]) == 1
    err = capsys.readouterr().err
    assert "not writable" in err and "Traceback" not in err


# The paper's models (tiny-t1, the bundled pair at T = 1, is pinned in tests/unit/test_conf_defaults.py).
PUBLISHED = sorted(p for p in glob.glob(str(REPO_ROOT / "conf" / "published" / "*.yaml"))
                   if not p.endswith("tiny-t1.yaml"))


def test_shipped_configs_validate():
    load_config(config_file=str(REPO_ROOT / "conf" / "default.yaml"))
    assert len(PUBLISHED) == 5  # the four models at T = 0 and the paper's own setting, Qwen3-4B at T = 1
    targets = {}
    for path in PUBLISHED:
        cfg = load_config(config_file=path)
        targets[cfg.model.target] = cfg.model.draft
        assert cfg.label.block_size == 16 and cfg.label.k == 2
        assert cfg.decode.max_new_tokens == 2048
        assert cfg.decode.temperature == (1.0 if path.endswith("-t1.yaml") else 0.0)
        assert cfg.prepare.apply_chat_template and not cfg.model.enable_thinking
        assert [s.name for s in cfg.prepare.sources] == ["sharegpt", "wsc-train", "wsc-validation", "copa-train",
                                                         "copa-validation"]
        assert [s.name for s in cfg.evaluate.sources] == ["gsm8k", "math500", "aime24", "humaneval", "mbpp",
                                                          "swe-bench", "mt-bench"]
        # the templates format real-looking rows (and the checks that run before any work pass)
        from pipeline.data.prompt_text import row_text
        from pipeline.data.sources import validate_sources

        validate_sources(cfg.prepare.sources, "prepare")
        validate_sources(cfg.evaluate.sources, "evaluate")
        ev = {s.name: s for s in cfg.evaluate.sources}
        assert row_text(ev["gsm8k"], {"question": "Q?"})[0] == (
            "Q?\nPlease reason step by step, and put your final answer within \\boxed{}.")
        assert row_text(ev["mt-bench"], {"prompt": ["turn 1", "turn 2"]})[0] == "turn 1"
        copa = {s.name: s for s in cfg.prepare.sources}["copa-train"]
        assert row_text(copa, {"premise": "P.", "choice1": "A.", "choice2": "B."})[0] == "P. A: A. B: B."
    assert targets == {
        "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
        "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
        "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    }
