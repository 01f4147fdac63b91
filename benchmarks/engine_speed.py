"""Issue #45 on this CPU, side by side in one run (the bundled tiny pair, fp32, one thread):

1. the batch-1 step at b = 8, eager against ``torch.compile`` (engine.compile=on: pipeline/decoding/compiled.py),
   rounds interleaved, the compile's seconds apart, tokens compared;
2. where the eager step's time goes: a torch.profiler table of the step's operators (self CPU time), and the
   share of the step's wall time the operators account for (the rest: Python, dispatch, the engine's bookkeeping);
3. labelling one batch of prompts (label.batch_size) with the target continuation one-token greedy against
   speculative at B (pipeline/labelling/continuation.py), rounds interleaved, labels compared, beside what a cost
   profile predicted for each (--profile: a run's cost_profile.json).

    python benchmarks/engine_speed.py [--prompts 64] [--rounds 3] [--profile runs/default/labels/cost_profile.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def step_ms(engine, states, b, new):
    """ms per decode step (draft + verify) over every state's decode at b, and the decodes' tokens."""
    seconds, steps, toks = 0.0, 0, []
    for s in states:
        r = engine.decode(s, b, new)
        seconds += r.draft_seconds + r.verify_seconds
        steps += r.steps
        toks.append(r.new_ids.tolist())
    return seconds / steps * 1e3, toks


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--profile", default=None)
    a = ap.parse_args(argv)
    from pipeline.data.sources import build_prompts
    from pipeline.decoding.compiled import compile_forward
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.labelling.batched import batched_replay_label_prompts
    from pipeline.labelling.continuation import ContinuationChoice
    from pipeline.labelling.labels import candidate_block_sizes
    from pipeline.policy.cost import CostProfile
    from pipeline.runtime.config import ModelConfig, load_config

    torch.set_num_threads(1)
    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    rows, _, _ = build_prompts(load_config().prepare.sources, m.tokenizer, 1024, limit=max(1, a.prompts // 5 + 1))
    prompts = [r["input_ids"] for r in rows][:a.prompts]
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    b, new = a.block_size, a.max_new_tokens
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), b={b}, "
          f"max_new_tokens={new}, torch {torch.__version__}, 1 thread", flush=True)

    # 1. batch-1 step, eager vs compiled
    with torch.inference_mode():
        states = [engine.prefill(torch.tensor([p])) for p in prompts[:16]]
    eager_fw = (m.target.model.forward, m.draft.forward)
    t0 = time.perf_counter()
    compile_forward(m.target.model, "target")
    compile_forward(m.draft, "draft")
    compiled_fw = (m.target.model.forward, m.draft.forward)
    step_ms(engine, states, b, new)  # the first call compiles
    compile_s = time.perf_counter() - t0
    times = {"eager": [], "compiled": []}
    tokens = {}
    for r in range(a.rounds):
        for name, (tf, df) in (("eager", eager_fw), ("compiled", compiled_fw))[::1 if r % 2 == 0 else -1]:
            m.target.model.forward, m.draft.forward = tf, df
            ms, toks = step_ms(engine, states, b, new)
            times[name].append(ms)
            tokens[name] = toks
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    print(f"\n1. batch-1 step at b={b} (16 prompts, {a.rounds} interleaved rounds, median):")
    print(f"   eager {e:.3f} ms  compiled {c:.3f} ms  ratio compiled/eager {c / e:.3f}  "
          f"(rounds eager {[round(x, 3) for x in times['eager']]}, compiled {[round(x, 3) for x in times['compiled']]})")
    print(f"   compile paid: {compile_s:.1f} s (first decode pass included); tokens identical: "
          f"{tokens['eager'] == tokens['compiled']}")

    # 2. where the eager step goes
    m.target.model.forward, m.draft.forward = eager_fw
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        ms, _ = step_ms(engine, states[:4], b, new)
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    ops = sorted((x for x in ev if x.key.startswith("aten::")), key=lambda x: -x.self_cpu_time_total)
    total_ops = sum(x.self_cpu_time_total for x in ops) / 1e6
    print(f"\n2. the eager step profiled (4 decodes, {wall:.2f} s wall under the profiler, {ms:.3f} ms a step): "
          f"aten operators' self time {total_ops:.2f} s = {total_ops / wall:.0%} of wall; the rest is Python, "
          f"dispatch and the engine's bookkeeping")
    print(f"   {'operator':<34} {'calls':>7} {'self ms':>9} {'share':>6}")
    for x in ops[:12]:
        print(f"   {x.key:<34} {x.count:>7} {x.self_cpu_time_total / 1e3:>9.1f} "
              f"{x.self_cpu_time_total / 1e6 / wall:>6.1%}")

    # 3. labelling one batch: greedy vs speculative continuation, eager; greedy with the compiled forwards
    cands = candidate_block_sizes(b, 4)

    def label(way):
        m.target.model.forward, m.draft.forward = compiled_fw if way == "greedy compiled" else eager_fw
        return batched_replay_label_prompts(engine, prompts, cands, new, trace_block_size=b + b // 4,
                                            continuation_block_size=b if way == "speculative" else None)
    t0 = time.perf_counter()
    label("greedy compiled")  # compiles the batched greedy decode's shapes
    compile_greedy_s = time.perf_counter() - t0
    ways = ["greedy", "speculative", "greedy compiled"]
    seconds = {w: [] for w in ways}
    labels = {}
    for r in range(a.rounds):
        for way in ways[r % 3:] + ways[:r % 3]:
            t0 = time.perf_counter()
            out = label(way)
            seconds[way].append(time.perf_counter() - t0)
            labels[way] = [(o.tau, o.steps, o.label_index) for o in out]
    med = {w: statistics.median(x) for w, x in seconds.items()}
    print(f"\n3. labelling {len(prompts)} prompts as one batch, candidates {cands[0]}..{cands[-1]} "
          f"({a.rounds} interleaved rounds, median seconds; ratio to eager greedy):")
    for w in ways:
        print(f"   {w:<16} {len(prompts) / med[w]:6.2f} prompts/s  {med[w]:7.2f} s  {med[w] / med['greedy']:.3f}  "
              f"labels = eager greedy's: {labels[w] == labels['greedy']}")
    print(f"   (the compiled greedy's first batch, compiling: {compile_greedy_s:.1f} s)")
    if a.profile:
        choice = ContinuationChoice("auto", b, CostProfile.load(a.profile))
        tau = [t[0][cands.index(b)] for t in labels["greedy"]]
        choice.observe(tau)
        way = choice.choose(len(prompts), new)
        print(f"   the profile's prediction ({a.profile}): {choice.describe()} -> {way}")


if __name__ == "__main__":
    main()
