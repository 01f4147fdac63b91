"""Labelling throughput: the paper's method vs exact greedy replay at batch 1 vs batched replay, on the same prompts.

    python benchmarks/label_throughput.py                  # 64 held-out prompts, T = 0, max_new_tokens 128, k = 2
    python benchmarks/label_throughput.py --k 4 --batch-size 32 --rounds 2
    python benchmarks/label_throughput.py --methods naive,exhaustive,replay,replay-seq,replay-all,batched

Methods, all labelling every candidate b in {B-k .. B+k} of every prompt:
  naive       the paper's method: each candidate decoded independently, each with its own prefill
  exhaustive  one shared prefill, then a full speculative decode per candidate (label.mode=exhaustive)
  replay      one target decode at B, then every other candidate replayed with the draft alone, all candidates
              in lockstep: one draft forward per round for every candidate's current start (label.mode=replay)
  replay-seq  the same replay, one draft forward per start per candidate
  replay-all  the same replay, proposals for every start x every candidate up front (the issue's stretch)
  batched     batched replay (pipeline/labelling/batched.py, label.batch_size): one batched greedy decode of the target
              (features captured on the way), the draft's walks lockstep and batched across prompts

Default methods: naive, replay, batched. The methods run round-robin (length-sorted batches of --batch-size
prompts, as the label stage forms them): each batch in --rounds rounds, each round the batch-1 methods on one slice
of the batch, prompt by prompt, then batched replay on the whole batch (its time: the mean of its --rounds runs,
which must give the same labels). This machine is noisy, and whatever slows one slows all. Each method's labels (tau, steps, label) are compared with
naive's, prompt by prompt. Ends with the line `ratio batched/naive = X.XX (labels agree: N/M)`.
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

from pipeline.runtime.config import ModelConfig, load_config  # noqa: E402
from pipeline.decoding.engine import Engine  # noqa: E402
from pipeline.labelling.labels import (  # noqa: E402
    assemble_labels,
    candidate_block_sizes,
    label_prompt,
    replay_label_prompt,
)
from pipeline.labelling.batched import batched_replay_label_prompts, length_sorted_chunks  # noqa: E402
from pipeline.decoding.models import load_models  # noqa: E402
from pipeline.data.sources import build_prompts  # noqa: E402


def naive(engine, ids, cands, max_new):
    """BlockPilot's public scripts: every candidate is a complete, independent generation (prefill included)."""
    per_b = {}
    state = None
    for b in cands:
        state = engine.prefill(ids)
        r = engine.decode(state, block_size=b, max_new_tokens=max_new)
        per_b[b] = {"committed": r.committed, "new_tokens": r.new_tokens, "seconds": r.decode_seconds}
    return assemble_labels(state, cands, per_b, None)


def _key(labels):
    return labels.tau, labels.steps, labels.label_index


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=None, help="batched replay's batch (default: label.batch_size)")
    ap.add_argument("--methods", default="naive,replay,batched",
                    help="comma-separated, from naive, exhaustive, replay, replay-seq, replay-all, batched")
    ap.add_argument("--rounds", type=int, default=4,
                    help="batched runs per batch, interleaved with the batch-1 methods' slices of it (see above)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 = what one CPU label actor uses)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, ... (the engine's timers synchronise on CUDA)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto (bf16 on CUDA)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    m = load_models(ModelConfig(dtype=args.dtype, device=args.device))
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    cfg = load_config()
    batch_size = args.batch_size or cfg.label.batch_size
    rows, _, _ = build_prompts(cfg.prepare.sources, m.tokenizer, cfg.prepare.max_prompt_tokens, limit=args.prompts)
    cands = candidate_block_sizes(engine.trained_block_size, args.k)
    one = {
        "naive": lambda ids: naive(engine, ids, cands, args.max_new_tokens),
        "exhaustive": lambda ids: label_prompt(engine, ids, cands, args.max_new_tokens),
        "replay": lambda ids: replay_label_prompt(engine, ids, cands, args.max_new_tokens, proposer="lockstep"),
        "replay-seq": lambda ids: replay_label_prompt(engine, ids, cands, args.max_new_tokens, proposer="sequential"),
        "replay-all": lambda ids: replay_label_prompt(engine, ids, cands, args.max_new_tokens, proposer="all_starts"),
    }
    methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    unknown = set(methods) - set(one) - {"batched"}
    if unknown or "naive" not in methods:
        ap.error(f"--methods needs naive and known methods (unknown: {sorted(unknown)})")
    seconds = {k: 0.0 for k in methods}
    agree = {k: 0 for k in methods}
    print(f"{len(rows)} prompts on {m.device}/{str(m.dtype).replace('torch.', '')}, candidates {cands}, "
          f"max_new_tokens {args.max_new_tokens}, batch size {batch_size}, "
          f"{args.threads} thread(s), target {sum(p.numel() for p in m.target.parameters()) / 1e6:.1f}M params, "
          f"draft {sum(p.numel() for p in m.draft.parameters()) / 1e6:.1f}M")
    done = 0
    for chunk in length_sorted_chunks([r["prompt_tokens"] for r in rows], batch_size):
        ids = [torch.tensor(rows[i]["input_ids"], device=m.device)[None] for i in chunk]
        outs = {name: [] for name in methods}
        rounds = max(1, min(args.rounds, len(ids)))
        for r in range(rounds):
            # Round r: the batch-1 methods on the r-th slice of the batch, then the whole batch batched; batched's
            # time is its mean over the rounds. A slow spell of this shared machine then falls on every method.
            part = ids[r * len(ids) // rounds:(r + 1) * len(ids) // rounds]
            for name in methods:
                t0 = time.perf_counter()
                if name == "batched":
                    got = batched_replay_label_prompts(engine, ids, cands, args.max_new_tokens)
                    seconds[name] += (time.perf_counter() - t0) / rounds
                    if r == 0:
                        outs[name] = got
                    elif [_key(o) for o in got] != [_key(o) for o in outs[name]]:
                        raise RuntimeError("batched replay gave different labels on a repeat of the same batch")
                else:
                    outs[name] += [one[name](x) for x in part]
                    seconds[name] += time.perf_counter() - t0
        for name in methods:
            agree[name] += sum(_key(o) == _key(r) for o, r in zip(outs[name], outs["naive"]))
        done += len(chunk)
        print(f"  {done}/{len(rows)} prompts", flush=True)
    n = len(rows)
    print(f"\n{'method':<12} {'prompts/s':>10} {'s/prompt':>9} {'vs naive':>9}  labels = naive's")
    for name in methods:
        print(f"{name:<12} {n / seconds[name]:>10.3f} {seconds[name] / n:>9.3f} "
              f"{seconds['naive'] / seconds[name]:>8.2f}x  {agree[name]}/{n}")
    if "replay" in methods:
        print(f"ratio replay/naive = {seconds['naive'] / seconds['replay']:.2f} (labels agree: {agree['replay']}/{n})")
    if "batched" in methods:
        ratio = seconds["naive"] / seconds["batched"]
        print(f"ratio batched/naive = {ratio:.2f} (labels agree: {agree['batched']}/{n})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
