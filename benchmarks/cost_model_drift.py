"""Is the cost model wrong, or did the machine change? (issue #44, point 3: modelled within 3 % at every c.)

evaluate checks the cost model against a profile the label workers measured minutes earlier, on a shared machine
whose speed moves by tens of percent between the two (the default runs' modelled / measured seconds at c = 1 were
0.62, 0.73 and 1.35 on three days). This separates that drift from the model's own error. On a finished run, in
rounds, each round:

1. a fresh cost profile of the same points (`pipeline.decoding.load_profile.profile_with_load`, the label worker's
   code, c = 1 and the evaluated loads) on this process's engine, one thread;
2. right after it, the methods timed as evaluate times them: at c = 1 each prompt prefilled once and every method
   decoded from it (the method order shuffled per prompt); at each c > 1 every method's batched run in lockstep.

Then each method's decodes are modelled under (a) the run's own profile (what train used: evaluate's check) and
(b) the round's fresh profile, and the mean |speedup error| vs AR (modelled speedup / measured speedup - 1, per
method, AR excluded) is printed per c and profile, with every method's ratio.

    python benchmarks/cost_model_drift.py [--run runs/default] [--rounds 3] [--block-sizes 1,4,8,12]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from pipeline.io.layout import COST_PROFILE


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-sizes", default="1,4,8,12", help="the methods: b = 1 is AR")
    ap.add_argument("--loads", default="1,16", help="the concurrencies timed (each must be in the run's profile)")
    ap.add_argument("--json", default=None, help="write every number here too")
    a = ap.parse_args(argv)
    from pipeline.decoding.batched import BatchedEngine, fixed, lockstep
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.load_profile import profile_with_load
    from pipeline.decoding.models import load_models
    from pipeline.io.shards import list_shards
    from pipeline.io.storage import read_table
    from pipeline.labelling.labels import candidate_block_sizes
    from pipeline.policy.cost import CostProfile
    from pipeline.policy.load_cost import LoadCost
    from pipeline.runtime.config import load_config
    from stages.label import trained_block_size

    run = Path(a.run)
    sizes = [int(x) for x in a.block_sizes.split(",")]
    loads = [int(x) for x in a.loads.split(",")]
    cfg = load_config([f"output_dir={run}", f"profile.concurrency=[{','.join(map(str, sorted({1, *loads})))}]"])
    torch.set_num_threads(1)  # as a label worker and evaluate's actor run on a CPU
    m = load_models(cfg.model)
    engine = Engine(m.target, m.draft, m.stop_token_ids if cfg.decode.stop_on_eos else None)
    B = trained_block_size(cfg)
    cands = candidate_block_sizes(B, cfg.label.k)
    prompts = [p for s in list_shards(run / "eval" / "prompts")
               for p in read_table(s, columns=["input_ids"]).column("input_ids").to_pylist()]
    n = cfg.decode.max_new_tokens
    run_profile = CostProfile.load(run / "train" / "policy" / COST_PROFILE)
    rng = np.random.default_rng(0)
    # (round, c, method) -> list of (measured seconds, {profile name: modelled seconds})
    got = defaultdict(list)
    profile_wall, fresh_fits = [], []
    for rnd in range(a.rounds):
        t0 = time.perf_counter()
        fresh = profile_with_load(engine, cfg, B, cands, {"worker": f"drift-round-{rnd}"})
        profile_wall.append(time.perf_counter() - t0)
        fresh_fits.append({c: part["fit"] for c, part in (fresh.meta.get("load") or {}).items()})
        profiles = {"run": run_profile, "fresh": fresh}
        for c in loads:
            if c == 1:
                for ids in prompts:
                    state = engine.prefill(torch.tensor([ids]))
                    for i in rng.permutation(len(sizes)):
                        b = sizes[i]
                        res = engine.decode(state, block_size=b, max_new_tokens=n)
                        got[(rnd, c, b)].append((res.decode_seconds, {
                            k: p.decode_seconds(res.verified, b, context=res.num_input_tokens)
                            for k, p in profiles.items()}))
            else:
                costs = {k: LoadCost.from_profile(p) for k, p in profiles.items()}
                order = [sizes[i] for i in rng.permutation(len(sizes))]
                runs = lockstep([BatchedEngine(engine).start(prompts, c, n, fixed(b)) for b in order], m.target)
                for b, r in zip(order, runs):
                    dec = [s for s in r.steps if s.kind == "decode"]
                    got[(rnd, c, b)].append((sum(s.draft_seconds + s.verify_seconds for s in dec),
                                             {k: lc.run_seconds(r.steps) for k, lc in costs.items()}))
        print(f"round {rnd + 1}/{a.rounds}: profile {profile_wall[-1]:.1f} s, round "
              f"{time.perf_counter() - t0:.1f} s", flush=True)

    out = {"run": str(run), "rounds": a.rounds, "block_sizes": sizes, "loads": loads, "prompts": len(prompts),
           "max_new_tokens": n, "profile_seconds": profile_wall, "fresh_load_fits": fresh_fits,
           "run_load_fits": {c: part["fit"] for c, part in (run_profile.meta.get("load") or {}).items()}, "by_c": {}}
    print(f"\n{len(prompts)} prompts, {n} new tokens, {a.rounds} rounds; ratio = modelled / measured decode "
          "seconds (summed over prompts and rounds); error = modelled speedup over AR / measured one - 1")
    for c in loads:
        out["by_c"][c] = {}
        for prof in ("run", "fresh"):
            ratio, per_round = {}, defaultdict(list)
            for b in sizes:
                me = sum(x[0] for r in range(a.rounds) for x in got[(r, c, b)])
                mo = sum(x[1][prof] for r in range(a.rounds) for x in got[(r, c, b)])
                ratio[b] = mo / me
                for r in range(a.rounds):
                    per_round[b].append(sum(x[1][prof] for x in got[(r, c, b)]) / sum(x[0] for x in got[(r, c, b)]))
            # At T = 0 every method commits the same tokens, so the speedup over AR is AR's seconds / b's, and
            # (mo_AR / mo_b) / (me_AR / me_b) - 1 = ratio_AR / ratio_b - 1.
            err = {b: ratio[1] / ratio[b] - 1 for b in sizes if b != 1}
            err_round = {b: [per_round[1][r] / per_round[b][r] - 1 for r in range(a.rounds)] for b in sizes if b != 1}
            mean_abs = float(np.mean([abs(e) for e in err.values()]))
            out["by_c"][c][prof] = {"ratio": ratio, "speedup_error": err, "speedup_error_by_round": err_round,
                                    "mean_abs_speedup_error": mean_abs,
                                    "mean_abs_by_round": [float(np.mean([abs(err_round[b][r]) for b in err_round]))
                                                          for r in range(a.rounds)]}
            print(f"c={c:<3} {prof:5} profile: mean |speedup error| {mean_abs:6.2%} (by round: "
                  + ", ".join(f"{x:.2%}" for x in out['by_c'][c][prof]['mean_abs_by_round']) + ")  ratios "
                  + "  ".join(f"b={b}:{ratio[b]:.3f}" for b in sizes))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
