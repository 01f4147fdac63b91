"""Agreement of batched replay labels (label.mode=replay, label.batch_size > 1) with exhaustive batch-1 labels.

    python benchmarks/label_agreement.py                       # 512 tiny-pair prompts + random pairs, k = 2
    python benchmarks/label_agreement.py --prompts 64 --random-prompts 8     # a quick look

Exhaustive labelling (label.mode=exhaustive, the reference: one prefill, a full speculative decode at every
candidate, batch 1) against batched replay (pipeline/labelling/batched.py) on the same prompts, prompt by prompt: the same
greedy continuation g, the same tau and steps at every candidate, the same label. Batched matrix products round
differently from batch-1 ones, so a near-tie in an argmax can resolve differently; every disagreement is listed
with its cause:

* g differs: the first diverging position of g (tokens after the prompt) and the target's logit gap top1 - top2
  there, from a batch-1 forward over the prompt and the common prefix (a near-tie shows as a tiny gap);
* g identical, tau differs: a draft proposal resolved differently; the first candidate and step that differ and
  the draft's logit gap top1 - top2 at the first proposal row where the two runs' proposals differ.

Data: the bundled tiny pair on the stdlib-heldout label prompts (--prompts), and random-weight pairs
(tests/random_pair.py: full-attention, sliding-window, causal and DFlash2 drafts, two seeds each, random prompts of
random lengths, a stop token the continuations reach). T = 0, fp32, CPU, one thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from pipeline.labelling.batched import batched_replay_label_prompts, length_sorted_chunks  # noqa: E402
from pipeline.labelling.greedy import greedy_continuations, target_features  # noqa: E402
from pipeline.labelling.runner import DraftRunner  # noqa: E402
from pipeline.labelling.walks import lockstep_walks  # noqa: E402
from pipeline.decoding.engine import Engine  # noqa: E402
from pipeline.labelling.labels import assemble_labels, candidate_block_sizes  # noqa: E402


def exhaustive(engine, ids, cands, max_new):
    """label_prompt, keeping every candidate's output ids (to compare g)."""
    state = engine.prefill(ids)
    per_b, outputs = {}, {}
    for b in cands:
        r = engine.decode(state, block_size=b, max_new_tokens=max_new)
        per_b[b] = {"committed": r.committed, "new_tokens": r.new_tokens, "seconds": r.decode_seconds}
        outputs[b] = r.new_ids.tolist()
    return assemble_labels(state, cands, per_b, None), outputs


@torch.inference_mode()
def target_gap(target, prompt, prefix):
    """top1 - top2 of the target's logits after prompt + prefix (batch 1, no cache)."""
    ids = torch.tensor([list(prompt) + list(prefix)], device=target.device)
    top = torch.topk(target(ids, logits_to_keep=1).logits[0, -1].float(), 2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def draft_gap(engine, ids, cands, max_new, committed_ref, committed_got):
    """(b, step, gap): the first candidate and step whose committed counts differ, and the draft's top1 - top2
    logit gap at the first proposal row of that step's block that misses (batch-1 replay's draft, exhaustive's
    features)."""
    from pipeline.labelling.replay import DraftReplay

    for b in cands:
        ref, got = committed_ref[b], committed_got[b]
        if ref == got:
            continue
        k = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), min(len(ref), len(got)))
        state = engine.prefill(ids)
        dec = engine.decode(state, block_size=engine.trained_block_size, max_new_tokens=max_new, keep_context=True)
        runner = DraftReplay(engine.draft, engine.target, dec.output_ids[0], dec.context)
        s = state.num_input_tokens + sum(ref[:k])
        vs = min(b, state.num_input_tokens + max_new - s)
        if vs < 2:
            return b, k, float("nan")
        h = runner.block_hidden([(b, s, vs)])[0]
        logits = engine.draft.compute_logits(h, runner.head)[0].float()
        j = min(ref[k], got[k]) - 1 if k < min(len(ref), len(got)) else 0
        j = max(0, min(j, logits.shape[0] - 1))
        top = torch.topk(logits[j], 2).values
        return b, k, float(top[0] - top[1])
    return None, None, float("nan")


