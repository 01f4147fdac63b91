"""Measured inputs for the GPU labelling estimate: a Qwen3-8B-shaped target and DFlash-b16-shaped draft on one GPU.

    python benchmarks/gpu_label_costs.py                       # needs CUDA; ~3 minutes on an H200
    python benchmarks/gpu_label_costs.py --prompt-tokens 1024 --batches 16,64 --tau 6.5 --new-tokens 2048

No hub download is possible here, so both models have RANDOM weights with the published shapes: the target is
Qwen3-8B's config (36 layers, hidden 4096, 32/8 heads, V = 151,936, bf16), the draft a 5-layer DFlashDraftModel of
the same width reading target layers [1, 9, 17, 25, 33] (the z-lab Qwen3-8B-DFlash-b16 layout). Random weights
make every acceptance length 1, so this benchmark measures COSTS, not acceptance, through the product's own code:

  prefill        Engine.prefill of one prompt (batch 1)
  step(b)        Engine.decode at block size b: one draft forward of b rows + one target verify of b positions
                 (batch 1), in seconds per step
  decode_step(P) pipeline.labelling.greedy.greedy_continuations at batch P (static KV cache, feature hooks): seconds per
                 generated token of the whole batch, and its prefill
  propose(P)     DraftRunner.propose at batch P: ONE draft forward over every candidate's block of every
                 prompt (P x sum(candidates) rows), read at the first proposal of each block
  read_row       the draft's last-layer row work + lm_head + argmax, per extra proposal row read

and then combines them, with the stated acceptance length tau (--tau, the same for every candidate) and
generation length (--new-tokens), into prompts per hour of the paper's method (every candidate decoded on its own,
each with its prefill) and of batched replay. Those two lines are an ESTIMATE from measured step costs, not a
measured labelling run; context length is held at --prompt-tokens + --steps (the average context of a
--new-tokens generation from a short prompt is about --prompt-tokens here). Writes --out (JSON) as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.labelling.greedy import greedy_continuations  # noqa: E402
from pipeline.labelling.runner import DraftRunner  # noqa: E402
from pipeline.decoding.engine import Engine  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
DRAFT_LAYERS = 5
TARGET_LAYER_IDS = [1, 9, 17, 25, 33]
MASK_TOKEN_ID = 151669  # z-lab's drafts' mask id in Qwen3's vocabulary (any id < V would do: random weights)


def build_pair(device, dtype):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    tcfg = Qwen3Config(**QWEN3_8B)
    tcfg._attn_implementation = "sdpa"
    dcfg = Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": DRAFT_LAYERS},
                       num_target_layers=tcfg.num_hidden_layers, block_size=16,
                       dflash_config={"block_size": 16, "mask_token_id": min(MASK_TOKEN_ID, tcfg.vocab_size - 1),
                                      "target_layer_ids": [i for i in TARGET_LAYER_IDS
                                                           if i < tcfg.num_hidden_layers]})
    dcfg._attn_implementation = "sdpa"
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(tcfg).eval()
            draft = DFlashDraftModel(dcfg).eval()
    finally:
        torch.set_default_dtype(saved)
    return target, draft


def timed(fn, clock, repeats=3):
    fn()  # warm-up (kernel selection, allocator)
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return statistics.median(out)


def batched_greedy(target, draft, P: int, n: int, steps: int, gen, clock):
    """greedy_continuations of P random n-token prompts, ``steps`` tokens each, timed (median of 2 after a warm-up):
    (prompts, its output, total seconds, seconds per decode step after the prefill)."""
    prompts = torch.randint(0, QWEN3_8B["vocab_size"], (P, n), generator=gen).tolist()
    box = {}

    def generate():
        box["out"] = greedy_continuations(target, prompts, steps, None, layer_ids=draft.target_layer_ids, clock=clock)
    total = timed(generate, clock, repeats=2)
    return prompts, box["out"], total, (total - box["out"][3]) / max(1, steps - 1)


def step_bytes(target, draft, P: int, context: int) -> float:
    """Bytes a decode step must read at least: every weight once (the draft's lm_head is the target's), and at batch
    P the target's KV cache of P rows at ``context`` positions."""
    weights = sum(p.numel() * p.element_size() for p in list(target.parameters()) + list(draft.parameters()))
    c = target.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * P * next(target.parameters()).element_size()
    return float(weights + (kv if P > 1 else 0))


