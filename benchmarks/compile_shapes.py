"""engine.compile with dynamo's duck shapes on (torch's default) against off (pipeline.decoding.compiled.DUCK_SHAPES),
side by side: graphs built, compile CPU seconds, and the compiled step's time afterwards, tokens compared.

Each side runs in a fresh interpreter with a fresh inductor cache (dynamo's caches and counters are process-wide), on
tests/integration/test_compiled.py's workload, imported from it (``workload``, ``decode_all``): a random pair (2-layer target),
10 prompts of 1-29 tokens decoded at batch 1 over b in (1, 2, 3, 5, 8) and once more as one continuous batch, 12 new
tokens. Then, compiled and warm, the batch-1 decode of the same prompts at b = 8 is timed over --rounds rounds
(median ms per step). Sides alternate per round.

    .venv/bin/python benchmarks/compile_shapes.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    sys.path.insert(0, str(p))


def one_side(duck: bool) -> dict:
    import torch

    import pipeline.decoding.compiled as compiled_mod
    from pipeline.decoding.engine import Engine
    from integration.test_compiled import NEW, decode_all, workload
    from random_pair import EOS_ID

    torch.set_num_threads(1)
    compiled_mod.DUCK_SHAPES = duck
    target, draft, prompts = workload()
    engine = Engine(target, draft, [EOS_ID])
    eager = decode_all(engine, prompts)
    compiled_mod.apply_compile(SimpleNamespace(target=target, draft=draft), "on")
    torch._dynamo.utils.counters.clear()
    t = time.process_time()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = decode_all(engine, prompts)
    compile_cpu = time.process_time() - t
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    steps = []
    for p in prompts:  # warm: every graph the b = 8 decode needs is built above
        state = engine.prefill(torch.tensor([p]))
        t = time.perf_counter()
        res = engine.decode(state, 8, NEW)
        steps.append((time.perf_counter() - t) / max(1, len(res.committed)))
    return {"duck": duck, "graphs": graphs, "compile_cpu_s": compile_cpu, "step_ms": 1e3 * statistics.median(steps),
            "equal_eager": out == eager,
            "fallback": [compiled_mod.compile_state(m)["fallback"] for m in (target.model, draft)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", choices=["duck", "noduck"], help=argparse.SUPPRESS)  # one side, in its own process
    a = ap.parse_args(argv)
    if a.side:
        print(json.dumps(one_side(a.side == "duck")))
        return 0
    rows = []
    for r in range(a.rounds):
        for side in (("duck", "noduck") if r % 2 == 0 else ("noduck", "duck")):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
                proc = subprocess.run([sys.executable, __file__, "--side", side], env=env, capture_output=True,
                                      text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {side:>6}: {rows[-1]}", flush=True)
    print("\n| duck shapes | graphs | compile CPU-s (median) | compiled step at b = 8, ms (median) | tokens = eager |")
    print("| --- | ---: | ---: | ---: | --- |")
    for duck in (True, False):
        mine = [x for x in rows if x["duck"] == duck]
        print(f"| {'on (torch default)' if duck else 'off (shipped)'} | {sorted({x['graphs'] for x in mine})} | "
              f"{statistics.median(x['compile_cpu_s'] for x in mine):.1f} | "
              f"{statistics.median(x['step_ms'] for x in mine):.3f} | {all(x['equal_eager'] for x in mine)} |")
    def median(key, duck):
        return statistics.median(x[key] for x in rows if x["duck"] == duck)

    print(f"\nratio off/on: compile CPU {median('compile_cpu_s', False) / median('compile_cpu_s', True):.2f}x, "
          f"step {median('step_ms', False) / median('step_ms', True):.2f}x")
    return 0 if all(x["equal_eager"] and x["fallback"] == [None, None] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
