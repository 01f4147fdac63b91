"""Replay labelling with the target's greedy continuation decoded by vLLM (``label.continuation: vllm``, T = 0 only).

Replay (pipeline.labelling.batched) needs per prompt the target's greedy continuation g and the target's context
features along prompt + g; the candidates are then the draft's work alone. Decoding g is almost all of labelling's
time on a GPU, and our engine decodes it one token a forward at ~8-11 % of the HBM bound (shared/reference/method.md).
vLLM decodes the same greedy tokens on its continuous batching and CUDA graphs. So, per label worker:

1. **vLLM decodes g** for the whole shard at once (:func:`vllm_continuations`: every prompt handed to one
   ``generate`` call, vLLM batching them itself at K = 0, our engine's stop tokens);
2. per batch of ``label.batch_size`` prompts, **one teacher-forced target forward** over prompt + g
   (:func:`teacher_forced`) gives the draft's context features, the raw prefill logits (the feature) and the target's
   own argmax at every position of g;
3. **every candidate is replayed by our draft** along g, and the per-step trace recorded
   (pipeline.labelling.batched.replay_along, the very code the ``greedy`` continuation ends in).

The labels, the trace and the feature are therefore our engine's: g is checked token by token against the target's
argmax from step 2 (:func:`check_continuation`): a continuation that is not the target's greedy one (a token changed,
an early end that is neither a stop token nor the budget, a request vLLM aborted or cut) is **never replayed**; that
prompt is labelled by our own greedy decode instead (the ``greedy`` route, in the same batch call) and the reason is
kept in the shard's metadata (``continuations``: ``fallback`` and ``fallback_reasons``). At T > 0 the route is
refused (pipeline.runtime.checks: vLLM's sampled continuation is not the one our labels draw).

Seconds: a prompt's ``prefill_seconds`` is its share of the teacher-forced pass (the forward that computes the
feature), its ``decode_seconds`` its share of vLLM's continuation and the replay, split over its candidates as the
greedy route splits them. The split is in each batch's record (``seconds``: continuation, teacher_forced, replay).
Measured: benchmarks/results/vllm-continuation.md (this CPU) and vllm-continuation-gpu.md (the GPU estimate).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from dflash.model import extract_context_feature

from pipeline.labelling.greedy import FEATURE_ELEMENTS, _right_aligned

# Bound on the teacher-forced pass's logits (rows x positions of g x vocabulary elements) per forward: at V =
# 151,936 and 2,048 new tokens one row is ~311M elements, so rows go one at a time there.
LOGIT_ELEMENTS = 1 << 28


def vllm_continuations(vllm, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       stop_token_ids: Optional[Sequence[int]]) -> Tuple[List[List[int]], List[Optional[str]], float]:
    """(new tokens per prompt, vLLM's own word on each request where it did not end normally, seconds): every prompt
    decoded greedily by ``vllm`` (a started pipeline.decoding.vllm_engine.VllmEngine) in ONE call, vLLM batching
    them itself, K = 0, stopping on our engine's stop tokens (none: ``max_new_tokens`` each)."""
    t0 = time.perf_counter()
    got = vllm.decode([list(p) for p in prompts], 0, max_new_tokens, stop_on_eos=bool(stop_token_ids),
                      stop_token_ids=stop_token_ids)
    seconds = time.perf_counter() - t0
    notes = [None if d.finish_reason in ("stop", "length", None) else f"vLLM finish_reason {d.finish_reason}"
             for d in got]
    return [list(d.token_ids) for d in got], notes, seconds


@torch.inference_mode()
def teacher_forced(target, layer_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[int]], pad_token_id: int = 0):
    """One forward of the target over every prompt + g (rows chunked under FEATURE_ELEMENTS and LOGIT_ELEMENTS):
    (context [P, L, F] right-padded: the draft's context features of positions 0 .. len(prompt + g) - 1, as
    greedy.target_features gives them; logits [P, V]: the raw last-prompt-position logits; argmax: per prompt the
    target's greedy choice at every position of g, i.e. what g[j] must be)."""
    device = target.device
    P = len(prompts)
    n_max = max(len(p) for p in prompts)
    t_max = max(1, max(len(c) for c in continuations))
    width = n_max + t_max
    ids = torch.full((P, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((P, width), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        ids[i, n_max - len(p):n_max + len(c)] = torch.tensor(list(p) + list(c), dtype=torch.long)
        mask[i, n_max - len(p):] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    cfg = target.config
    vocab = int(target.get_output_embeddings().weight.shape[0])
    rows = max(1, min(FEATURE_ELEMENTS // max(1, (cfg.num_hidden_layers + 1) * width * cfg.hidden_size),
                      LOGIT_ELEMENTS // max(1, t_max * vocab)))
    L = max(len(p) + len(c) for p, c in zip(prompts, continuations))
    keep = torch.arange(n_max - 1, n_max - 1 + t_max, device=device)  # column j predicts g[j]
    contexts, logits, argmax = [], [], []
    for lo in range(0, P, rows):
        hi = min(P, lo + rows)
        out = target(ids[lo:hi], attention_mask=mask[lo:hi], position_ids=positions[lo:hi], use_cache=False,
                     output_hidden_states=True, logits_to_keep=keep)
        feats = extract_context_feature(out.hidden_states, list(layer_ids))
        contexts.append(_right_aligned(feats, [n_max - len(prompts[i]) for i in range(lo, hi)], L))
        logits.append(out.logits[:, 0])
        argmax += out.logits.argmax(-1).tolist()
        del out, feats
    argmax = [a[:len(c)] for a, c in zip(argmax, continuations)]
    return torch.cat(contexts), torch.cat(logits), argmax


def check_continuation(g: Sequence[int], argmax: Sequence[int], max_new_tokens: int,
                       stop_token_ids: Optional[Sequence[int]], note: Optional[str] = None) -> Optional[str]:
    """None when ``g`` is the target's greedy continuation as our engine ends it (each token the target's argmax
    after the tokens before it; ending at the first stop token or after ``max_new_tokens``), else why not."""
    if note:
        return note
    stops = set(int(t) for t in (stop_token_ids or []))
    if not g:
        return "no new token"
    if len(g) > max_new_tokens:
        return f"{len(g)} new tokens, more than decode.max_new_tokens={max_new_tokens}"
    for j, (t, a) in enumerate(zip(g, argmax)):
        if int(t) != int(a):
            return f"token {j} is {int(t)}, the target's argmax is {int(a)}"
        if int(t) in stops and j < len(g) - 1:
            return f"goes on past the stop token {int(t)} at token {j}"
    if len(g) < max_new_tokens and int(g[-1]) not in stops:
        return f"ends after {len(g)} of {max_new_tokens} tokens without a stop token"
    return None


def vllm_replay_label_prompts(engine, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                              candidates: Sequence[int], max_new_tokens: int,
                              step_cost: Optional[Dict[int, float]] = None, pad_token_id: int = 0,
                              trace_block_size: Optional[int] = None, continuation_seconds: float = 0.0,
                              notes: Optional[Sequence[Optional[str]]] = None):
    """(one PromptLabels per prompt, in order, as batched_replay_label_prompts returns them; this batch's record:
    rows, ``fallback`` prompts and their ``fallback_reasons``, ``seconds`` split) for a batch whose continuations
    vLLM decoded (``continuations``, its ``notes`` from :func:`vllm_continuations`; ``continuation_seconds``: this
    batch's share of that call). A prompt whose continuation fails :func:`check_continuation` is labelled by our
    greedy decode instead, never along vLLM's tokens."""
    from pipeline.labelling.batched import _as_list, batched_replay_label_prompts, replay_along
    from pipeline.labelling.support import require_replayable

    require_replayable(engine.draft)
    prompts = [_as_list(p) for p in prompts]
    news = [[int(t) for t in c] for c in continuations]
    notes = list(notes) if notes is not None else [None] * len(prompts)
    if not prompts:
        return [], {"continuation": "vllm", "rows": 0, "fallback": 0, "fallback_reasons": {}, "seconds": {}}
    if min(len(p) for p in prompts) < 1:
        raise ValueError("every prompt needs at least one token")
    stops = engine.stop_token_ids
    t0 = engine.now()
    context, logits, argmax = teacher_forced(engine.target, engine.draft.target_layer_ids, prompts, news,
                                             pad_token_id)
    tf_seconds = engine.now() - t0
    why = [check_continuation(g, a, max_new_tokens, stops, n) for g, a, n in zip(news, argmax, notes)]
    ok = [i for i, w in enumerate(why) if w is None]
    bad = [i for i, w in enumerate(why) if w is not None]
    out: List = [None] * len(prompts)
    share = continuation_seconds * len(ok) / len(prompts)
    if ok:
        sel = torch.tensor(ok, device=context.device)
        got = replay_along(engine, [prompts[i] for i in ok], [news[i] for i in ok], context[sel], logits[sel],
                           candidates, max_new_tokens, t0 - share, tf_seconds,
                           step_cost, trace_block_size)
        for i, o in zip(ok, got):
            out[i] = o
    replay_seconds = engine.now() - t0 - tf_seconds
    t1 = engine.now()
    if bad:
        got = batched_replay_label_prompts(engine, [prompts[i] for i in bad], candidates, max_new_tokens,
                                           step_cost=step_cost, pad_token_id=pad_token_id,
                                           trace_block_size=trace_block_size)
        for i, o in zip(bad, got):
            out[i] = o
    record = {"continuation": "vllm", "rows": len(prompts), "fallback": len(bad),
              "fallback_reasons": {str(i): why[i] for i in bad},
              "seconds": {"continuation": round(continuation_seconds, 4), "teacher_forced": round(tf_seconds, 4),
                          "replay": round(replay_seconds, 4), "fallback_greedy": round(engine.now() - t1, 4)}}
    return out, record


def probe_costs(vllm, engine, concurrency: Sequence[int], context_length: int, steps: int, seed: int = 0) -> dict:
    """What ContinuationChoice's auto needs to price vLLM's way, timed at a worker's start: seconds per decode step of
    c random-token requests decoding together in vLLM (each c of ``concurrency``; ``2 * steps`` tokens, EOS
    ignored, the mean per-request time per output token), and the teacher-forced pass's seconds per token (one pass
    over the largest c prompts of ``context_length`` + ``2 * steps`` tokens)."""
    import random

    rng = random.Random(seed)
    vocab = vllm.vocab_size
    step: Dict[int, float] = {}
    prompts: List[List[int]] = []
    for c in sorted(set(int(c) for c in concurrency if int(c) <= vllm.max_num_seqs)):
        prompts = [[rng.randrange(10, vocab - 10) for _ in range(int(context_length))] for _ in range(c)]
        got = vllm.decode(prompts, 0, 2 * steps, stop_on_eos=False)
        step[c] = float(sum(d.seconds / max(1, len(d.token_ids) - 1) for d in got) / len(got))
    news = [[rng.randrange(10, vocab - 10) for _ in range(2 * steps)] for _ in prompts]
    t0 = time.perf_counter()
    teacher_forced(engine.target, engine.draft.target_layer_ids, prompts, news)
    per_token = (time.perf_counter() - t0) / max(1, len(prompts) * (int(context_length) + 2 * steps))
    return {"step": step, "teacher_per_token": per_token}