def measure_compiled(args, res, target, draft, engine, state, cands, batches, n, steps, gen, device):
    """The batch-1 step at every candidate b and the batch-P greedy decode step again with engine.compile=on
    (pipeline/decoding/compiled.py), beside the eager figures above, as achieved GB/s against --hbm-gbs."""
    from types import SimpleNamespace

    from pipeline.decoding.compiled import apply_compile

    clock = engine.now
    t0 = clock()
    apply_compile(SimpleNamespace(target=target, draft=draft), "on")
    engine.decode(state, block_size=cands[0], max_new_tokens=steps)  # compiles
    out = {"compile_s": clock() - t0, "step_s": {}, "decode_step_s": {}}
    print(f"\ncompiled (engine.compile=on): first compile {out['compile_s']:.1f} s", flush=True)
    hbm = args.hbm_gbs
    for b in cands:
        r = engine.decode(state, block_size=b, max_new_tokens=steps)
        per = timed(lambda b=b: engine.decode(state, block_size=b, max_new_tokens=steps), clock) / max(1, r.steps)
        out["step_s"][b] = per
        gbs = step_bytes(target, draft, 1, n) / per / 1e9
        eager = res["step_s"][b]
        print(f"  batch-1 step at b={b}: eager {eager * 1e3:.2f} ms ({step_bytes(target, draft, 1, n) / eager / 1e9:.0f}"
              f" GB/s), compiled {per * 1e3:.2f} ms ({gbs:.0f} GB/s{f', {gbs / hbm:.0%} of {hbm:.0f}' if hbm else ''})",
              flush=True)
    for P in batches:
        _, _, _, step = batched_greedy(target, draft, P, n, steps, gen, clock)
        out["decode_step_s"][P] = step
        eager = res["batched"][P]["decode_step_s"]
        need = step_bytes(target, draft, P, n + steps)
        print(f"  batch-{P} greedy decode step: eager {eager * 1e3:.2f} ms ({need / eager / 1e9:.0f} GB/s), compiled "
              f"{step * 1e3:.2f} ms ({need / step / 1e9:.0f} GB/s{f', {need / step / 1e9 / hbm:.0%} of {hbm:.0f}' if hbm else ''})",
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per measurement")
    ap.add_argument("--batches", default="16,64", help="batch sizes P for the batched measurements")
    ap.add_argument("--candidates", default="14,15,16,17,18", help="candidate block sizes (B = 16, k = 2)")
    ap.add_argument("--tau", type=float, default=6.5, help="acceptance length assumed for the estimate")
    ap.add_argument("--new-tokens", type=int, default=2048, help="generation length assumed for the estimate")
    ap.add_argument("--out", default=None, help="JSON file for every measured figure")
    ap.add_argument("--compile", action="store_true",
                    help="also time the batch-1 and batched steps with engine.compile=on, as GB/s achieved")
    ap.add_argument("--hbm-gbs", type=float, default=None,
                    help="the device's HBM bandwidth in GB/s (H200: 4800) for the fraction of the bound")
    ap.add_argument("--smoke", action="store_true",
                    help="a check of this script on CPU: 2-layer models of width 256 (the figures mean nothing)")
    args = ap.parse_args(argv)
    if args.smoke:
        QWEN3_8B.update(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, num_hidden_layers=10)
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA device (the CPU figures are benchmarks/label_throughput.py's)")
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    cands = [int(b) for b in args.candidates.split(",")]
    batches = [int(p) for p in args.batches.split(",")]
    n, steps = args.prompt_tokens, args.steps

    t0 = time.perf_counter()
    target, draft = build_pair(device, dtype)
    engine = Engine(target, draft, None)
    clock = engine.now
    res = {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)", "torch": torch.__version__, "prompt_tokens": n, "steps": steps,
           "candidates": cands, "target_params_b": sum(p.numel() for p in target.parameters()) / 1e9,
           "draft_params_b": sum(p.numel() for p in draft.parameters()) / 1e9}
    print(f"{res['gpu']}: target {res['target_params_b']:.2f}B, draft {res['draft_params_b']:.2f}B params (random, "
          f"{str(dtype).replace('torch.', '')}), built in {time.perf_counter() - t0:.0f}s; prompt {n} tokens, {steps} steps per timing", flush=True)

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, QWEN3_8B["vocab_size"], (1, n), generator=gen).to(device)
    res["prefill_s"] = timed(lambda: engine.prefill(ids), clock)
    state = engine.prefill(ids)
    res["step_s"] = {}
    for b in cands:
        def run(b=b):
            r = engine.decode(state, block_size=b, max_new_tokens=steps)
            return r
        r = run()
        per_step = timed(lambda: run(), clock) / max(1, r.steps)
        res["step_s"][b] = per_step
        print(f"  batch-1 step at b={b}: {per_step * 1e3:.2f} ms ({r.steps} steps, tau {r.tau:.2f})", flush=True)
    print(f"  batch-1 prefill: {res['prefill_s'] * 1e3:.1f} ms", flush=True)

    res["batched"] = {}
    for P in batches:
        prompts, (news, context, _, prefill), total, decode_step = batched_greedy(target, draft, P, n, steps, gen,
                                                                                  clock)
        gs = [p + c for p, c in zip(prompts, news)]
        runner = DraftRunner(draft, target, gs, context)
        s = n + steps // 2
        work = {p: [(b, s, b) for b in cands] for p in range(P)}
        propose = timed(lambda: runner.propose(work), clock)
        head = runner.head
        rows = torch.randn(P * len(cands), QWEN3_8B["hidden_size"], device=device, dtype=dtype)
        read = timed(lambda: torch.argmax(draft.compute_logits(draft.norm(rows), head), dim=-1), clock)
        res["batched"][P] = {"generate_s": total, "prefill_s": prefill, "decode_step_s": decode_step,
                             "propose_s": propose, "read_row_s": read / rows.shape[0],
                             "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else 0.0}
        print(f"  batch {P}: prefill {prefill:.3f} s, decode step {decode_step * 1e3:.2f} ms, draft forward over "
              f"{P * sum(cands)} rows {propose * 1e3:.1f} ms, lm_head read {read / rows.shape[0] * 1e6:.1f} us/row, "
              f"peak {res['batched'][P]['peak_gib']:.1f} GiB", flush=True)
        del runner, context
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.compile:
        res["compiled"] = measure_compiled(args, res, target, draft, engine, state, cands, batches, n, steps, gen,
                                           device)

    # ---- the estimate (assumptions: every candidate's tau = --tau; context length as measured) ----
    N, tau = args.new_tokens, args.tau
    blocks = N / tau  # verify steps of one decode
    paper = sum(res["prefill_s"] + blocks * res["step_s"][b] for b in cands)
    res["estimate"] = {"tau": tau, "new_tokens": N, "paper_s_per_prompt": paper,
                       "paper_prompts_per_hour": 3600 / paper, "batched": {}}
    print(f"\nestimate at tau {tau}, {N} new tokens, candidates {cands}:")
    print(f"  paper's method: {paper:.1f} s/prompt = {3600 / paper:.0f} prompts/hour")
    for P, m in res["batched"].items():
        # One batched greedy decode; every round of the lockstep walks proposes for every candidate of every prompt
        # (blocks rounds, the walks at one tau move together); tau - 1 extra proposal rows read per block.
        per_prompt = (m["prefill_s"] + (N - 1) * m["decode_step_s"] + blocks * m["propose_s"]
                      + blocks * len(cands) * P * (tau - 1) * m["read_row_s"]) / P
        res["estimate"]["batched"][P] = {"s_per_prompt": per_prompt, "prompts_per_hour": 3600 / per_prompt,
                                         "vs_paper": paper / per_prompt}
        print(f"  batched replay, batch {P}: {per_prompt:.2f} s/prompt = {3600 / per_prompt:.0f} prompts/hour, "
              f"{paper / per_prompt:.1f}x the paper's method")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
