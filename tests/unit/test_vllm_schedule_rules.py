"""deploy's vLLM batch-size schedule obeys vLLM's own checks, for the default config and every published one.

The rules are restated here from vLLM's source, independently of deploy's own checker
(pipeline.policy.load_cost.vllm_schedule_errors), from vllm-project/vllm ``vllm/v1/spec_decode/dynamic/utils.py`` at
commit a6f6bb1d3c1707ede85d03a7c7d47a105a1873fc:

* validate_and_normalize_dynamic_sd_schedule: a non-empty list; every entry a 3-item (range_start, range_end,
  num_speculative_tokens); both bounds positive, start <= end; K >= 0; sorted by start, each start > the previous
  end; the first range starts at 1;
* build_dynamic_sd_schedule_lookup: ``vllm_num_speculative_tokens`` > 0 (also ``Field(gt=0)`` on
  SpeculativeConfig.num_speculative_tokens in vllm/config/speculative.py), and each K is used as
  min(num_speculative_tokens, K): a K above it would be clipped, i.e. another K than deployed.

Each config's schedules: its candidates (B - k .. B + k, B the draft's block size: 8 for the bundled tiny draft,
16 for the z-lab drafts the published configs name) and no speculation (b = 1), over its profile.concurrency grid,
every b*(c) the chooser can return drawn at random (seeded), plus the extremes (AR everywhere, AR nowhere).
"""

import itertools
import json
import shlex

import numpy as np
import pytest

from pipeline.evaluation import deploy
from pipeline.policy.load_cost import vllm_ranges, vllm_schedule_errors
from pipeline.runtime.config import load_config, published_configs


def vllm_accepts(schedule, num_speculative_tokens) -> bool:
    """vLLM's checks (see the module docstring), written out as its source does them."""
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens <= 0:
        return False
    if not isinstance(schedule, list) or not schedule:
        return False
    parsed = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            return False
        start, end, k = int(entry[0]), int(entry[1]), int(entry[2])
        if start <= 0 or end <= 0 or start > end or k < 0 or k > num_speculative_tokens:
            return False
        parsed.append((start, end, k))
    parsed.sort(key=lambda e: e[0])
    previous_end = 0
    for start, end, _ in parsed:
        if start <= previous_end:
            return False
        previous_end = end
    return parsed[0][0] == 1


CONFIGS = {"default": None, **{f"published:{n}": f"published:{n}" for n in sorted(published_configs())}}


def _grid(name):
    cfg = load_config([], CONFIGS[name])
    B = cfg.label.block_size or (8 if str(cfg.model.draft).startswith("bundled:") else 16)
    cands = list(range(B - cfg.label.k, B + cfg.label.k + 1))
    return cands, [int(c) for c in cfg.profile.concurrency]


def _deploy(schedule, cands):
    return deploy.Deploy(run_dir="run", block_size=schedule[min(schedule)] if schedule[min(schedule)] > 1 else cands[0],
                         chosen_on="test", train_b=cands[0], target="t", draft="d", draft_note=None,
                         draft_revision=None, trust_remote_code=False, candidates=cands, rule_actions=[],
                         policy_answers_fallback_only=False, step_rule=None, schedule=schedule)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_schedule_deploy_prints_for_a_config_passes_vllms_checks(name):
    cands, grid = _grid(name)
    assert grid[0] == 1  # the grid starts at c = 1: the first range starts there
    rng = np.random.default_rng(0)
    options = [1, *cands]
    schedules = [{c: 1 for c in grid}, {c: cands[-1] for c in grid}, {c: cands[0] if i == 0 else 1
                                                                       for i, c in enumerate(grid)}]
    schedules += [{c: int(rng.choice(options)) for c in grid} for _ in range(50)]
    printed = 0
    for sched in schedules:
        spec = deploy.vllm_schedule_config(_deploy(sched, cands))
        if max(sched.values()) == 1:  # no speculation at any load: no speculative config at all
            assert spec is None
            continue
        ranges = spec["num_speculative_tokens_per_batch_size"]
        assert vllm_accepts(ranges, spec["num_speculative_tokens"]), (name, sched, ranges)
        assert json.loads(json.dumps(spec)) == spec  # it prints as the JSON vLLM parses
        # each grid point's K is b*(c) - 1, 0 where b*(c) = 1
        for c, b in sched.items():
            assert next(k for lo, hi, k in ranges if lo <= c <= hi) == b - 1
        printed += 1
    assert printed >= 40


@pytest.mark.parametrize("bad, why", [
    ([], "non-empty"), ([[1, 4, 3, 0]], "3-item"), ([[0, 4, 3]], "positive"), ([[1, 4, 3], [3, 8, 2]], "overlapping"),
    ([[2, 4, 3]], "start at 1"), ([[1, 4, -1]], "K -1 < 0"), ([[5, 3, 1]], "start 5 > end 3"),
    ([[1, 4, 9]], "clip")])
def test_deploys_checker_refuses_what_vllm_refuses(bad, why):
    assert not vllm_accepts(bad, 8)
    errors = vllm_schedule_errors(bad, 8)
    assert errors and any(why in e for e in errors), errors


def test_num_speculative_tokens_zero_is_refused_so_all_k0_prints_plain_serving():
    assert vllm_schedule_errors([[1, 1024, 0]], 0) and not vllm_accepts([[1, 1024, 0]], 0)
    d = _deploy({1: 1, 4: 1, 16: 1}, [4, 5, 6])
    assert deploy.vllm_schedule_config(d) is None
    text = "\n".join(deploy.load_lines(d))
    assert "without --speculative-config" in text and "K = 0 at c in [1, 4, 16]" in text


def test_k0_ranges_where_no_speculation_wins_and_the_crossover():
    sched = {1: 8, 2: 8, 4: 6, 8: 1, 16: 1, 32: 1}
    assert vllm_ranges(sched) == [[1, 3, 7], [4, 7, 5], [8, 1024, 0]]
    assert deploy.crossover(sched) == 8
    assert deploy.crossover({1: 1, 4: 6, 16: 1}) == 16  # AR at c = 1 alone is no crossover: speculation wins at 4
    assert deploy.crossover({1: 8, 4: 6}) is None
    lines = deploy.load_lines(_deploy(sched, [4, 6, 8]))
    assert any("K = 0 at c in [8, 16, 32]" in x and "from c = 8 on" in x for x in lines)
    # the command printed for vLLM carries the schedule computed above, as vLLM parses it
    command = next(x for x in lines if x.startswith("vLLM: `vllm serve"))
    spec = json.loads(shlex.split(command.split("`")[1])[-1])
    assert spec["num_speculative_tokens_per_batch_size"] == vllm_ranges(sched) and spec["num_speculative_tokens"] == 7
    # SGLang's adaptive config takes no DFlash: deploy sets no value for it, only the one block size it has
    sglang = next(x for x in lines if x.startswith("SGLang:"))
    assert "--speculative-num-draft-tokens" in sglang and "--speculative-adaptive-config '" not in sglang


def test_all_pairs_of_neighbouring_ks_merge_only_when_equal():
    for a, b in itertools.product([1, 2, 5], repeat=2):
        r = vllm_ranges({1: a, 16: b})
        assert (len(r) == 1) == (a == b) and vllm_accepts(r, 4)
