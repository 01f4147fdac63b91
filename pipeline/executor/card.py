"""The dataset card every stage folder carries: YAML front matter naming the shards, the stage's own part, and
the folder layout (documented once here, rendered into every card)."""

from __future__ import annotations

from pipeline.executor.manifest import MANIFEST_VERSION
from pipeline.io.layout import CARD, FINGERPRINT, INPUT_REJECTS, MANIFEST, REJECTS, REJECTS_DIR, SUCCESS, SUMMARY

# So that `datasets.load_dataset(DIR)` (and the Hub, once uploaded unchanged) reads the shards and nothing else in
# the folder: manifest.json, rejects.jsonl, _SUCCESS and _rejects/ are not data files.
FRONT_MATTER = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: "part-*.parquet"
---
"""

# Rendered into every dataset card (see :func:`layout_doc`).
LAYOUT_DOC = f"""## Folder layout (every stage)

| path | what |
| --- | --- |
| `part-NNNNN.parquet` | the output shards; `part-N` is made from input shard `part-N` where the stage has input shards |
| `{REJECTS_DIR}/part-NNNNN.jsonl` | rows of shard N that were rejected, written just before the shard |
| `{REJECTS_DIR}/{INPUT_REJECTS}` | rows rejected before sharding (prepare: bad source rows) |
| `{REJECTS}` | every reject of the stage: `{INPUT_REJECTS}` first, then shard by shard |
| `{MANIFEST}` | the manifest below; written after the last shard, it holds no timings |
| `{SUMMARY}` | the last run's summary: the manifest's counts plus timings, workers and the stage's own results |
| `{FINGERPRINT}` | the config values that shaped the output; a rerun with other values is refused unless `force=true` |
| `config.yaml`, `config.sha256` | the resolved config of the last run and its sha256 |
| `{CARD}` | this card; its YAML front matter names the shards, so `datasets.load_dataset(DIR)` reads them alone |
| `{SUCCESS}` | empty; written last, once every shard is present and valid |

A reject is one JSON object per line: `prompt_id` and `source` where known, `reason`, `detail`, and `worker`
(decoding stages) or `source_row` and `file` (prepare). Every shard carries the key-value metadata
`blockpilot.fingerprint_sha256`, `blockpilot.config_sha256`, `blockpilot.package_version`, `blockpilot.stage` and,
where it has one, `blockpilot.input_shard`. A shard counts as done on a rerun when its footer reads, it carries the
folder's fingerprint, and its rows plus its rejects account for every input row. The folder may live in object
storage (`output_dir=s3://...`): every file is then uploaded whole (one PUT, or a multipart upload completed last),
so an object is visible only once complete, and the same order holds (rejects, shard, manifest, `{SUCCESS}` last).

`{MANIFEST}` (manifest_version {MANIFEST_VERSION}):

| key | meaning |
| --- | --- |
| `manifest_version`, `stage`, `schema_version` | format of this file; the stage; the shards' schema version |
| `files` | one entry per shard: `file`, `rows`, `bytes`, `sha256`, `rejects` (that shard's reject count), `input_rows` (rows of its input; `rows` = (`input_rows` - `rejects`) x rows per input row) |
| `rows`, `shards` | total rows and shard count |
| `rejects`, `rejects_file` | total rejects; `{REJECTS}` |
| `rejects_by_reason`, `rejects_by_source`, `rejects_by_worker` | reject counts by those fields |
| `fingerprint`, `fingerprint_sha256` | as in `{FINGERPRINT}`, and its sha256 (the one in every shard) |
| `workers` | the workers that wrote the shards, earlier interrupted runs' included |
| `summary` | the stage's own summary of the data (e.g. label histograms) |
"""


def layout_doc() -> str:
    return LAYOUT_DOC
