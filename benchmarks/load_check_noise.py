"""Where tune's load check gets its noise (issue #52): the per-repeat spread of the paired log ratio it decides on.

The check (pipeline.evaluation.load_check) times b*(c) against AR at c on the label set's val prompts, both decoded in
lockstep each repeat, and decides on log(b's tok/s / AR's tok/s) over the full steps (all c rows running). Its
intervals on default runs implied a per-repeat spread of 3-14 %, where evaluate's lockstep A/A pair measured 0.59 %
(benchmarks/results/lockstep-noise.md). This times, on the bundled tiny pair, c = 16, the default's prompt count and
budget, with the repeats interleaved:

- ``A/A``: b against an identical b (two engines, the same choices), in lockstep: the timing's own spread;
- ``AR/b lockstep``: what the check runs;
- ``AR/b one after another``: what it runs when the memory plan fits one engine;

and prints, per pairing and per throughput (full steps, whole run, steps while both runs are live), the mean log
ratio, its per-repeat standard deviation, and the same without the first repeat (warm-up).

    python benchmarks/load_check_noise.py [--repeats 8] [--prompts 64] [--slots 16] [--b 4]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from label_noise import label_prompts  # noqa: E402


def _tp(run, c: int):
    decode = [s for s in run.steps if s.kind == "decode"]
    full = [s for s in decode if s.rows == c]
    sec = lambda ss: sum(s.draft_seconds + s.verify_seconds for s in ss)  # noqa: E731
    return {"whole": run.throughput, "full": sum(s.committed for s in full) / sec(full) if full else float("nan")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", help="write the spreads here")
    ap.add_argument("--kinds", default="A/A,AR/b lockstep,AR/b one after another")
    a = ap.parse_args(argv)
    from pipeline.decoding.batched import BatchedEngine, fixed, lockstep
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    m = load_models(load_config([]).model)
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    prompts = label_prompts(m.tokenizer, a.prompts, 1 << 20, split="label")
    e1, e2 = BatchedEngine(engine), BatchedEngine(engine)
    c, n = a.slots, a.max_new_tokens

    def pair(kind):
        if kind == "A/A":
            r = lockstep([e1.start(prompts, c, n, fixed(a.b)), e2.start(prompts, c, n, fixed(a.b))], m.target)
        elif kind == "AR/b lockstep":
            r = lockstep([e1.start(prompts, c, n, fixed(a.b)), e2.start(prompts, c, n, fixed(1))], m.target)
        else:
            r = [lockstep([e.start(prompts, c, n, fixed(bb))], m.target) [0] for e, bb in ((e1, a.b), (e2, 1))]
        x, y = _tp(r[0], c), _tp(r[1], c)
        got = {k: math.log(x[k] / y[k]) for k in x}
        if kind != "AR/b one after another":  # the steps of both while both had every row running
            from pipeline.evaluation.load import window_throughputs

            px, py = window_throughputs(r, c)
            got["paired"] = math.log(px / py)
        return got

    kinds = a.kinds.split(",")
    got = {k: [] for k in kinds}
    for rep in range(a.repeats):
        for k in (kinds if rep % 2 == 0 else kinds[::-1]):
            got[k].append(pair(k))
            print(f"repeat {rep + 1} {k}: " + ", ".join(f"{t} {v:+.4f}" for t, v in got[k][-1].items()), flush=True)
    print(f"\nper-repeat log ratio (b={a.b} over the other; c={c}, {len(prompts)} label prompts, {n} new tokens, "
          f"{a.repeats} repeats interleaved)")
    print(f"{'pairing':<24} {'throughput':<8} {'mean':>8} {'sd':>7} {'sd without repeat 1':>20}")
    spreads = {}
    for k in kinds:
        for t in ("full", "whole", "paired"):
            if t not in got[k][0]:
                continue
            v = np.array([g[t] for g in got[k]])
            spreads[f"{k} {t}"] = {"mean": float(v.mean()), "sd": float(v.std(ddof=1)),
                                   "sd_without_first": float(v[1:].std(ddof=1)), "ratios": v.tolist()}
            print(f"{k:<24} {t:<8} {v.mean():+8.4f} {v.std(ddof=1):7.2%} {v[1:].std(ddof=1):20.2%}")
    if a.json:
        import json

        Path(a.json).write_text(json.dumps({"settings": vars(a), "spreads": spreads}, indent=1) + "\n")


if __name__ == "__main__":
    main()
