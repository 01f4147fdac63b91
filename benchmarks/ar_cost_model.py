"""Where the cost model misses autoregressive decoding at load (issue #44: AR modelled 5-27 % fast at c = 16).

Reads a finished default run (its evaluation prompts and the cost profile train used), then at c = 16 on the batched
engine, one thread as evaluate's pass at load runs, interleaved over repeats:

* ``AR alone`` and ``b=8 alone``: each decode by itself (steps back to back, as the profile times them);
* ``AR | b=8 in lockstep``: the two in lockstep, as evaluate times every method (one forward of each in turn).

For every decode step it keeps the rows, the width and the measured seconds beside the ragged model's seconds for
the same step (pipeline.policy.load_cost.LoadCost.step_seconds), and prints measured / modelled per method and
protocol, overall and by the step's rows (full steps at c rows, and the ragged tail), so that the error is placed:
the tail's interpolation in c between profile grid points, the lockstep protocol, or the full steps themselves.

    python benchmarks/ar_cost_model.py [--run runs/default] [--repeats 5] [--concurrency 16]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from pipeline.io.layout import COST_PROFILE

BUCKETS = ((16, 16), (9, 15), (5, 8), (2, 4), (1, 1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=8)
    a = ap.parse_args(argv)
    from pipeline.decoding.batched import BatchedEngine, fixed, lockstep
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.io.shards import list_shards
    from pipeline.io.storage import read_table
    from pipeline.policy.cost import CostProfile
    from pipeline.policy.load_cost import LoadCost
    from pipeline.runtime.config import load_config

    run = Path(a.run)
    cfg = load_config([f"output_dir={run}"])
    torch.set_num_threads(1)
    m = load_models(cfg.model)
    engine = Engine(m.target, m.draft, m.stop_token_ids if cfg.decode.stop_on_eos else None)
    prompts = [p for s in list_shards(run / "eval" / "prompts")
               for p in read_table(s, columns=["input_ids"]).column("input_ids").to_pylist()]
    load = LoadCost.from_profile(CostProfile.load(run / "train" / "policy" / COST_PROFILE))
    c, b, n = a.concurrency, a.block_size, cfg.decode.max_new_tokens
    steps = defaultdict(list)  # (protocol, method) -> [(rows, measured, modelled)]
    order = [("alone", "AR"), ("alone", f"b={b}"), ("lockstep", "AR+b")]
    rng = np.random.default_rng(0)
    for rep in range(a.repeats):
        for i in rng.permutation(len(order)):
            proto, what = order[i]
            if proto == "alone":
                runs = {what: BatchedEngine(engine).run(prompts, c, n, fixed(1 if what == "AR" else b))}
            else:
                got = lockstep([BatchedEngine(engine).start(prompts, c, n, fixed(x)) for x in (1, b)], m.target)
                runs = {"AR": got[0], f"b={b}": got[1]}
            for meth, r in runs.items():
                for s in r.steps:
                    if s.kind == "decode":
                        steps[(proto, meth)].append((s.rows, s.draft_seconds + s.verify_seconds, load.step_seconds(
                            s.rows, s.verify_tokens, s.drafting, s.draft_tokens, s.width or None)))
        print(f"repeat {rep + 1}/{a.repeats} done", flush=True)
    print(f"\nc={c}, {len(prompts)} prompts, max_new_tokens={n}, profile grid c={load.concurrency}; "
          "measured / modelled seconds of the decode steps (> 1: the model is fast)")
    head = "protocol  method  all steps        " + "  ".join(f"rows {lo}-{hi}".ljust(18) for lo, hi in BUCKETS)
    print(head)
    for (proto, meth), xs in sorted(steps.items()):
        rows = np.array([x[0] for x in xs])
        me, mo = np.array([x[1] for x in xs]), np.array([x[2] for x in xs])
        cells = []
        for lo, hi in BUCKETS:
            k = (rows >= lo) & (rows <= hi)
            cells.append(f"{me[k].sum() / mo[k].sum():.3f} ({k.mean():.0%})".ljust(18) if k.any() else "-".ljust(18))
        print(f"{proto:<9} {meth:<7} {me.sum() / mo.sum():.3f} ({len(xs)})".ljust(34) + "  ".join(cells))
    print("(in brackets: the share of the method's steps in that bucket; all steps: the step count)")


if __name__ == "__main__":
    main()
