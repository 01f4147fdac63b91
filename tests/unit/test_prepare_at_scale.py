"""prepare with bounded head memory (issue #66 item 5a): at a million prompts the plan held every row (token ids and
text, many GB) in the head before writing a shard. Now the sources stream, each shard's rows go to a local spool
file as soon as its boundaries are known, and a task's input is that file's path; the shards, their order and the
rejects are those of the in-memory path, and the threaded writes (LocalExecutor, ``io_threads``:
``prepare.write_threads``) those of one shard after another."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.schemas import PROMPTS_SCHEMA
from pipeline.data.sources import build_prompts
from pipeline.decoding.models import load_tokenizer
from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from pipeline.executor.sharding import MIN_SHARD, cut, shard_size_for
from pipeline.io.shards import list_shards, read_jsonl
from pipeline.runtime.config import load_config
from stages import prepare
from stages.prepare import PrepareStage

PROMPTS = 3000
SHARD, PER_WORKER = 64, 4


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """3,000 generated prompts in a jsonl file, with duplicates, too-long prompts and bad lines among them."""
    path = tmp_path_factory.mktemp("src") / "prompts.jsonl"
    lines = []
    for i in range(PROMPTS):
        if i % 97 == 0:
            lines.append("{not json")
        elif i % 89 == 0:
            lines.append(json.dumps({"prompt": "Write a function that returns the number seven."}))
        else:
            words = " and ".join(f"item {j}" for j in range(1 + i % 40 * (5 if i % 83 == 0 else 1)))
            lines.append(json.dumps({"prompt": f"Prompt {i}: sort {words}."}))
    path.write_text("\n".join(lines) + "\n")
    return path


def config(out, source, workers):
    return load_config([f"output_dir={out}", "progress=false", f"prepare.shard_size={SHARD}",
                        f"prepare.shards_per_worker={PER_WORKER}", f"label.num_workers={workers}",
                        "prepare.max_prompt_tokens=200", "prepare.limit=null",
                        f"prepare.sources=[{{name: gen, kind: jsonl, path: '{source}', field: prompt}}]"])


class Recording(LocalExecutor):
    """Records the tasks it is given and the order of its done calls."""

    def run(self, stage, tasks, done):
        self.tasks, self.done = list(tasks), []
        return super().run(stage, tasks, lambda t, r, e: (self.done.append(t.name), done(t, r, e)))


@pytest.mark.parametrize("workers", [2, 16])
def test_prepare_streams_its_rows_through_a_spool_and_writes_the_in_memory_shards(tmp_path, source, workers,
                                                                                   monkeypatch):
    """2 label workers: the shard size (64) is known after 505 prompts, and from then on each shard is spooled as it
    fills; 16: 3,000 prompts are few enough for smaller shards, so they wait for the total (the size rule's own
    bound, 16 x 4 x 64 rows). Either way the shards are the in-memory path's."""
    held, peak = [0], [0]
    stream, spool = prepare.stream_prompts, prepare.write_spool

    def counted_stream(*args, **kwargs):
        rows, rejects, stats = stream(*args, **kwargs)

        def each():
            for row in rows:
                held[0] += 1
                peak[0] = max(peak[0], held[0])
                yield row
        return each(), rejects, stats

    def counted_spool(rows, path):
        spool(rows, path)
        held[0] -= len(rows)

    monkeypatch.setattr(prepare, "stream_prompts", counted_stream)
    monkeypatch.setattr(prepare, "write_spool", counted_spool)
    cfg = config(tmp_path, source, workers)
    stage, executor = PrepareStage(cfg), Recording()
    assert stage.io_threads == 8
    summary = run_stage(stage, executor)

    rows, rejects, _ = build_prompts(cfg.prepare.sources, load_tokenizer(cfg.model), 200)
    size = shard_size_for(len(rows), workers, SHARD, PER_WORKER)
    assert summary["sharding"]["shard_size"] == size and summary["rows"] == len(rows) > 2500
    assert held[0] == 0 and peak[0] <= workers * PER_WORKER * SHARD, peak
    assert all(isinstance(t.input, str) and t.input.endswith(".arrow") for t in executor.tasks)
    assert executor.done == [t.name for t in executor.tasks]  # one progress call a shard, in order
    assert not stage.spool.exists()  # removed once the stage completed

    out = tmp_path / "prompts"
    shards = list_shards(out)
    assert len(shards) == -(-len(rows) // size)
    for i, p in enumerate(shards):
        table = pq.read_table(p)
        assert table.schema.remove_metadata() == PROMPTS_SCHEMA
        assert table.to_pylist() == pa.Table.from_pylist(rows[i * size:(i + 1) * size], PROMPTS_SCHEMA).to_pylist()
    assert read_jsonl(out / "rejects.jsonl") == rejects and {r["reason"] for r in rejects} == \
        {"duplicate", "malformed_json", "too_long"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompt_tokens"] == {"max": max(r["prompt_tokens"] for r in rows), "prompts": len(rows)}

    monkeypatch.undo()
    threaded = out.rename(out.with_name("threaded"))  # the same config again (its hash is in every shard's metadata)
    sequential = PrepareStage(cfg)
    sequential.io_threads = 1  # not the config key: its hash is in every shard's metadata too
    run_stage(sequential, LocalExecutor())
    # byte for byte, every shard's sha256 among them (the stamps, mtimes here, are in _stamps.json)
    assert (out / "manifest.json").read_bytes() == (threaded / "manifest.json").read_bytes()


def test_a_stream_is_cut_as_its_whole_list_would_be():
    """sharding.cut against slicing the whole list at shard_size_for(its length): every count around the point
    where the size settles, for sizes above, at and under MIN_SHARD."""
    for workers, max_size, per_worker in [(2, 64, 4), (3, 10, 2), (5, 64, 0), (2, MIN_SHARD, 4), (1, 6, 4)]:
        size_for = lambda n: shard_size_for(n, workers, max_size, per_worker)  # noqa: E731
        for n in range(0, workers * max(per_worker, 1) * max_size + 70):
            size = size_for(n)
            assert list(cut(iter(range(n)), size_for)) == [list(range(n))[i:i + size] for i in range(0, n, size)], \
                (workers, max_size, per_worker, n)
