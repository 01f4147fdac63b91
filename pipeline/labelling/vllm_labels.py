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
``cost_profile.json`` format as the HF engine's, so that b*(c), tune and deploy read it unchanged. b = 1 is plain
vLLM, timed in an engine without a speculative config (:class:`PlainEngine`: what a server without
``--speculative-config`` runs), never K = 0 in the speculative engine, whose steps still run the drafter's forward
(vllm/v1/spec_decode/llm_base_proposer.py, the ``num_speculative_tokens == 0`` branch); that K = 0 is timed too,
as its own entry (``speculative_k0``, {c: step seconds}), which deploy prices a schedule's K = 0 ranges with.
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


class PlainEngine:
    """vLLM without a speculative config, beside a started VllmEngine (same target, dtype, lengths and seed): plain
    vLLM's step for the cost profile's b = 1. Its own ``vllm.LLM`` in this process (two coexist: measured on the
    bundled pair, plain up in ~4 s); on a GPU it takes what memory the speculative engine left."""

    def __init__(self, spec):
        import os

        from vllm import LLM

        self.spec, self.max_num_seqs, self.version = spec, spec.max_num_seqs, spec.version
        util = spec.gpu_memory_utilization
        try:
            import torch

            if torch.cuda.is_available():  # the speculative engine holds its share: take part of what is free
                free, total = torch.cuda.mem_get_info()
                util = max(0.01, 0.9 * free / total)
        except ImportError:
            pass
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{spec.cpu_kv_cache_gb:g}")
        self.llm = LLM(model=spec.target, revision=spec.target_revision, dtype=spec.dtype, seed=spec.seed,
                       max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs,
                       enforce_eager=spec.enforce_eager, gpu_memory_utilization=util,
                       trust_remote_code=spec.trust_remote_code, disable_log_stats=False,
                       skip_tokenizer_init=spec.skip_tokenizer_init)

    def set_concurrency(self, c: int) -> None:
        self.llm.llm_engine.engine_core.engine_core.scheduler.max_num_active_reqs = int(c)

    def decode(self, prompts, k: int, max_new_tokens: int, stop_on_eos: bool = True):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from pipeline.decoding.vllm_engine import VllmDecode

        assert k == 0, "plain vLLM drafts nothing"
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, detokenize=False,
                                ignore_eos=not stop_on_eos)
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        got = []
        for o in outs:
            ids, m = list(o.outputs[0].token_ids), o.metrics
            seconds = (m.last_token_ts - m.first_token_ts) if m is not None and m.last_token_ts > 0 else \
                wall / len(outs)
            got.append(VllmDecode(ids, [1] * max(0, len(ids) - 1), float(seconds), 1.0))
        return got

    def shutdown(self) -> None:
        """Dropped with the speculative engine it was started beside, never before it: freeing a vLLM engine in this
        process tears down the process's distributed state (vllm/v1/engine/core.py: cleanup_dist_env_and_memory; and
        so does collecting it), which the speculative engine still runs on (measured on the bundled pair: its next
        pass failed "pipeline model parallel group is not initialized")."""
        self.llm = None


def measure_profile(engine, block_sizes: Sequence[int], concurrency: Sequence[int], context_lengths: Sequence[int],
                    steps: int, rounds: int = 1, seed: int = 0, meta: Optional[Dict[str, Any]] = None,
                    plain=None) -> Dict[str, Any]:
    """``cost_profile.json`` (version 3) from vLLM: at each c, c random-token prompts of each context length decode
    ``2 * steps`` tokens together (EOS ignored, so all c run to the end) at every b (shuffled per round); a point's
    step seconds are its requests' mean TPOT x tau (vllm_sweep.SweepPoint). b = 1 is plain vLLM (``plain``, a
    PlainEngine; None: the one started beside ``engine``, kept as ``engine.plain_engine`` for as long as it lives),
    and K = 0 in ``engine`` is timed as the separate ``speculative_k0`` entry (module docstring)."""
    from pipeline.policy.vllm_sweep import SweepPoint, sweep_profile

    if plain is None:  # one per speculative engine, kept while it lives (PlainEngine.shutdown says why)
        plain = getattr(engine, "plain_engine", None) or PlainEngine(engine)
        engine.plain_engine = plain
    rng = random.Random(seed)
    vocab = engine.vocab_size
    bs = sorted({1, *map(int, block_sizes)})
    kinds = [(b, False) for b in bs] + [(1, True)]  # (b, speculative): (1, True) is K = 0 with the drafter loaded
    points, t0 = [], time.perf_counter()
    try:
        warm = [[rng.randrange(10, vocab - 10) for _ in range(int(min(context_lengths)))]]
        for which, k in ((plain, 0), (engine, 0), (engine, max(bs) - 1)):  # first passes allocate: untimed
            which.decode(warm, k, 4, stop_on_eos=False)
        for r in range(rounds):
            for c in sorted(set(map(int, concurrency))):
                engine.set_concurrency(c)
                plain.set_concurrency(c)
                for n in context_lengths:
                    prompts = [[rng.randrange(10, vocab - 10) for _ in range(int(n))] for _ in range(c)]
                    order = kinds[:]
                    rng.shuffle(order)
                    for b, in_spec in order:
                        which = plain if b == 1 and not in_spec else engine
                        t = time.perf_counter()
                        got = which.decode(prompts, b - 1, 2 * steps, stop_on_eos=False)
                        wall = time.perf_counter() - t
                        tokens = sum(len(d.token_ids) for d in got)
                        tpot = float(np.mean([d.seconds / max(1, len(d.token_ids) - 1) for d in got]))
                        tau = float(np.mean([d.tau for d in got]))
                        points.append(SweepPoint(b - 1, c, tokens / wall, tpot * 1e3, tau, None, f"context={n}", r,
                                                 speculative=b > 1 or in_spec))
    finally:
        engine.set_concurrency(engine.max_num_seqs)
    d = sweep_profile(points, "vllm offline")
    d.update({"source": f"{engine.version}: LLM.generate, c requests together (pipeline/labelling/vllm_labels.py)",
              "device": (meta or {}).get("device", "vllm"), "rounds": rounds, "stable": False,  # no convergence check: the rounds asked for
              "wall_seconds": round(time.perf_counter() - t0, 2), "engine": engine.version,
              "plain": "b = 1 timed in vLLM without a speculative config (PlainEngine); speculative_k0: K = 0 in the "
                       "speculative engine, the drafter's forward included",
              "context_lengths": list(map(int, context_lengths)), "steps": int(steps), **(meta or {})})
    return d
