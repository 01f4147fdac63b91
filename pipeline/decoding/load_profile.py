"""Timing the batched engine at every (b, c): the ``load`` part of ``cost_profile.json`` (pipeline.policy.load_cost).

For each c > 1 of the grid and each b, c streams of random prompts (one context length at a time, stop tokens off)
decode together at block size b on :class:`pipeline.decoding.batched.BatchedEngine`; a point is the median draft and
verify seconds over the run's steady steps (every row running, the first step of the run left out: it drafts over
the whole prompts' features). At one (c, context) the runs of every b go in lockstep (:func:`pipeline.decoding
.batched.lockstep`: one forward of each in turn), as evaluate times its methods: what the schedule b*(c) and the
cost model's speedups read is the ratio of two b's costs at one c, and timed one after the other on a shared
machine those ratios moved by 20-50 % between two workers' profiles of the same point (one default run: b = 8 at
c = 16 timed 35.1 and 23.1 ms, AR 5.6 and 9.0 ms, and b*(16) came out 4 where AR measured 10 % faster). Rounds
visit the (c, context) pairs in a shuffled order. The c = 1 part stays :func:`pipeline.policy.cost.measure_profile`'s
(the batch-1 engine, as every c = 1 result is measured).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from pipeline.decoding.batched import BatchedEngine, fixed
from pipeline.policy.load_cost import fit_load

# Engines in one lockstep group: all of the tiny pair's 7 load b's; at Qwen3-8B shapes each engine's target cache
# at c = 64 and 256 + 33 keys a row is ~2.7 GB in bf16 (36 layers x 8 KV heads x 128 x 2 x 2 bytes a key), so 8
# engines stay under ~22 GB beside the weights.
MAX_ENGINES = 8


def load_block_sizes(block_sizes: Sequence[int]) -> List[int]:
    """The b timed under load: 1, 2 and every other b up to the largest (the fit is affine in b: a point every
    other b is enough to check it, at half the start-up time), the largest included."""
    top = max(block_sizes)
    return sorted({1, 2, top} | set(range(2, top + 1, 2)))


def lockstep_groups(block_sizes: Sequence[int], max_engines: int = MAX_ENGINES) -> List[List[int]]:
    """The b timed together in lockstep, at most ``max_engines`` at once (each holds slot caches of its own), b = 1
    in every group: the anchor that ties every group's seconds to the same moment's AR."""
    sizes = sorted(int(b) for b in block_sizes)
    anchor, rest = [b for b in sizes if b == 1], [b for b in sizes if b != 1]
    per = max(1, max_engines - len(anchor))
    return [anchor + rest[i:i + per] for i in range(0, len(rest), per)] or [anchor]


def measure_load(engine, block_sizes: Sequence[int], concurrency: Sequence[int], vocab_size: int,
                 context_lengths: Sequence[int] = (64,), steps: int = 16, rounds: int = 2,
                 seed: int = 0, max_engines: int = MAX_ENGINES) -> Dict[str, Any]:
    """{"load": {c: {seconds, measured, fit, raw}}, "load_seconds": wall} for every c > 1 of ``concurrency``."""
    t0 = time.perf_counter()
    grid_c = sorted({int(c) for c in concurrency if int(c) > 1})
    if not grid_c:
        return {"load": {}, "load_seconds": 0.0}
    batched = BatchedEngine(engine)
    g = torch.Generator().manual_seed(seed)
    prompts = {ctx: [torch.randint(0, max(2, vocab_size - 8), (int(ctx),), generator=g).tolist()
                     for _ in range(max(grid_c))] for ctx in context_lengths}
    points = [(c, ctx) for c in grid_c for ctx in context_lengths]
    groups = lockstep_groups(block_sizes, max_engines)
    rng = np.random.default_rng(seed)
    saved, engine.stop_token_ids = engine.stop_token_ids, None
    raw: Dict[int, List[Dict[str, Any]]] = {c: [] for c in grid_c}
    try:
        batched.run(prompts[context_lengths[0]][:2], slots=2, max_new_tokens=8, choose=fixed(2))  # warm-up
        for rnd in range(1, rounds + 1):
            for i in rng.permutation(len(points)):
                c, ctx = points[i]
                for group in groups:
                    # Every stream commits >= 1 token a step: 2 * steps + 1 tokens keep all c rows running for at
                    # least `steps` steps when acceptance is low (random prompts), fewer when the draft guesses well.
                    runs = batched.run_lockstep([fixed(b) for b in group], prompts[ctx][:c], c, 2 * steps + 1)
                    for b, run in zip(group, runs):
                        full = [s for s in run.steps if s.kind == "decode" and s.rows == c][1:]
                        if full:
                            raw[c].append({"b": int(b), "context": int(ctx), "round": rnd, "steps": len(full),
                                           "width": float(np.mean([s.width for s in full])),
                                           "draft_seconds": float(np.median([s.draft_seconds for s in full])),
                                           "verify_seconds": float(np.median([s.verify_seconds for s in full]))})
    finally:
        engine.stop_token_ids = saved
    load = {}
    for c in grid_c:
        part = fit_load(raw[c], sorted({p["b"] for p in raw[c]}), list(context_lengths))
        load[str(c)] = {"seconds": {str(b): v for b, v in part["seconds"].items()},
                        "measured": {str(b): v for b, v in part["measured"].items()},
                        "fit": part["fit"], "raw": part["raw"]}
    return {"load": load, "load_seconds": round(time.perf_counter() - t0, 2)}


def profile_with_load(engine, cfg, trained_block_size: int, candidates: Sequence[int] = (), meta=None):
    """The profile ``cfg.profile`` asks for: the c = 1 profile (pipeline.policy.cost.profile_for) with, for every
    c > 1 of ``profile.concurrency``, the batched engine's seconds per step at every other b (format version 3)."""
    from pipeline.policy.cost import profile_for

    from pipeline.decoding.batched import require_batchable

    profile = profile_for(engine, cfg, trained_block_size, candidates, meta)
    p = cfg.profile
    try:
        require_batchable(engine)
    except ValueError as err:  # the pair decodes at c = 1; the batched engine does not serve it: no load grid
        profile.meta["load_skipped"] = str(err)
        return profile
    vocab = int(engine.target.get_output_embeddings().weight.shape[0])
    load = measure_load(engine, load_block_sizes(profile.seconds), p.concurrency, vocab,
                        context_lengths=p.context_lengths, steps=p.steps, rounds=p.load_rounds, seed=cfg.decode.seed)
    profile.meta.update(concurrency=[int(c) for c in p.concurrency], **load)
    profile.meta["wall_seconds"] = round(float(profile.meta.get("wall_seconds", 0.0)) + load["load_seconds"], 2)
    profile.version = 3
    return profile
