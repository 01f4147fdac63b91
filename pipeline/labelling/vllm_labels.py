"""Labels from vLLM (``label.engine: vllm``): tau at every candidate b measured by the serving engine, and its cost
profile. Ray-free; the engine is pipeline.decoding.vllm_engine.VllmEngine.

A batch of prompts is labelled in 1 + |C| passes of one engine: the prefill logits (the feature), then one decode
pass per candidate b at K = b - 1, all prompts together on vLLM's continuous batching. Each prompt's row has the
schema of the HF engine's (pipeline.data.schemas), with what vLLM cannot give left out and said so:

* ``tau``, ``steps``, ``new_tokens``: from vLLM's per-request acceptance, the last step clipped as our engine counts
  it (vllm_engine.committed_per_step). At T > 0 each prompt's own seed (pipeline.runtime.seeds), the same for every
  candidate, as the HF engine's exhaustive mode.
* ``decode_seconds``: the request's first to last token, other requests sharing its steps; ``prefill_seconds`` the
  feature pass's wall time over its prompts.
* no per-step trace (``trace_*`` null): vLLM exposes accepted counts, not the draft's per-slot confidences the rules
  are simulated from; and vLLM serves no per-step rule to tune. ``tau_expected`` is tau (no expectation at T > 0).

The cost profile (:func:`measure_profile`) times vLLM's step at each (b, c) the way ``vllm bench sweep serve`` does,
TPOT x tau (pipeline.policy.vllm_sweep), on c random-token requests running together, and is written in the same
``cost_profile.json`` format as the HF engine's, so that b*(c), tune and deploy read it unchanged.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from pipeline.labelling.labels import PromptLabels, assemble_labels


def label_batch(engine, prompts: Sequence[Sequence[int]], candidates: Sequence[int], max_new_tokens: int,
                step_cost: Optional[Dict[int, float]], temperature: float = 0.0, top_p: float = 1.0,
                seeds: Optional[Sequence[int]] = None, stop_on_eos: bool = True) -> List[PromptLabels]:
    """One PromptLabels per prompt, every candidate decoded by ``engine`` (a started VllmEngine)."""
    import torch

    t0 = time.perf_counter()
    features = engine.features(prompts)
    prefill = (time.perf_counter() - t0) / max(1, len(prompts))
    decodes = {b: engine.decode(prompts, b - 1, max_new_tokens, temperature, top_p, seeds, stop_on_eos)
               for b in candidates}
    out = []
    for i in range(len(prompts)):
        state = SimpleNamespace(logits=torch.from_numpy(features[i]), prefill_seconds=prefill)
        per_b = {b: {"committed": d[i].committed, "new_tokens": len(d[i].token_ids), "seconds": d[i].seconds}
                 for b, d in decodes.items()}
        out.append(assemble_labels(state, candidates, per_b, step_cost))
    return out


def tokens_differ_across_b(decodes: Dict[int, list]) -> int:
    """How many prompts' tokens differ between candidates (at T = 0 speculative decoding is lossless: none should)."""
    bs = sorted(decodes)
    return sum(any(decodes[b][i].token_ids != decodes[bs[0]][i].token_ids for b in bs[1:])
               for i in range(len(decodes[bs[0]])))


def measure_profile(engine, block_sizes: Sequence[int], concurrency: Sequence[int], context_lengths: Sequence[int],
                    steps: int, rounds: int = 1, seed: int = 0, meta: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``cost_profile.json`` (version 3) from vLLM: at each c, c random-token prompts of each context length decode
    ``2 * steps`` tokens together (EOS ignored, so all c run to the end) at every b (shuffled per round); a point's
    step seconds are its requests' mean TPOT x tau (vllm_sweep.SweepPoint). b = 1 is timed too (K = 0)."""
    from pipeline.policy.vllm_sweep import SweepPoint, sweep_profile

    rng = random.Random(seed)
    vocab = engine.vocab_size
    bs = sorted({1, *map(int, block_sizes)})
    points, t0 = [], time.perf_counter()
    for r in range(rounds):
        for c in sorted(set(map(int, concurrency))):
            engine.set_concurrency(c)
            for n in context_lengths:
                prompts = [[rng.randrange(10, vocab - 10) for _ in range(int(n))] for _ in range(c)]
                order = bs[:]
                rng.shuffle(order)
                for b in order:
                    t = time.perf_counter()
                    got = engine.decode(prompts, b - 1, 2 * steps, stop_on_eos=False)
                    wall = time.perf_counter() - t
                    tokens = sum(len(d.token_ids) for d in got)
                    tpot = float(np.mean([d.seconds / max(1, len(d.token_ids) - 1) for d in got]))
                    tau = float(np.mean([d.tau for d in got]))
                    points.append(SweepPoint(b - 1, c, tokens / wall, tpot * 1e3, tau, None, f"context={n}", r))
    engine.set_concurrency(engine.max_num_seqs)
    d = sweep_profile(points, "vllm offline")
    d.update({"source": f"{engine.version}: LLM.generate, c requests together (pipeline/labelling/vllm_labels.py)",
              "device": (meta or {}).get("device", "vllm"), "rounds": rounds, "stable": False,  # no convergence check: the rounds asked for
              "wall_seconds": round(time.perf_counter() - t0, 2), "engine": engine.version,
              "context_lengths": list(map(int, context_lengths)), "steps": int(steps), **(meta or {})})
    return d
