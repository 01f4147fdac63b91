"""vLLM's labelling throughput (label.engine=vllm) at Qwen3-8B shapes on one GPU: prompts per GPU-hour, and GB/s
achieved against the HBM bound. The vLLM step of ``benchmarks/gpu_check.sh``.

    python benchmarks/vllm_label_costs.py --hbm-gbs 4800 --out DIR/vllm-label-costs.json      # on a GPU
    python benchmarks/vllm_label_costs.py --smoke --out DIR/vllm-label-costs.json             # CPU: a check of it
    python benchmarks/vllm_label_costs.py --profile-out DIR/vllm-profile.json ...             # and vLLM's step costs

``--profile-out``: the same engine's cost profile (pipeline.labelling.vllm_labels.measure_profile at c in
``--profile-concurrency``): b = 1 in plain vLLM (no speculative config, no drafter), K = 0 in the speculative engine
as its own ``speculative_k0`` entry (vLLM runs the drafter's forward there too), every candidate at K = b - 1; the
summary prints K = 0's step over plain's at each c, the price of a schedule's K = 0 range on this device.

The pair is gpu_label_costs.py's (random weights with Qwen3-8B's shapes, a 5-layer DFlash-b16 draft reading target
layers [1, 9, 17, 25, 33]: no hub download here), saved to a temporary folder as vLLM loads checkpoints, in bf16;
``--smoke`` narrows it to run on a CPU (the figures then mean nothing). Random weights accept almost nothing, so
every verify step commits about one token: this measures the COST of a labelling pass (the prefill logits, then one
pass per candidate b at K = b - 1 over every prompt on vLLM's continuous batching), not its acceptance.

GB/s is an estimate of the least traffic: each engine step reads the target's and the draft's weights once (every
request of the batch shares them), so bytes = steps x weight bytes, steps = the engine's verify steps (a pass's
longest request, all prompts being in one batch). The KV cache's reads are left out (they add to it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--candidates", default="14,15,16,17,18", help="the published B = 16, k = 2")
    ap.add_argument("--hbm-gbs", type=float, default=None, help="HBM bandwidth in GB/s (H200: 4800)")
    ap.add_argument("--smoke", action="store_true", help="CPU, narrow models: that the script runs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-out", default=None, help="also time vLLM's cost profile (plain, K = 0, each b)")
    ap.add_argument("--profile-concurrency", default="1,16")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    import gpu_label_costs as g
    from pipeline.decoding.vllm_engine import VllmEngine
    from pipeline.labelling.vllm_labels import label_batch

    if a.smoke:
        g.QWEN3_8B.update(vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64, num_hidden_layers=10)
        device, dtype, name = "cpu", torch.float32, "float32"
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA device (--smoke checks the script on CPU)")
    else:
        device, dtype, name = "cuda", torch.bfloat16, "bfloat16"
    cands = [int(b) for b in a.candidates.split(",")]
    with tempfile.TemporaryDirectory(prefix="vllm-8b-") as tmp:
        target, draft = g.build_pair(torch.device("cpu"), dtype)
        weight_bytes = sum(p.numel() * p.element_size() for m in (target, draft) for p in m.parameters())
        target.config.max_position_embeddings = a.prompt_tokens + a.max_new_tokens + 64
        target.save_pretrained(Path(tmp) / "target")
        draft.config.architectures = ["DFlashDraftModel"]
        draft.save_pretrained(Path(tmp) / "draft")
        del target, draft
        engine = VllmEngine(str(Path(tmp) / "target"), str(Path(tmp) / "draft"), name, max_k=max(cands) - 1,
                            max_num_seqs=max(a.prompts, 1, *([int(c) for c in a.profile_concurrency.split(",")] if a.profile_out
                                                   else [])), max_model_len=a.prompt_tokens + a.max_new_tokens + 64,
                            enforce_eager=device == "cpu", skip_tokenizer_init=True).start()
        gen = torch.Generator().manual_seed(0)
        vocab = g.QWEN3_8B["vocab_size"]
        prompts = torch.randint(10, vocab - 10, (a.prompts, a.prompt_tokens), generator=gen).tolist()
        label_batch(engine, prompts[:2], cands[:1], 8, None)  # warm-up: first-pass allocations
        t0 = time.perf_counter()
        rows = label_batch(engine, prompts, cands, a.max_new_tokens, None)
        seconds = time.perf_counter() - t0
        steps = sum(max(r.steps[j] for r in rows) for j in range(len(cands))) + 1  # + the features' pass
        profile = None
        if a.profile_out:
            from pipeline.labelling.vllm_labels import measure_profile
            from pipeline.policy.cost import CostProfile

            cs = [int(c) for c in a.profile_concurrency.split(",")]
            profile = measure_profile(engine, cands, cs, [a.prompt_tokens], 16, meta={"device": device})
            CostProfile.from_dict(profile).save(a.profile_out)
        engine.shutdown()
    res = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke: the figures mean nothing)",
           "engine": engine.version, "dtype": name, "prompts": a.prompts, "prompt_tokens": a.prompt_tokens,
           "max_new_tokens": a.max_new_tokens, "candidates": cands, "start_seconds": engine.start_seconds,
           "seconds": seconds, "prompts_per_hour": a.prompts / seconds * 3600, "engine_steps": steps,
           "weight_bytes": weight_bytes, "achieved_gbs": steps * weight_bytes / seconds / 1e9,
           "mean_tau": sum(sum(r.tau) / len(r.tau) for r in rows) / len(rows)}
    if a.hbm_gbs:
        res["fraction_of_hbm"] = res["achieved_gbs"] / a.hbm_gbs
    if profile is not None:
        def plain_at(c):
            part = profile if c == profile["top_level_concurrency"] else profile["load"][str(c)]
            return part["measured"]["1"]["total"]

        res["k0_over_plain"] = {c: profile["speculative_k0"][c] / plain_at(int(c)) for c in profile["speculative_k0"]}
        print("vLLM's step at K = 0 with the drafter over plain vLLM's: "
              + ", ".join(f"c={c} {r:.2f}x" for c, r in res["k0_over_plain"].items()) + f" ({a.profile_out})")
    print(f"vLLM labelling ({res['engine']}, {res['device']}, {name}): {a.prompts} prompts x {len(cands)} candidates x "
          f"{a.max_new_tokens} tokens in {seconds:.1f} s (start-up {engine.start_seconds:.1f} s apart): "
          f"{res['prompts_per_hour']:.0f} prompts/hour; weights read {steps} times: {res['achieved_gbs']:.1f} GB/s"
          + (f" = {res['fraction_of_hbm']:.1%} of {a.hbm_gbs:g} GB/s" if a.hbm_gbs else ""))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
