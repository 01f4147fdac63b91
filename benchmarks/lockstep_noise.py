"""How fair lockstep timing is (pipeline.decoding.batched.lockstep): identical decodes run in lockstep must measure
the same throughput. Runs three identical batched decodes (the bundled tiny pair, b = 4, the bundled evaluation
prompts, c = 16) in lockstep, in a fixed turn order and with the turn order rotating each round, interleaved over
repeats, and prints each turn position's throughput relative to the mean of the three.

    python benchmarks/lockstep_noise.py [--repeats 4] [--slots 16] [--prompts 96]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from label_noise import label_prompts  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    from pipeline.decoding.batched import BatchedEngine, fixed, lockstep
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    m = load_models(load_config([]).model)
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    prompts = label_prompts(m.tokenizer, a.prompts, 1 << 20, split="eval")
    engines = [BatchedEngine(engine) for _ in range(3)]
    rel = {True: [], False: []}
    for rep in range(a.repeats):
        for rotate in (False, True) if rep % 2 == 0 else (True, False):
            runs = lockstep([e.start(prompts, a.slots, a.max_new_tokens, fixed(4)) for e in engines], m.target,
                            rotate=rotate)
            tp = np.array([r.throughput for r in runs])
            rel[rotate].append(tp / tp.mean() - 1)
            print(f"repeat {rep + 1} rotate={rotate}: tok/s by turn position " + " ".join(f"{x:.0f}" for x in tp),
                  flush=True)
    print("\nturn order   throughput by turn position, relative to the mean of the three (mean over repeats)")
    for rotate in (False, True):
        r = np.array(rel[rotate])
        print(f"{'rotating' if rotate else 'fixed':<12} " + "  ".join(f"{x:+.2%}" for x in r.mean(0)) +
              f"   (max |difference| in one lockstep {np.abs(r).max():.2%})")


if __name__ == "__main__":
    main()
