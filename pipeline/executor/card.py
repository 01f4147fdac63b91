"""The dataset card every stage folder carries: YAML front matter naming the shards, the stage's own part, and
the folder layout (documented once here, rendered into every card)."""

from __future__ import annotations

import hashlib
from typing import Any, Dict

from pipeline.executor.manifest import MANIFEST_VERSION
from pipeline.io.layout import (CARD, CHECKSUMS_DIR, FINGERPRINT, INPUT_REJECTS, LEASE, LEASE_LOCK, MANIFEST, REJECTS,
                                REJECTS_DIR, STAMPS, SUCCESS, SUMMARY)


def content_sha256(manifest: Dict[str, Any]) -> str:
    """One hash of the folder's data: every listed shard's name and sha256 (the manifest's own entries)."""
    lines = sorted(f"{f['file']} {f['sha256']}" for f in manifest.get("files", []))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def front_matter(manifest: Dict[str, Any]) -> str:
    """The card's YAML front matter: ``data_files`` names the shards, so that `datasets.load_dataset(DIR)` (and the
    Hub, once uploaded unchanged) reads them and nothing else in the folder (manifest.json, rejects.jsonl, _SUCCESS
    and _rejects/ are not data files).

    ``description`` carries the folder's content hash because datasets 5 keys its cache on what the card declares,
    not on the files: the cache path is ``NAME/CONFIG/VERSION/HASH`` with NAME the folder's base name (``labels``
    in every run) and HASH a hash of the builder configs parsed from this YAML (``data_files`` as patterns, not as
    the files they match; datasets/load.py, LocalDatasetModuleFactory.get_module). Two runs' folders with equal
    front matter therefore shared one cache entry, and the second load returned the first folder's rows. A
    ``description`` is a builder-config field, so it enters that HASH: each folder's content gets its own entry.
    """
    return f"""---
configs:
- config_name: default
  description: "blockpilot {manifest.get('stage', 'stage')} shards, content sha256 {content_sha256(manifest)}"
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
| `{CHECKSUMS_DIR}/part-NNNNN.json` | shard N's `sha256` and `bytes`, written just before the shard, then again with its `stamp` once it is published; a rerun keeps a shard whose listed size and stamp are the recorded ones without reading it, and reads and hashes any other (`blockpilot validate` hashes every shard) |
| `{STAMPS}` | each listed shard's `stamp` as last listed (size and mtime on a disk, the ETag in object storage): what a rerun of a complete folder checks instead of reading every shard |
| `{LEASE}` | present while a run writes the folder: its host, pid, start and heartbeat; a second run refuses while it lives |
| `{LEASE_LOCK}` | empty; on a local disk, serialises lease takeovers and heartbeats |
| `{REJECTS_DIR}/{INPUT_REJECTS}` | rows rejected before sharding (prepare: bad source rows) |
| `{REJECTS}` | every reject of the stage: `{INPUT_REJECTS}` first, then shard by shard |
| `{MANIFEST}` | the manifest below; written after the last shard, it holds no timings |
| `{SUMMARY}` | the last run's summary: the manifest's counts plus timings, workers and the stage's own results |
| `{FINGERPRINT}` | the config values that shaped the output; a rerun with other values is refused unless `force=true` |
| `config.yaml`, `config.sha256` | the resolved config of the last run and its sha256 |
| `{CARD}` | this card; its YAML front matter names the shards, so `datasets.load_dataset(DIR)` reads them alone, and holds the shards' content sha256, so `datasets` caches each folder's rows apart |
| `{SUCCESS}` | empty; written last, once every shard is present and valid |

A reject is one JSON object per line: `prompt_id` and `source` where known, `reason`, `detail`, and `worker`
(decoding stages) or `source_row` and `file` (prepare). The decoding stages' reasons are `decode_error` (the prompt
raised while decoding) and `out_of_memory` (it did not fit, alone): a rerun redoes their shards; and `breaks_device`
(the prompt raised a sticky device error on two workers; `detail` names them and the error): kept on a rerun, which
would break a third. A failing device leaves none (its shards go to another worker). Every shard carries the key-value metadata
`blockpilot.fingerprint_sha256`, `blockpilot.config_sha256`, `blockpilot.package_version`, `blockpilot.stage` and,
where it has one, `blockpilot.input_shard`. A shard counts as done on a rerun when its footer reads, it carries the
folder's fingerprint, its rows plus its rejects account for every input row, none of its rejects is a decoding
one, and its bytes are the ones recorded when it was written: its listed size and stamp equal those of
`{CHECKSUMS_DIR}/` (else of `{STAMPS}`), or, where they differ, its sha256 equals the recorded one. The folder may live in object
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
| `summary` | the stage's own summary of the data (e.g. label histograms; label's `cost_profiles`: each worker profile's rows and one shard carrying it) |
| stage keys | prepare's `prompt_tokens` (`max`: the longest prompt in tokens, what decoding workers size their memory for; `prompts`), `duplicates`, `sources`, `notes`, `tokenizer`; label's `cost_profile` |
"""


def layout_doc() -> str:
    return LAYOUT_DOC
