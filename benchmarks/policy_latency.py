"""The policy on logits vs the folded policy on the final hidden state: parameters and batch-1 latency, side by side.

    python benchmarks/policy_latency.py            # the tiny pair's sizes, and V = 151,936 / H = 4,096 (Qwen3-8B)

The folded form (BlockSizePolicy.fold) folds the target's lm_head into the MLP's first layer, so it reads H values
instead of V. At the tiny pair's sizes the real models are used (a real prefill, then both forms from its output);
at Qwen3-8B's sizes random weights of the right shapes (latency depends only on shapes). Each latency is the median
of --reps timed calls after warm-up, forms interleaved. Ends with the tiny target's prefill for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.policy.blocksize import BlockSizeMLP, BlockSizePolicy  # noqa: E402


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(name: str, policy: BlockSizePolicy, folded: BlockSizePolicy, logits, hidden, reps: int) -> None:
    p_plain = sum(p.numel() for p in policy.model.parameters())
    p_fold = sum(p.numel() for p in folded.model.parameters())
    t_plain = timed(lambda: policy.choose(logits), reps)
    t_fold = timed(lambda: folded.choose(hidden), reps)
    print(f"{name:<28} {'logits':>8} {p_plain / 1e6:>10.2f}M {t_plain * 1e3:>10.3f} ms")
    print(f"{'':<28} {'folded':>8} {p_fold / 1e6:>10.2f}M {t_fold * 1e3:>10.3f} ms   "
          f"params {p_plain / p_fold:.1f}x fewer, latency {t_plain / t_fold:.1f}x lower")
    return t_plain, t_fold


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=2048, help="the MLP's width (the paper's 2048)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from pipeline.runtime.config import ModelConfig, load_config
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.data.sources import build_prompts

    m = load_models(ModelConfig(device="cpu", dtype="float32"))
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    rows, _, _ = build_prompts(load_config().prepare.sources, m.tokenizer, 1024, limit=8)
    ids = torch.tensor(rows[0]["input_ids"])[None]
    state = engine.prefill(ids)
    print(f"{args.threads} thread(s), MLP width {args.hidden}, batch 1, median of {args.reps}\n")
    print(f"{'sizes':<28} {'form':>8} {'params':>11} {'latency':>13}")
    torch.manual_seed(0)
    V, H = m.vocab_size, m.target.config.hidden_size
    policy = BlockSizePolicy(BlockSizeMLP(V, 5, args.hidden), [6, 7, 8, 9, 10], V)
    t_plain, t_fold = compare(f"tiny pair V={V}, H={H}", policy, policy.fold(m.target.lm_head), state.logits,
                              state.hidden, args.reps)
    prefill = timed(lambda: engine.prefill(ids), max(5, args.reps // 3))
    V8, H8 = 151936, 4096
    big = BlockSizePolicy(BlockSizeMLP(V8, 5, args.hidden), [14, 15, 16, 17, 18], V8)
    big_folded = BlockSizePolicy(BlockSizeMLP(H8, 5, args.hidden), [14, 15, 16, 17, 18], H8, info={"input": "hidden"})
    compare(f"Qwen3-8B V={V8}, H={H8}", big, big_folded, torch.randn(V8), torch.randn(H8), args.reps)
    print(f"\ntiny target prefill ({ids.shape[1]} tokens): {prefill * 1e3:.2f} ms; policy / prefill: logits "
          f"{t_plain / prefill:.1%}, folded {t_fold / prefill:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
