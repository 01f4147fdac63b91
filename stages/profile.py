"""profile: the cost model alone (pipeline/policy/cost.py) -> ``cost_profile.json``, e.g. on a serving machine.

Seconds per decode step at every b in 1..the largest the run decodes (draft forward and target verify timed apart, at a few context
lengths, warmed up and repeated until stable), the affine fit and the raw points. Train takes it as
``train.cost_profile=PATH`` to label for that machine; label measures the same once per worker by itself.
"""

from __future__ import annotations

import time
from typing import Any, Dict

from pipeline.runtime.config import PipelineConfig
from pipeline.runtime.log import get as log
from pipeline.io.storage import location


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    import torch

    from pipeline.labelling.labels import candidate_block_sizes
    from pipeline.policy.cost import FILENAME, largest_decoded_block_size
    from pipeline.decoding.load_profile import profile_with_load
    from pipeline.decoding.compiled import apply_compile
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.decoding.provenance import model_provenance
    from stages.label import trained_block_size

    t0 = time.monotonic()
    out = location(cfg.profile.output) if cfg.profile.output else location(cfg.output_dir) / FILENAME
    m = cfg.model
    models = load_models(m)
    if models.device.type == "cpu":
        torch.set_num_threads(1)  # as a label worker of one CPU runs (workers.cpus_per_worker = 1)
    apply_compile(models, cfg.engine.compile)  # the engine evaluate serves with
    engine = Engine(models.target, models.draft, models.stop_token_ids)
    B = trained_block_size(cfg)
    revisions = {"target_revision": model_provenance(m.target, m.target_revision, "model.target")["revision"],
                 "draft_revision": model_provenance(m.draft, m.draft_revision, "model.draft")["revision"]}
    candidates = candidate_block_sizes(B, cfg.label.k)  # what label would profile
    top = cfg.profile.max_block_size or largest_decoded_block_size(cfg, B, candidates)
    log("profile").info(f"timing draft and verify per step at b = 1..{top} on "
                        f"{models.device}/{str(models.dtype).replace('torch.', '')}")
    profile = profile_with_load(engine, cfg, B, candidates, {**revisions, "worker": "profile"})
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    f = profile.fit
    log("profile").info(f"done: {profile.meta['rounds']} rounds in {profile.meta['wall_seconds']} s -> {out}")
    log("profile").info(f"draft {f['draft']['intercept'] * 1e3:.3f} + {f['draft']['slope'] * 1e3:.4f} b ms, "
                        f"verify {f['verify']['intercept'] * 1e3:.3f} + {f['verify']['slope'] * 1e3:.4f} b ms "
                        f"(stable={profile.meta['stable']})")
    loads = profile.meta.get("load") or {}
    if loads:  # one line for the whole grid: the batched step's seconds at the smallest and largest b, per c
        parts = [f"c={c} " + " ".join(f"b={b}:{float(s) * 1e3:.1f}" for b, s in sorted(part["seconds"].items(),
                                                                                      key=lambda x: int(x[0]))
                                      if int(b) in (1, 2, 8, 16)) for c, part in loads.items()]
        log("profile").info(f"ms per batched step: {'; '.join(parts)}")
    return {"stage": "profile", "status": "done", "output": str(out),
            "seconds_ms": {b: round(s * 1e3, 3) for b, s in sorted(profile.seconds.items())},
            "spread": {b: round(s, 3) for b, s in sorted(profile.spread.items())}, "fit": f,
            "rounds": profile.meta["rounds"], "stable": profile.meta["stable"],
            "wall_seconds": round(time.monotonic() - t0, 1)}
