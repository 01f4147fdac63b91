"""Labelling throughput: the paper's method vs a shared prefill vs exact greedy replay, on the same prompts.

    python benchmarks/label_throughput.py                  # 24 held-out prompts, T = 0, max_new_tokens 128, k = 2
    python benchmarks/label_throughput.py --prompts 48 --max-new-tokens 256

Methods, all labelling every candidate b in {B-k .. B+k} of every prompt:
  naive       the paper's method: each candidate decoded independently, each with its own prefill
  exhaustive  one shared prefill, then a full speculative decode per candidate (label.mode=exhaustive)
  replay      one target decode at B, then every other candidate replayed with the draft alone, all candidates
              in lockstep: one draft forward per round for every candidate's current start (label.mode=replay)
  replay-seq  the same replay, one draft forward per start per candidate
  replay-all  the same replay, proposals for every start x every candidate up front (the issue's stretch)

The methods run round-robin prompt by prompt (this machine is noisy: whatever slows one slows all), and each
method's labels (tau, steps, label) are compared with naive's. Ends with the line
`ratio replay/naive = X.XX (labels identical: yes|no)`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.config import ModelConfig, load_config  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.labeling import (  # noqa: E402
    _labels,
    candidate_block_sizes,
    label_prompt,
    replay_label_prompt,
)
from pipeline.models import load_models  # noqa: E402
from pipeline.sources import build_prompts  # noqa: E402


def naive(engine, ids, cands, max_new):
    """BlockPilot's public scripts: every candidate is a complete, independent generation (prefill included)."""
    per_b = {}
    state = None
    for b in cands:
        state = engine.prefill(ids)
        r = engine.decode(state, block_size=b, max_new_tokens=max_new)
        per_b[b] = {"committed": r.committed, "new_tokens": r.new_tokens, "seconds": r.decode_seconds}
    return _labels(state, cands, per_b, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 = what one CPU label actor uses)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, ... (the engine's timers synchronise on CUDA)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto (bf16 on CUDA)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    m = load_models(ModelConfig(dtype=args.dtype, device=args.device))
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    cfg = load_config()
    rows, _, _ = build_prompts(cfg.prepare.sources, m.tokenizer, cfg.prepare.max_prompt_tokens, limit=args.prompts)
    cands = candidate_block_sizes(engine.trained_block_size, args.k)
    methods = {
        "naive": lambda ids: naive(engine, ids, cands, args.max_new_tokens),
        "exhaustive": lambda ids: label_prompt(engine, ids, cands, args.max_new_tokens),
        "replay": lambda ids: replay_label_prompt(engine, ids, cands, args.max_new_tokens, proposer="lockstep"),
        "replay-seq": lambda ids: replay_label_prompt(engine, ids, cands, args.max_new_tokens, proposer="sequential"),
        "replay-all": lambda ids: replay_label_prompt(engine, ids, cands, args.max_new_tokens, proposer="all_starts"),
    }
    seconds = {k: 0.0 for k in methods}
    agree = {k: True for k in methods}
    print(f"{len(rows)} prompts on {m.device}/{str(m.dtype).replace('torch.', '')}, candidates {cands}, "
          f"max_new_tokens {args.max_new_tokens}, "
          f"{args.threads} thread(s), target {sum(p.numel() for p in m.target.parameters()) / 1e6:.1f}M params, "
          f"draft {sum(p.numel() for p in m.draft.parameters()) / 1e6:.1f}M")
    for i, row in enumerate(rows):
        ids = torch.tensor(row["input_ids"], device=m.device)[None]
        ref = None
        for name, fn in methods.items():
            t0 = time.perf_counter()
            out = fn(ids)
            seconds[name] += time.perf_counter() - t0
            key = (out.tau, out.steps, out.label_index)
            ref = key if ref is None else ref
            agree[name] &= key == ref
        if (i + 1) % 8 == 0:
            print(f"  {i + 1}/{len(rows)} prompts", flush=True)
    n = len(rows)
    print(f"\n{'method':<12} {'prompts/s':>10} {'s/prompt':>9} {'vs naive':>9}  labels = naive's")
    for name in methods:
        print(f"{name:<12} {n / seconds[name]:>10.3f} {seconds[name] / n:>9.3f} "
              f"{seconds['naive'] / seconds[name]:>8.2f}x  {'yes' if agree[name] else 'NO'}")
    ratio = seconds["naive"] / seconds["replay"]
    print(f"ratio replay/naive = {ratio:.2f} (labels identical: {'yes' if agree['replay'] else 'no'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
