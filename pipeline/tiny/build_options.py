"""The tiny builder's command line (``python -m pipeline.tiny.build --help``): every size, step count, wall-time cap
and seed of the build, with the defaults the bundled pair was built with; ``--quick`` swaps in tiny step counts, fewer
prompts and a smaller mix for a smoke run (about two minutes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.tiny import corpus as tcorpus


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.tiny.build",
        description="Build the embedded tiny target + DFlash draft pair and bundled prompts.",
    )
    ap.add_argument("--out", type=Path, default=Path("pipeline/assets"), help="asset root")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny step counts (~2 min)")
    ap.add_argument(
        "--kinds",
        default=None,
        help="comma-separated kinds of text, of " + ",".join(tcorpus.KIND_ORDER) + " (default: every kind whose "
        "source is installed; a missing one is skipped with the apt package to install). `--kinds code` is the "
        "stdlib-only build of before",
    )
    ap.add_argument(
        "--weights",
        default=None,
        help="shares of the training stream's characters, e.g. code=0.3,docs=0.25 (default "
        + ",".join(f"{k}={v}" for k, v in tcorpus.DEFAULT_WEIGHTS.items())
        + "; normalised over the kinds built)",
    )
    ap.add_argument(
        "--mix-chars", type=int, default=28_000_000,
        help="characters of the mixed training stream (about 7.5M tokens; the target sees ~7.4M)",
    )
    ap.add_argument(
        "--chat-frac", type=float, default=0.2,
        help="with a dialogue kind: share of each other kind's characters given as chat-formatted "
        "continuations (<|user|>prefix<|assistant|>rest), what chat-templated prompts of that kind look like",
    )
    ap.add_argument(
        "--draft-chat-frac", type=float, default=0.5,
        help="with a dialogue kind: share of the draft's generation prompts that end at <|assistant|>",
    )
    ap.add_argument("--maths-problems", type=int, default=40_000, help="generated maths problems (ids 0..N-1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--target-layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-batch", type=int, default=32)
    ap.add_argument("--target-steps", type=int, default=900)
    ap.add_argument(
        "--target-minutes", type=float, default=12.0, help="wall-time cap for target training"
    )
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--val-windows", type=int, default=128)
    ap.add_argument("--gen-groups", type=int, default=64, help="generation batches")
    ap.add_argument("--gen-batch", type=int, default=64, help="sequences per generation batch")
    ap.add_argument("--gen-prompt-min", type=int, default=32)
    ap.add_argument("--gen-prompt-max", type=int, default=256)
    ap.add_argument("--gen-new", type=int, default=160, help="generated tokens per sequence")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-intermediate", type=int, default=512)
    ap.add_argument(
        "--target-layer-ids", type=str, default="1,2,3", help="target layers feeding the draft"
    )
    ap.add_argument("--draft-steps", type=int, default=2500)
    ap.add_argument(
        "--draft-minutes", type=float, default=10.0, help="wall-time cap for draft training"
    )
    ap.add_argument("--draft-batch", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    ap.add_argument("--draft-lr", type=float, default=6e-4)
    ap.add_argument("--gamma", type=float, default=3.5, help="loss decay (7 for B=16 -> 3.5)")
    ap.add_argument(
        "--n-prompts", type=int, default=1000, help="prompts per kind (split ~90/10 into label / eval)"
    )
    ap.add_argument("--n-stdlib-prompts", type=int, default=2000, help="stdlib-heldout prompts")
    ap.add_argument(
        "--eval-prompts", type=int, default=16, help="eval prompts PER KIND for the tau and loss tables"
    )
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument(
        "--reuse-target",
        type=Path,
        default=None,
        help="take the target from this directory (an earlier build) instead of training it",
    )
    ap.add_argument(
        "--skip-prompts", action="store_true", help="do not (re)write assets/prompts"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.target_steps = 30
        args.target_batch = 8
        args.val_windows = 16
        args.gen_groups = 2
        args.gen_batch = 16
        args.gen_new = 48
        args.draft_steps = 30
        args.draft_batch = 8
        args.n_prompts = 200
        args.n_stdlib_prompts = 200
        args.eval_prompts = 2
        args.log_every = 10
        args.mix_chars = min(args.mix_chars, 3_000_000)
        args.maths_problems = min(args.maths_problems, 4_000)
    return args


__all__ = ["parse_args"]
