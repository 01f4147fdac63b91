"""Issue 68: vLLM's "no speculation" is two options (plain vLLM; K = 0 inside a speculative server, which still runs
the drafter), deploy chooses among plain / one fixed K / one schedule / a routed split from them, and the check's
verdicts (stages.deploy_check.judge) fire on measured figures, each branch here with figures injected."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.evaluation.vllm_options import FIXED, K0_ESTIMATE, PLAIN, SCHEDULE, SPLIT, choose, price
from pipeline.policy.vllm_sweep import _point, sweep_profile
from stages.deploy_check import check_loads, judge

CANDS = [2, 4, 8]
TAU = np.tile([1.8, 3.0, 4.0], (50, 1))  # tau at b = 2, 4, 8 on every train row


def cost(b, c):  # seconds per step: 10 ms, + 5 % per verified token of the batch
    return 0.010 * (1 + 0.05 * b * c)


def test_a_speculative_run_at_k0_is_its_own_entry_never_plain():
    base = {"max_concurrency": 16, "output_throughput": 1000.0, "mean_tpot_ms": 10.0, "completed": 8,
            "num_prompts": 8, "failed": 0}
    plain = _point(dict(base), "plain")
    k0 = _point({**base, "mean_tpot_ms": 18.0, "speculative_config": {
        "method": "dflash", "num_speculative_tokens": 7, "num_speculative_tokens_per_batch_size": [[1, 1024, 0]]}},
        "k0")
    k3 = _point({**base, "mean_tpot_ms": 20.0, "spec_decode_acceptance_length": 2.5,
                 "speculative_config": {"method": "dflash", "num_speculative_tokens": 3}}, "k3")
    assert not plain.speculative and not plain.speculative_k0
    assert k0.k == 0 and k0.speculative_k0 and not k3.speculative_k0
    d = sweep_profile([plain, k0, k3], "x")
    assert d["seconds"]["1"] == pytest.approx(0.010)  # b = 1 is plain vLLM's 10 ms, not the K = 0 server's 18
    assert d["speculative_k0"] == {"16": pytest.approx(0.018)}
    without_plain = sweep_profile([k0, k3], "x")  # K = 0 in a speculative server never stands in for plain
    assert "1" not in without_plain["seconds"] and without_plain["speculative_k0"] == {"16": pytest.approx(0.018)}


def test_the_schedules_k0_is_priced_as_the_drafter_and_deploy_routes_plain_there():
    loads = [1, 4, 16]
    sched = {1: 8, 4: 4, 16: 1}  # the cost model's b*(c): K = 0 at c = 16
    # measured: a speculative server's K = 0 step at c = 16 costs 1.8x plain's (the 0.547x of issue 68)
    o = choose(price(TAU, CANDS, cost, loads, 8, sched, k0_seconds={16: 1.8 * cost(1, 16)}))
    assert o.k0[16] == "measured" and o.k[SCHEDULE][16] == 0
    assert o.ratio(16, SCHEDULE) == pytest.approx(1 / 1.8)  # not 1.000x: K = 0 is not plain vLLM
    assert o.chosen == SPLIT and o.speculative == SCHEDULE
    assert o.serve == {1: SCHEDULE, 4: SCHEDULE, 16: PLAIN}
    assert o.pays(1) and o.pays(4) and not o.pays(16)
    assert "plain vLLM is fastest at c in [16]" in o.why
    # unmeasured: estimated as a b = 2 step, and said so
    est = price(TAU, CANDS, cost, loads, 8, sched)
    assert est.k0[16] == K0_ESTIMATE and est.tokens_per_s[SCHEDULE][16] == pytest.approx(16 / cost(2, 16))


def test_one_option_fastest_everywhere_is_deployed_alone_simplest_first():
    cheap = lambda b, c: 0.010 * (1 + 0.001 * b)  # noqa: E731  speculation pays at every load
    o = choose(price(TAU, CANDS, cheap, [1, 4, 16], 8, {1: 8, 4: 8, 16: 8}))
    assert o.chosen == FIXED and o.serve == {1: FIXED, 4: FIXED, 16: FIXED}  # the schedule equals it: one K
    dear = lambda b, c: 0.010 * (1 + 1.0 * (b - 1))  # noqa: E731  speculation never pays
    o = choose(price(TAU, CANDS, dear, [1, 4, 16], 2, {1: 2, 4: 2, 16: 2}))
    assert o.chosen == PLAIN and not any(o.pays(c) for c in o.loads)


def test_the_check_covers_one_the_middle_and_the_largest_load():
    assert check_loads([1, 2, 4, 8, 16], 64) == [1, 4, 16]
    assert check_loads([1, 2, 4, 8, 16], 8) == [1, 4, 8]  # the machine's max_num_seqs bounds it
    assert check_loads([1, 16], 64) == [1, 16]


def _m(**kw):
    m = {"c": 16, "running": 16, "serves": SCHEDULE, "k": 0, "pays": True, "modelled": 1.2,
         "served": [550.0, 560.0, 540.0], "plain": [1000.0, 1010.0, 990.0], "fixed": None, "fixed_k": 7,
         "exact": True, "same": 64, "total": 64, "drafted": [0], "allowed": [0, 3, 7]}
    m.update(kw)
    return m


def test_each_failure_branch_fires_on_its_figures():
    slower = judge(_m())
    assert len(slower) == 1 and slower[0].startswith("c=16: the served configuration (schedule, K=0) ran 550.0 "
                                                     "tok/s against plain vLLM's 1000.0")
    assert "slower beyond noise where deploy said speculation pays (modelled 1.200x plain)" in slower[0]
    assert judge(_m(pays=False)) == []  # deploy did not claim it there
    assert judge(_m(served=[990.0, 1020.0, 1000.0])) == []  # within noise
    assert judge(_m(served=None)) == []  # plain served: nothing to compare
    # c = 1: slower than the fixed K deploy would otherwise print
    one = judge(_m(c=1, running=1, served=None, serves=PLAIN, pays=False, plain=[180.0, 185.0, 183.0],
                   fixed=[250.0, 248.0, 252.0], drafted=[], allowed=[]))
    assert len(one) == 1 and one[0].startswith("c=1: the served configuration (plain vLLM, K=0) ran 182.7 tok/s "
                                               "against the fixed K=7's 250.0") and "slower beyond noise at c = 1" \
        in one[0]
    # tokens: exact in float32, an agreement rate otherwise
    tok = judge(_m(pays=False, same=63))
    assert tok == ["c=16: speculation changed the tokens of 1 of 64 prompts at T = 0 in float32 (exact there)"]
    assert judge(_m(pays=False, same=50, exact=False)) == []
    drafted = judge(_m(pays=False, drafted=[0, 9]))
    assert drafted == ["c=16: drafted K [0, 9], but the configuration sets [0, 3, 7] at 1..16 running requests"]
    few = judge(_m(running=7))
    assert few[0].startswith("c=16 (7 running: fewer val prompts than c): ")


@pytest.mark.parametrize("key,value", [("vllm.check_repeats", 1), ("vllm.check_prompts", 0)])
def test_a_bad_check_setting_fails_fast_naming_the_key(key, value):
    from pipeline.runtime.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([f"{key}={value}"])


def test_the_checks_measured_verdict_makes_deploy_serve_plain_there():
    from pipeline.evaluation.vllm_options import apply_verdicts

    o = choose(price(TAU, CANDS, cost, [1, 4, 16], 8, {1: 8, 4: 4, 16: 1},
                     k0_seconds={16: 1.8 * cost(1, 16)}))
    assert o.serve == {1: SCHEDULE, 4: SCHEDULE, 16: PLAIN}
    config = {PLAIN: "null", SCHEDULE: '{"k": "schedule"}', FIXED: '{"k": 7}'}.get
    other = {"4|x": {"c": 4, "config": '{"k": 7}', "slower": True, "why": "another configuration"}}
    assert apply_verdicts(o, config, other).serve[4] == SCHEDULE and not o.measured  # not what deploy serves
    within = {"4|s": {"c": 4, "config": '{"k": "schedule"}', "slower": False, "why": "within noise"}}
    assert apply_verdicts(o, config, within).serve[4] == SCHEDULE
    lost = {"4|s": {"c": 4, "config": '{"k": "schedule"}', "slower": True,
                    "why": "the speculative server measured -31.8% [-48.9%, -9.9%] over 10 repeats against plain"}}
    apply_verdicts(o, config, lost)
    assert o.serve == {1: SCHEDULE, 4: PLAIN, 16: PLAIN} and o.chosen == SPLIT
    assert "c=4: the speculative server measured -31.8%" in o.why and o.measured == {4: lost["4|s"]["why"]}


def test_a_check_within_noise_does_not_erase_a_measured_loss():
    from stages.deploy_check import merge_verdicts

    lost = {"4|s": {"c": 4, "ci95": [-0.405, -0.029], "slower": True}}
    noise = {"4|s": {"c": 4, "ci95": [-0.542, 0.749], "slower": False}}
    won = {"4|s": {"c": 4, "ci95": [0.05, 0.30], "slower": False}}
    assert merge_verdicts(lost, noise) == lost
    assert merge_verdicts(lost, won) == won and merge_verdicts(noise, lost) == lost
    assert merge_verdicts({}, noise) == noise


def test_a_small_b_the_load_check_kept_is_priced_by_a_bound_and_said_so():
    o = price(TAU[:, 1:], [4, 8], cost, [1, 16], 8, {1: 8, 16: 3}, k0_seconds={})  # b = 3 never labelled
    bound = np.mean(cost(3, 16) / np.minimum(TAU[:, 1], 3))  # tau at b = 4, at most 3
    assert o.tokens_per_s[SCHEDULE][16] == pytest.approx(16 / bound)
    assert o.notes == ["b=3 was never labelled: its tau bounded by min(b, tau at b=4)"]
