"""The accelerator checks of benchmarks/gpu_check.sh that need Python: engine exactness and replay agreement.

    python benchmarks/gpu_check.py engine --device cuda --dtype bfloat16 --out DIR
    python benchmarks/gpu_check.py replay --device cuda --dtype bfloat16 --out DIR

``engine``: random tiny pairs (tests/random_pair.py) on the device, every b in {1, 2, B-1, B, B+3}: our engine
against ``dflash.model.dflash_generate`` (token ids and per-step acceptance lists must be identical: the same
arithmetic) and against the target's plain greedy loop (lossless; in bf16 a near-tie in the target's argmax can
legitimately differ between a block verify and a one-token step, so this is reported as an agreement rate).

``replay``: exact greedy replay (label.mode=replay) against exhaustive labelling, prompt by prompt (tau, steps,
per-step committed lists, label), on the bundled tiny pair and on a random pair with Qwen3-8B's shapes at reduced
depth (on ``--device cpu`` the widths are scaled down too, and the summary says so). In bf16 a block's shape
changes the rounding, so agreement below 100 % is a finding to report, not a crash.

Each writes ``DIR/<check>-<device>-<dtype>.json``; gpu_check.sh prints them in one summary block.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
from dflash import model as dflash_model  # noqa: E402

from pipeline.decoding.engine import Engine, greedy_reference  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _timer(device: str) -> None:
    # dflash's return_stats timer calls torch.cuda.synchronize(): fine on CUDA, impossible on a CPU-only torch.
    if device == "cpu":
        dflash_model._cuda_time = time.perf_counter


def check_engine(device: str, dtype: torch.dtype, seeds=range(4), max_new: int = 40) -> dict:
    from random_pair import EOS_ID, make_pair, prompt

    B = 4
    out = {"cases": 0, "ids_equal_dflash": 0, "steps_equal_dflash": 0, "lossless_vs_greedy": 0, "failures": []}
    for seed in seeds:
        target, draft = make_pair(seed, block_size=B)
        target, draft = target.to(device, dtype), draft.to(device, dtype)
        engine = Engine(target, draft, stop_token_ids=[EOS_ID])
        ids = prompt(seed).to(device)
        state = engine.prefill(ids)
        greedy = greedy_reference(target, ids, max_new, [EOS_ID])
        for b in (1, 2, B - 1, B, B + 3):
            res = engine.decode(state, block_size=b, max_new_tokens=max_new)
            ref = dflash_model.dflash_generate(draft, target, ids, max_new, [EOS_ID], temperature=0.0,
                                               block_size=b, return_stats=True)
            out["cases"] += 1
            same_ids = torch.equal(res.output_ids, ref.output_ids)
            out["ids_equal_dflash"] += same_ids
            out["steps_equal_dflash"] += res.committed == ref.acceptance_lengths
            out["lossless_vs_greedy"] += torch.equal(res.output_ids, greedy)
            if not same_ids or res.committed != ref.acceptance_lengths:
                out["failures"].append({"seed": seed, "b": b})
    out["ok"] = out["ids_equal_dflash"] == out["steps_equal_dflash"] == out["cases"]
    return out


def _random_8b_pair(device: str, dtype: torch.dtype, narrow: bool, seed: int = 0):
    """A random Qwen3 target + DFlash draft with Qwen3-8B's shapes (36 layers cut to 4), lm_head tilted as in
    tests/random_pair.py so that draft and target agree often enough for acceptance to vary."""
    from dflash.model import DFlashDraftModel, build_target_layer_ids
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    shape = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128)
    if narrow:  # CPU smoke run: the same vocabulary and head layout ratios at 1/32 of the width (at 1/8, the
        # V x hidden lm_head of every step took ~2 minutes of a CPU check that only has to run)
        shape = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=1,
                     head_dim=32)
    vocab, layers = 151936, 4
    common = dict(vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-6, **shape)
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, tie_word_embeddings=False, eos_token_id=vocab - 2,
                                          **common)).eval()
    draft_cfg = Qwen3Config(num_hidden_layers=1, num_target_layers=layers, **common)
    draft_cfg.dflash_config = {"block_size": 16, "mask_token_id": vocab - 1,
                               "target_layer_ids": build_target_layer_ids(layers, 1)}
    draft = DFlashDraftModel(draft_cfg).eval()
    with torch.no_grad():
        w = target.lm_head.weight
        u = torch.randn(w.shape[1])
        u /= u.norm()
        w[3] += 0.3 * u
        w[4] -= 0.3 * u
    return target.to(device, dtype), draft.to(device, dtype)


def _agreement(engine, prompts, candidates, max_new: int) -> dict:
    from pipeline.labelling.labels import label_prompt
    from pipeline.labelling.replay import replay_candidates

    out = {"prompts": 0, "labels_equal": 0, "tau_equal": 0, "committed_equal": 0, "disagreements": []}
    for i, ids in enumerate(prompts):
        ref = label_prompt(engine, ids, candidates, max_new)
        state = engine.prefill(ids)
        rep = replay_candidates(engine, state, candidates, max_new)
        committed = {b: engine.decode(state, block_size=b, max_new_tokens=max_new).committed for b in candidates}
        rep_tau = [sum(rep[b]["committed"]) / max(1, len(rep[b]["committed"])) if rep[b]["committed"] else 1.0
                   for b in candidates]
        out["prompts"] += 1
        out["tau_equal"] += rep_tau == ref.tau
        out["committed_equal"] += all(rep[b]["committed"] == committed[b] for b in candidates)
        same_label = candidates[max(range(len(rep_tau)), key=lambda j: (rep_tau[j], -j))] == ref.label_block_size
        out["labels_equal"] += same_label
        if rep_tau != ref.tau:
            out["disagreements"].append({"prompt": i, "replay_tau": rep_tau, "exhaustive_tau": ref.tau})
    return out


def check_replay(device: str, dtype: torch.dtype, prompts: int, max_new: int, narrow: bool) -> dict:
    from pipeline.runtime.config import ModelConfig
    from pipeline.labelling.labels import candidate_block_sizes
    from pipeline.decoding.models import load_models
    from pipeline.data.sources import build_prompts
    from pipeline.runtime.config import load_config

    m = load_models(ModelConfig(device=device, dtype=str(dtype).replace("torch.", "")))
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    cfg = load_config()
    rows, _, _ = build_prompts(cfg.prepare.sources, m.tokenizer, cfg.prepare.max_prompt_tokens, limit=prompts)
    tiny = _agreement(engine, [torch.tensor(r["input_ids"], device=device)[None] for r in rows],
                      candidate_block_sizes(engine.trained_block_size, 2), max_new)
    target, draft = _random_8b_pair(device, dtype, narrow)
    big = Engine(target, draft, stop_token_ids=[target.config.eos_token_id])
    g = torch.Generator().manual_seed(0)
    big_prompts = [torch.randint(0, 151930, (1, 48), generator=g).to(device) for _ in range(max(1, prompts // 4))]
    qwen = _agreement(big, big_prompts, candidate_block_sizes(16, 2), max_new)
    qwen["shapes"] = "Qwen3-8B widths at 1/32 (CPU smoke run)" if narrow else "Qwen3-8B widths, 4 target layers"
    return {"tiny_pair": tiny, "random_8b_shapes": qwen,
            "ok": tiny["labels_equal"] == tiny["prompts"] and qwen["labels_equal"] == qwen["prompts"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=["engine", "replay"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--out", default="runs/gpu-check")
    ap.add_argument("--prompts", type=int, default=32, help="replay: tiny-pair prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    _timer(args.device)
    t0 = time.perf_counter()
    dtype = DTYPES[args.dtype]
    if args.check == "engine":
        result = check_engine(args.device, dtype)
    else:
        result = check_replay(args.device, dtype, args.prompts, args.max_new_tokens, narrow=args.device == "cpu")
    result.update(check=args.check, device=args.device, dtype=args.dtype,
                  seconds=round(time.perf_counter() - t0, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.check}-{args.device.replace(':', '')}-{args.dtype}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, default=str))
    if not result["ok"]:
        print(f"{args.check} check FAILED on {args.device} {args.dtype}: "
              f"{json.dumps(result.get('failures') or result, default=str)[:2000]}", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
