"""pipeline.evaluation.context_length: tau and the best block size by prompt-length bucket."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.evaluation.context_length import (CTX_MAX, MIN_ROWS, context_ranges, context_table, length_buckets,
                                                render_table, table_from_shards)

CANDS = [2, 3, 4, 6, 8]  # no b = 1: context_table adds it at tau = 1
BS = np.array([1] + CANDS)


def cost_at(slope):
    return lambda b: 1.0 if b == 1 else 1.1 + slope * (b - 1)


def true_tau(alpha):
    return (1 - alpha ** BS) / (1 - alpha)  # E[1 + min(accepted run, b - 1)], the run geometric with rate alpha


def synthetic(alphas, per=500, steps=20, seed=0):
    """Group g: prompt lengths in (1000 g, 1000 g + 1000), per-step acceptance alpha_g; each row's tau at every b
    is the mean over ``steps`` verify steps of 1 + min(run, b - 1), one run per step shared by every b."""
    rng = np.random.default_rng(seed)
    lengths, taus = [], []
    for g, a in enumerate(alphas):
        lengths.append(rng.integers(1000 * g + 1, 1000 * g + 1000, size=per))
        runs = rng.geometric(1 - a, size=(per, steps)) - 1  # accepted drafts before the first rejection
        taus.append((1 + np.minimum(runs[:, :, None], np.array(CANDS) - 1)).mean(axis=1))
    return np.concatenate(lengths), np.concatenate(taus)


def test_long_prompts_low_tau_make_the_best_b_vary():
    alphas, cost = [0.9, 0.75, 0.5, 0.02], cost_at(0.05)
    x, tau = synthetic(alphas)
    t = context_table(x, tau, CANDS, cost=cost)
    assert t.block_sizes == BS.tolist() and len(t.buckets) == 4
    costs = np.array([cost(b) for b in BS])
    for bk, a in zip(t.buckets, alphas):
        true_t = costs / true_tau(a)
        assert costs[BS.tolist().index(bk.best_b)] / true_tau(a)[BS.tolist().index(bk.best_b)] <= true_t.min() * 1.03
    assert t.buckets[0].best_b == 8 and t.buckets[-1].best_b == 1  # short: the longest block; long: no speculation
    assert t.varies and t.buckets[-1].beyond_noise and t.chosen[-1] == 1
    assert t.overall_b not in (1, 8)
    lines = render_table(t)
    assert len(lines) == 2 + 4 + 1 and "tau b=1" in lines[0] and lines[-1].startswith("Best b varies")
    assert "1*" in lines[-2]


def test_intervals_cover_true_means_and_are_not_vacuous():
    alphas = [0.9, 0.75, 0.5, 0.02]
    hits = total = 0
    for seed in range(10):
        t = context_table(*synthetic(alphas, seed=seed), CANDS, cost=cost_at(0.05))
        for bk, a in zip(t.buckets, alphas):
            mu, lo, hi = true_tau(a), np.array(bk.tau_low), np.array(bk.tau_high)
            hits += int(((lo <= mu + 1e-12) & (mu - 1e-12 <= hi))[1:].sum())
            total += len(CANDS)
            assert np.all(hi - lo < 0.5)  # an interval wide enough to contain anything would pass coverage
    assert hits / total >= 0.9  # nominal 95 %


def test_tau_independent_of_length_does_not_vary():
    x, tau = synthetic([0.75] * 4, seed=3)
    for cost in (cost_at(0.05), cost_at(0.2), None):
        t = context_table(x, tau, CANDS, cost=cost)
        assert not t.varies, t.why
        assert t.chosen == [t.overall_b] * len(t.buckets)
        assert render_table(t)[-1].startswith("Best b does not vary")


def test_a_best_b_that_differs_by_noise_alone_does_not_vary():
    # b = 4 and b = 6 tie exactly in mean cost / tau (E[1 / tau] from a large sample): which wins a bucket is noise
    _, big = synthetic([0.75], per=20000, seed=100)
    inv = (1 / big).mean(axis=0)
    cost = {1: 1.0, 2: 1.2, 3: 1.22, 4: 1.25, 6: 1.25 * inv[2] / inv[3], 8: 2.0}.get
    differs = 0
    for seed in range(10):
        t = context_table(*synthetic([0.75] * 4, seed=seed), CANDS, cost=cost)
        assert {bk.best_b for bk in t.buckets} <= {4, 6}
        if any(bk.best_b != t.overall_b for bk in t.buckets):
            differs += 1
            assert "within noise" in t.why
        assert not t.varies and t.chosen == [t.overall_b] * 4, t.why
    assert differs >= 5  # the rule above was exercised, not only tables whose buckets all agree


def test_too_few_rows_are_not_beyond_noise():
    x, tau = synthetic([0.9, 0.02], per=MIN_ROWS // 2)
    t = context_table(x, tau, CANDS, cost=cost_at(0.05), n=2)
    assert {bk.best_b for bk in t.buckets} == {8, 1}
    assert not t.varies and f"< {MIN_ROWS}" in t.why


@pytest.mark.parametrize("seed", range(6))
def test_buckets_non_empty_and_edges_monotone(seed):
    rng = np.random.default_rng(seed)
    for x in (rng.integers(1, 5000, 300), rng.choice([5, 5, 5, 9, 2000], 200), np.full(50, 7),
              np.r_[np.full(97, 3), [10, 11, 12]], rng.integers(1, 4, 7)):
        for n in (1, 2, 4, 8):
            e = length_buckets(x, n)
            assert np.all(np.diff(e) > 0) and e[0] == x.min() and e[-1] == x.max() + 1 and len(e) - 1 <= n
            counts = np.histogram(x, bins=e)[0]
            assert counts.min() > 0 and counts.sum() == len(x)
    assert len(length_buckets(np.full(50, 7), 4)) == 2  # all lengths equal: one bucket


def _check_ranges(entries):
    assert entries and all(len(e) == 5 and e[4] >= 0 for e in entries)
    bs = sorted({(e[0], e[1]) for e in entries})
    assert bs[0][0] == 1 and bs[-1][1] == 1024
    assert all(a[1] + 1 == b[0] and a[0] <= a[1] for a, b in zip(bs, bs[1:]))  # contiguous, no overlap
    assert [e[:2] for e in entries] == sorted(e[:2] for e in entries)  # sorted by batch range
    grids = set()
    for lo, hi in bs:  # vLLM's 5-item validator (utils.py at 14b450ca): ctx from 1, contiguous, the same in every row
        ctx = [tuple(e[2:4]) for e in entries if (e[0], e[1]) == (lo, hi)]
        assert ctx[0][0] == 1 and ctx[-1][1] == CTX_MAX
        assert all(a[1] + 1 == b[0] and a[0] <= a[1] for a, b in zip(ctx, ctx[1:]))
        grids.add(tuple(ctx))
    assert len(grids) == 1 and len(entries) == len(bs) * len(next(iter(grids)))  # rectangular
    return bs


def test_context_ranges_contiguous_and_merged():
    x, tau = synthetic([0.9, 0.75, 0.5, 0.02])
    tables = {c: context_table(x, tau, CANDS, cost=cost_at(s)) for c, s in ((1, 0.05), (8, 0.05), (64, 0.4))}
    entries = context_ranges(tables)
    bs = _check_ranges(entries)
    assert bs == [(1, 63), (64, 1024)]  # c = 1 and c = 8 have the same partition: one batch range
    low_load = [e for e in entries if e[0] == 1]
    assert low_load[0][4] == 7 and low_load[-1][4] == 0  # short prompts K = 7, long ones no speculation
    for e in entries:  # every K is the chosen b of the buckets its ctx range spans
        t = tables[max(c for c in tables if c <= max(e[0], 1))]
        ks = {b - 1 for bk, b in zip(t.buckets, t.chosen) if bk.ctx_hi >= e[2] and bk.ctx_lo <= e[3]}
        assert ks == {e[4]}
    # neighbouring context ranges stay apart only where some batch range tells them apart (the grid is shared)
    ctx = sorted({tuple(e[2:4]) for e in entries})
    k = {(e[0], tuple(e[2:4])): e[4] for e in entries}
    assert all(any(k[(lo, a)] != k[(lo, b)] for lo, _ in bs) for a, b in zip(ctx, ctx[1:]))
    # neighbouring batch ranges stay apart only where their K differ somewhere
    assert all(any(k[(a[0], x)] != k[(b[0], x)] for x in ctx) for a, b in zip(bs, bs[1:]))

    # a b the load check served that the labels never measured (b = 5): every context range at that load takes it
    served = context_ranges(tables, served={1: 4, 8: 4, 64: 5})
    assert {e[4] for e in served if e[0] == 64} == {4}
    assert {e[4] for e in served if e[0] < 64} == {e[4] for e in low_load}  # the other loads as before
    assert context_ranges(tables, no_speculation_from=64, served={64: 5})[-1][4] == 0  # measured K = 0 wins

    flat = context_table(*synthetic([0.75] * 4, seed=3), CANDS, cost=cost_at(0.05))
    one = context_ranges({4: flat, 32: flat})
    assert one == [[1, 1024, 1, CTX_MAX, flat.overall_b - 1]]
    with pytest.raises(ValueError):
        context_ranges({2048: flat})


def test_table_from_shards_reads_label_like_parquet(tmp_path):
    from pipeline.policy.blocksize import split_of

    x, tau = synthetic([0.9, 0.02], per=60)
    ids = [f"prompt-{i}" for i in range(len(x))]
    paths = []
    for k, part in enumerate((slice(0, 50), slice(50, None))):
        table = pa.table({"prompt_id": pa.array(ids[part], pa.string()),
                          "prompt_tokens": pa.array(x[part], pa.int32()),
                          "tau": pa.array(tau[part].tolist(), pa.list_(pa.float32()))})
        paths.append(tmp_path / f"part-{k:05d}.parquet")
        pq.write_table(table, paths[-1])
    tau32 = tau.astype(np.float32).astype(np.float64)
    every = table_from_shards(paths, CANDS, cost=cost_at(0.05), split=None, n=2)
    direct = context_table(x, tau32, CANDS, cost=cost_at(0.05), n=2)
    assert sum(b.rows for b in every.buckets) == len(x) and every.buckets == direct.buckets
    train = np.array([split_of(i, 0.3, 0.15) == "train" for i in ids])
    assert 0 < train.sum() < len(x)
    t = table_from_shards(paths, CANDS, split="train", n=2)
    assert t.buckets == context_table(x[train], tau32[train], CANDS, n=2).buckets
    with pytest.raises(ValueError):
        table_from_shards(paths, CANDS[:-1], split=None)


def _bucket(p, rows=MIN_ROWS, best=4):
    from pipeline.evaluation.context_length import Bucket

    return Bucket(1, 10, rows, [1.0], [1.0], [1.0], best, gain=(1.0, 0.5, 1.5), p=p)


def test_varies_is_decided_by_holm_over_every_bucket_at_every_load():
    """Holm's step-down over the whole family: p sorted, the i-th smallest passes at alpha / (m - i) while every
    smaller one passed. m counts every (bucket, other b) pair of the buckets of MIN_ROWS rows or more, also those
    whose best b is the base."""
    from pipeline.evaluation.context_length import ContextTable, decide

    def tables(*groups):
        return [ContextTable([1, 4], list(g), 1, "tau/cost") for g in groups]

    alone = tables([_bucket(0.02)])
    decide(alone)
    assert alone[0].varies and alone[0].tests == 1  # one test (b = 4 against the base b = 1): 0.02 < 0.05
    family = tables([_bucket(0.001), _bucket(0.02)], [_bucket(0.03), _bucket(None, best=1)])
    decide(family)  # m = 4: 0.001 <= 0.05/4 passes; 0.02 > 0.05/3 stops
    assert [b.beyond_noise for t in family for b in t.buckets] == [True, False, False, False]
    assert family[0].chosen == [4, 1] and family[1].chosen == [1, 1] and not family[1].varies
    assert "Holm over 4 test(s)" in family[1].why
    wide = [ContextTable([1, 2, 4], [_bucket(0.03)], 1, "tau/cost")]
    decide(wide)  # its best b was picked among 2 others: 2 tests, 0.03 > 0.05/2 (alone it would pass)
    assert wide[0].tests == 2 and not wide[0].varies
    few = tables([_bucket(1e-9, rows=MIN_ROWS - 1)])
    decide(few)
    assert not few[0].varies and few[0].tests == 0  # too few rows: never in the family, never counts


def test_with_no_length_effect_the_family_rarely_varies_where_uncorrected_tests_often_would():
    """20 buckets (4 at each of 5 loads) of one population whose best b ties with the base: the corrected family
    says "varies" at most ~5 % of the time; one-sided 95 % tests per bucket, uncorrected, fire far more often."""
    from pipeline.evaluation.context_length import decide

    _, big = synthetic([0.75], per=20000, seed=100)
    inv = (1 / big).mean(axis=0)
    cost = {1: 1.0, 2: 1.2, 3: 1.22, 4: 1.25, 6: 1.25 * inv[2] / inv[3], 8: 2.0}.get  # b = 4 and 6 tie
    corrected = uncorrected = 0
    runs = 60
    for seed in range(runs):
        tables = [context_table(*synthetic([0.75] * 4, per=150, seed=1000 * seed + c), CANDS, cost=cost, base_b=4)
                  for c in range(5)]
        uncorrected += any(b.p is not None and b.p < 0.05 and b.rows >= MIN_ROWS for t in tables for b in t.buckets)
        decide(tables)
        corrected += any(t.varies for t in tables)
    assert corrected / runs <= 0.1 and uncorrected / runs >= 0.3, (corrected, uncorrected)


def test_each_bucket_is_compared_with_the_base_b_the_3_item_form_serves():
    x, tau = synthetic([0.75] * 4, seed=3)
    free = context_table(x, tau, CANDS, cost=cost_at(0.05))
    other = next(b for b in CANDS if b != free.best_all)
    based = context_table(x, tau, CANDS, cost=cost_at(0.05), base_b=other)
    assert based.overall_b == other and based.best_all == free.best_all
    assert all(c in (other, bk.best_b) for c, bk in zip(based.chosen, based.buckets))
    with pytest.raises(ValueError, match="base b=5"):
        context_table(x, tau, CANDS, cost=cost_at(0.05), base_b=5)


def test_deploy_prints_the_5_item_form_with_the_3_item_schedules_k_as_a_json_block_needing_the_pr():
    from pipeline.evaluation import deploy
    from pipeline.evaluation.context_length import decide

    x, tau = synthetic([0.9, 0.75, 0.5, 0.02])
    schedule = {1: 4, 8: 4, 64: 3}  # the 3-item form's b at each c (after the load check)
    tables = {c: context_table(x, tau, CANDS, cost=cost_at(s), base_b=schedule[c])
              for c, s in ((1, 0.05), (8, 0.05), (64, 0.4))}
    decide(list(tables.values()))
    d = deploy.Deploy(run_dir="run", block_size=4, chosen_on="", train_b=4, target="t", draft="d", draft_note=None,
                      draft_revision=None, trust_remote_code=False, candidates=CANDS, rule_actions=[],
                      policy_answers_fallback_only=False, step_rule=None, schedule=schedule, context=tables)
    lines = deploy.context_lines(d)
    at = lines.index("```json")
    entries = json.loads(lines[at + 1])
    assert lines[at + 2] == "```" and entries == context_ranges(tables)
    assert any("needs a vLLM built from that PR" in x and "Holm over 60 tests" in x for x in lines)
    for lo, hi, a, z, k in entries:  # a bucket that is not beyond noise keeps the schedule's K at that load
        t = tables[max(c for c in tables if c <= lo)]
        buckets = [bk for bk in t.buckets if bk.ctx_hi >= a and bk.ctx_lo <= z]
        assert all(k == (bk.best_b if bk.beyond_noise else schedule[max(c for c in tables if c <= lo)]) - 1
                   for bk in buckets)
    # tune's load check measured no speculation faster at c = 64: K = 0 in every bucket there, and the line says so
    from dataclasses import replace

    assert tables[64].varies  # the model's buckets would speculate there
    checked = replace(d, load_check={"loads": {"64": {"b": 3, "kept": False, "serve": 1}}})
    lines = deploy.context_lines(checked)
    assert any(x.startswith("- c=64: best b varies") and "Served: K = 0 in every length bucket" in x for x in lines)
    entries = json.loads(lines[lines.index("```json") + 1])
    assert {e[4] for e in entries if e[0] >= 64} == {0}