def compare(engine, prompts, names, cands, max_new, batch_size, label):
    """Exhaustive vs batched on every prompt; prints each disagreement; returns (identical, total, gaps)."""
    identical, lines, gaps = 0, [], []
    for chunk in length_sorted_chunks([len(p) for p in prompts], batch_size):
        batch = [prompts[i] for i in chunk]
        got = batched_replay_label_prompts(engine, batch, cands, max_new)
        news = None
        for i, out in zip(chunk, got):
            ids = torch.tensor([prompts[i]])
            ref, outputs = exhaustive(engine, ids, cands, max_new)
            same = (out.tau, out.steps, out.new_tokens, out.label_index) == \
                (ref.tau, ref.steps, ref.new_tokens, ref.label_index)
            if same:
                identical += 1
                continue
            news = news or batched_internals(engine, batch, cands, max_new)
            g, committed_got = news[0][chunk.index(i)], news[1][chunk.index(i)]
            g_ref = outputs[engine.trained_block_size] if engine.trained_block_size in outputs else outputs[cands[0]]
            label_note = "same label" if out.label_index == ref.label_index else \
                f"label {ref.label_block_size} -> {out.label_block_size}"
            if g != g_ref:
                pos = next((j for j, (x, y) in enumerate(zip(g, g_ref)) if x != y), min(len(g), len(g_ref)))
                gap = target_gap(engine.target, prompts[i], g_ref[:pos])
                gaps.append(gap)
                lines.append(f"  {names[i]}: g differs at new token {pos} (target logit gap top1-top2 {gap:.3g}); "
                             f"{label_note}")
            else:
                b, k, gap = draft_gap(engine, ids, cands, max_new, _walks_exhaustive(engine, ids, cands, max_new),
                                      committed_got)
                lines.append(f"  {names[i]}: g identical; draft proposal differs at b={b} step {k} (draft logit gap "
                             f"top1-top2 {gap:.3g}); {label_note}")
    print(f"{label}: identical labels {identical}/{len(prompts)}")
    for line in lines:
        print(line)
    return identical, len(prompts), gaps


def _walks_exhaustive(engine, ids, cands, max_new):
    state = engine.prefill(ids)
    return {b: engine.decode(state, block_size=b, max_new_tokens=max_new).committed for b in cands}


def batched_internals(engine, batch, cands, max_new):
    """(g per prompt, {b: committed per step} per prompt) of one batch, from batched_replay_label_prompts' own
    three passes (deterministic: the same batch gives the same values)."""
    news = greedy_continuations(engine.target, batch, max_new, engine.stop_token_ids)
    context, _, _ = target_features(engine.target, engine.draft.target_layer_ids, batch, news)
    gs = [list(p) + c for p, c in zip(batch, news)]
    runner = DraftRunner(engine.draft, engine.target, gs, context)
    walks = lockstep_walks(gs, [len(p) for p in batch], max_new, list(cands), runner.propose,
                           engine.stop_token_ids)
    return news, walks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512, help="tiny-pair prompts (stdlib-heldout, label split)")
    ap.add_argument("--random-prompts", type=int, default=16, help="prompts per random pair")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=None, help="default: label.batch_size")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from pipeline.runtime.config import ModelConfig, load_config
    from pipeline.decoding.models import load_models
    from pipeline.data.sources import build_prompts

    cfg = load_config()
    bs = args.batch_size or cfg.label.batch_size
    t0 = time.perf_counter()
    total = [0, 0]
    all_gaps = []
    if args.prompts:
        m = load_models(ModelConfig(dtype="float32", device="cpu"))
        rows, _, _ = build_prompts(cfg.prepare.sources, m.tokenizer, cfg.prepare.max_prompt_tokens,
                                   limit=args.prompts)
        engine = Engine(m.target, m.draft, m.stop_token_ids)
        ok, n, gaps = compare(engine, [r["input_ids"] for r in rows], [r["prompt_id"] for r in rows],
                              candidate_block_sizes(engine.trained_block_size, args.k), args.max_new_tokens, bs,
                              f"tiny pair, {len(rows)} prompts, batch {bs}")
        total[0] += ok
        total[1] += n
        all_gaps += gaps
    if args.random_prompts:
        from random_pair import EOS_ID, VOCAB, make_pair

        variants = {"full": {}, "sliding_window": dict(layer_types=["sliding_attention", "full_attention"],
                                                       sliding_window=3),
                    "causal": dict(is_causal=True), "dflash2": dict(dflash2=True)}
        for name, kw in variants.items():
            for seed in (0, 1):
                target, draft = make_pair(seed, block_size=4, **kw)
                g = torch.Generator().manual_seed(seed)
                prompts = [torch.randint(0, VOCAB - 2, (int(torch.randint(1, 40, (1,), generator=g)),),
                                         generator=g).tolist() for _ in range(args.random_prompts)]
                ok, n, gaps = compare(Engine(target, draft, [EOS_ID]), prompts,
                                      [f"{name}-s{seed}-p{i}" for i in range(len(prompts))],
                                      candidate_block_sizes(4, 2), min(args.max_new_tokens, 48), bs,
                                      f"random pair {name} seed {seed}")
                total[0] += ok
                total[1] += n
                all_gaps += gaps
    print(f"\ntarget-side disagreements: {len(all_gaps)}; largest target logit gap among them: "
          f"{max(all_gaps) if all_gaps else float('nan'):.3g}")
    print(f"{time.perf_counter() - t0:.0f} s")
    print(f"labels agree: {total[0]}/{total[1]} ({100 * total[0] / max(1, total[1]):.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
