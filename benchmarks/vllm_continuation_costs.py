"""The parts of label.continuation=vllm at Qwen3-8B shapes on one GPU, and prompts per GPU-hour of each labelling route
from them. The ``vllm-continuation`` step of ``benchmarks/gpu_check.sh``; the estimate on paper is
benchmarks/results/vllm-continuation-gpu.md.

    python benchmarks/vllm_continuation_costs.py --costs DIR/costs-8b.json --out DIR/vllm-continuation-costs.json
    python benchmarks/vllm_continuation_costs.py --smoke --out DIR/vllm-continuation-costs.json     # CPU: runs

The pair is gpu_label_costs.py's (random weights, Qwen3-8B's shapes, a 5-layer DFlash-b16 draft, bf16), the target
saved to a temporary folder for vLLM. Measured, each through the product's own code:

  vllm_step(P)     vLLM (the target alone, K = 0, CUDA graphs: as label.continuation=vllm starts it) decoding P
                   prompts of --prompt-tokens together, EOS ignored: seconds per engine step, from two lengths
                   (--steps and 2 x --steps new tokens) so that the prefill drops out; and its prefill per prompt
  teacher(P)       pipeline.labelling.vllm_continuation.teacher_forced over --rows prompts of --prompt-tokens +
                   --new-tokens tokens (the published length): seconds per prompt
  replay           the draft's walks, from costs-8b.json's propose_s / read_row_s at each P (gpu_label_costs.py's
                   step, run before this one by gpu_check), else measured here the same way

and the estimate at tau (--tau) and --new-tokens, every candidate's tau the same (gpu_label_costs' assumption):
greedy = our batched greedy decode (costs-8b.json's decode_step_s) + replay; vllm = vLLM's steps + its prefill +
the teacher-forced pass + replay; label.engine=vllm = vllm_label_costs.py's measured pass (vllm-label-costs.json,
at its own lengths and with random weights' acceptance: said so) where present. Random weights accept nothing, so
vLLM's K = 0 decode is exactly what labelling asks of it; the replay's cost uses --tau.
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
    ap.add_argument("--batches", default="64,256", help="P: prompts vLLM decodes together")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64, help="vLLM steps per timing (and twice as many)")
    ap.add_argument("--new-tokens", type=int, default=2048, help="the published max_new_tokens")
    ap.add_argument("--rows", type=int, default=2, help="prompts in the timed teacher-forced pass")
    ap.add_argument("--candidates", default="14,15,16,17,18")
    ap.add_argument("--tau", type=float, default=6.5)
    ap.add_argument("--memory", type=float, default=0.5, help="vLLM's gpu_memory_utilization (ours beside it)")
    ap.add_argument("--costs", default=None, help="costs-8b.json of gpu_label_costs.py (the greedy and replay parts)")
    ap.add_argument("--engine-costs", default=None, help="vllm-label-costs.json of vllm_label_costs.py")
    ap.add_argument("--smoke", action="store_true", help="CPU, narrow models: that the script runs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    import gpu_label_costs as g
    from pipeline.decoding.vllm_engine import VllmEngine
    from pipeline.labelling.runner import DraftRunner
    from pipeline.labelling.vllm_continuation import teacher_forced

    if a.smoke:
        g.QWEN3_8B.update(vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64, num_hidden_layers=10)
        device, dtype, name = torch.device("cpu"), torch.float32, "float32"
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA device (--smoke checks the script on CPU)")
    else:
        device, dtype, name = torch.device("cuda"), torch.bfloat16, "bfloat16"
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    def clock():
        sync()
        return time.perf_counter()

    cands = [int(b) for b in a.candidates.split(",")]
    batches = [int(p) for p in a.batches.split(",")]
    n, N, vocab = a.prompt_tokens, a.new_tokens, g.QWEN3_8B["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    res = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke: the figures mean nothing)",
           "dtype": name, "prompt_tokens": n, "new_tokens": N, "tau": a.tau, "candidates": cands}
    with tempfile.TemporaryDirectory(prefix="vllm-cont-8b-") as tmp:
        target, draft = g.build_pair(torch.device("cpu"), dtype)
        target.config.max_position_embeddings = n + N + 64
        target.save_pretrained(Path(tmp) / "target")
        target, draft = target.to(device), draft.to(device)
        v = VllmEngine(str(Path(tmp) / "target"), "", name, max_k=0, max_num_seqs=max(batches),
                       max_model_len=n + 2 * a.steps + 64, enforce_eager=device.type == "cpu",
                       gpu_memory_utilization=a.memory, skip_tokenizer_init=True).start()
        res["vllm_start_seconds"], res["engine"] = v.start_seconds, v.version
        v.decode([[5] * 8], 0, 4, stop_on_eos=False)  # warm-up
        res["vllm"] = {}
        for P in batches:
            prompts = torch.randint(10, vocab - 10, (P, n), generator=gen).tolist()
            walls = {}
            for m in (a.steps, 2 * a.steps):
                t0 = time.perf_counter()
                v.decode(prompts, 0, m, stop_on_eos=False)
                walls[m] = time.perf_counter() - t0
            step = (walls[2 * a.steps] - walls[a.steps]) / a.steps
            prefill = max(0.0, walls[a.steps] - a.steps * step) / P
            res["vllm"][P] = {"step_s": step, "prefill_s_per_prompt": prefill, "tokens_per_s": P / step}
            print(f"vLLM K = 0, {P} prompts of {n} tokens together: {step * 1e3:.2f} ms a step ({P / step:.0f} tok/s), "
                  f"prefill {prefill * 1e3:.1f} ms a prompt", flush=True)
        v.shutdown()
        rows = max(1, a.rows)
        prompts = torch.randint(10, vocab - 10, (rows, n), generator=gen).tolist()
        news = torch.randint(10, vocab - 10, (rows, N), generator=gen).tolist()
        teacher_forced(target, draft.target_layer_ids, prompts[:1], [news[0][:8]])  # warm-up
        t0 = clock()
        teacher_forced(target, draft.target_layer_ids, prompts, news)
        res["teacher_s_per_prompt"] = (clock() - t0) / rows
        print(f"teacher-forced pass over {n} + {N} tokens: {res['teacher_s_per_prompt']:.3f} s a prompt", flush=True)
        costs = json.loads(Path(a.costs).read_text()) if a.costs and Path(a.costs).exists() else None
        if costs is None:  # the replay's draft forward measured here, as gpu_label_costs.py does
            costs = {"batched": {}}
            for P in batches[:1]:
                F = len(draft.target_layer_ids) * g.QWEN3_8B["hidden_size"]
                L = n + a.steps
                context = torch.randn(P, L, F, device=device, dtype=dtype)
                gs = torch.randint(10, vocab - 10, (P, L + 1), generator=gen).tolist()
                runner = DraftRunner(draft, target, gs, context)
                work = {p: [(b, n, b) for b in cands] for p in range(P)}
                runner.propose(work)
                t0 = clock()
                runner.propose(work)
                propose = clock() - t0
                hrows = torch.randn(P * len(cands), g.QWEN3_8B["hidden_size"], device=device, dtype=dtype)
                t0 = clock()
                torch.argmax(draft.compute_logits(draft.norm(hrows), runner.head), dim=-1)
                costs["batched"][str(P)] = {"propose_s": propose, "read_row_s": (clock() - t0) / hrows.shape[0]}
                del runner, context
            res["replay_measured_here"] = costs["batched"]
    blocks = N / a.tau
    est = {}
    for P, m in sorted(costs["batched"].items(), key=lambda kv: int(kv[0])):
        P = int(P)  # our replay's batch (label.batch_size); vLLM decodes at its own concurrency Pv
        replay = (blocks * m["propose_s"] + blocks * len(cands) * P * (a.tau - 1) * m["read_row_s"]) / P
        row = {"replay": replay}
        if "decode_step_s" in m:
            row["greedy"] = (m["prefill_s"] + (N - 1) * m["decode_step_s"]) / P + replay
        for Pv, vp in res["vllm"].items():
            row[f"vllm continuation (vLLM at {Pv})"] = ((N - 1) * vp["step_s"] / Pv + vp["prefill_s_per_prompt"]
                                                        + res["teacher_s_per_prompt"] + replay)
        est[P] = {k: {"s_per_prompt": s, "prompts_per_hour": 3600 / s} for k, s in row.items()}
    res["estimate"] = est
    ec = json.loads(Path(a.engine_costs).read_text()) if a.engine_costs and Path(a.engine_costs).exists() else None
    if ec:
        res["label_engine_vllm"] = {"prompts_per_hour": ec["prompts_per_hour"], "max_new_tokens": ec["max_new_tokens"],
                                    "mean_tau": ec.get("mean_tau"), "note": "vllm_label_costs.py at its own lengths, "
                                    "random weights (acceptance ~1): a cost, not the published tau"}
    for P, row in est.items():
        print(f"estimate at P = {P}, tau {a.tau}, {N} new tokens: " + ", ".join(
            f"{k} {v['s_per_prompt']:.2f} s/prompt = {v['prompts_per_hour']:.0f} prompts/GPU-hour"
            for k, v in row.items()), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
