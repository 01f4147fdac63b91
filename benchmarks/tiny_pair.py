"""Benchmark the committed tiny target + DFlash draft pair (pipeline/assets).

    python benchmarks/tiny_pair.py                 # 64 stdlib-heldout prompts, b = 1..16
    python benchmarks/tiny_pair.py --check         # exit 1 if the acceptance bar is missed

T = 0, max_new_tokens 128, stop at <|endoftext|>. Prints the mean acceptance length tau (tokens
committed per verify step, bonus included) at each block size b, the share of prompts for
which each b in {6..10} is the argmax of tau (ties to the smaller b), and whether speculative
output equals plain autoregressive greedy output on every prompt for every b.

Acceptance bar (issue): mean tau at b = B = 8 >= 2.5; at least 3 of the 5 candidates are the
argmax for >= 5% of prompts each; lossless on all prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.tiny.measure import PairDecode, measure_pair  # noqa: E402


def decode(target, draft, input_ids, block_size, max_new_tokens, stop_token_ids) -> PairDecode:
    """One T=0 speculative generation at block size b -> output ids + tokens committed per step, with the
    product's engine (tested step for step against dflash's reference loop)."""
    from pipeline.decoding.engine import Engine

    engine = Engine(target, draft, stop_token_ids)
    res = engine.decode(engine.prefill(input_ids), block_size=block_size, max_new_tokens=max_new_tokens)
    return PairDecode(res.output_ids, list(res.committed))


def load_pair(assets: Path):
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "tiny-target")
    target = AutoModelForCausalLM.from_pretrained(assets / "tiny-target", dtype=torch.float32)
    draft = DFlashDraftModel.from_pretrained(assets / "tiny-draft", dtype=torch.float32)
    return tok, target.eval(), draft.eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--assets", type=Path, default=ROOT / "pipeline" / "assets")
    ap.add_argument("--prompts", type=int, default=64, help="first N stdlib-heldout prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-block", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--check", action="store_true", help="exit 1 if the acceptance bar fails")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pipeline.data.bundled import load_bundled

    tok, target, draft = load_pair(args.assets)
    B = draft.block_size
    eos = tok.eos_token_id
    prompts = load_bundled("stdlib-heldout")[: args.prompts]
    # The tiny target is a base model whose chat template renders the text raw.
    ids = [
        tok(p["text"], return_tensors="pt", add_special_tokens=False)["input_ids"] for p in prompts
    ]
    candidates = list(range(B - 2, B + 3))
    t0 = time.perf_counter()
    rep = measure_pair(
        target,
        draft,
        ids,
        block_sizes=range(1, args.max_block + 1),
        candidates=candidates,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=[eos],
        decode=decode,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    print(
        f"tiny pair: target {sum(p.numel() for p in target.parameters()):,} params, "
        f"draft {sum(p.numel() for p in draft.parameters()):,} params, trained B = {B}; "
        f"{len(ids)} stdlib-heldout prompts ({min(x.shape[1] for x in ids)}-"
        f"{max(x.shape[1] for x in ids)} tokens), T = 0, max_new_tokens {args.max_new_tokens}"
    )
    print(rep.format())
    share = rep.argmax_share()
    tau_b = rep.mean_tau(B)
    n_used = sum(1 for b in candidates if share[b] >= 0.05)
    checks = {
        f"mean tau at b={B} >= 2.5": tau_b >= 2.5,
        f"candidates that are the argmax for >= 5% of prompts: {n_used} >= 3": n_used >= 3,
        "lossless on all prompts": rep.all_lossless(),
    }
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "mean_tau": {b: rep.mean_tau(b) for b in rep.block_sizes},
                    "argmax_share": share,
                    "lossless": {b: all(v) for b, v in rep.lossless.items()},
                    "per_prompt_tau": {b: rep.tau[b] for b in rep.block_sizes},
                    "checks": checks,
                },
                indent=1,
            )
        )
    return 0 if (not args.check or all(checks.values())) else 1


if __name__ == "__main__":
    sys.exit(main())
