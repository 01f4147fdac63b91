"""The serving machine's cost profile, measured in vLLM, for ``blockpilot deploy RUN --cost-profile PATH``.

    .venv/bin/python benchmarks/vllm_cost_profile.py RUN_DIR --out /tmp/vllm-profile.json
    .venv/bin/blockpilot deploy RUN_DIR --cost-profile /tmp/vllm-profile.json --check-vllm

The run's models, dtype, candidates, ``profile.concurrency``, ``profile.context_lengths``, ``profile.steps`` and
``profile.min_repeats`` (rounds), timed by pipeline.labelling.vllm_labels.measure_profile on this machine: every b of
the candidates at K = b - 1 in one speculative vLLM engine, b = 1 in plain vLLM (no speculative config), and K = 0 in
the speculative engine as its own entry (``speculative_k0``: the drafter's forward still runs), step seconds = TPOT x
tau as ``vllm bench sweep serve`` gives them. The same routine label.engine=vllm times its profile with.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from omegaconf import OmegaConf

    from pipeline.decoding.models import locate, resolve_device, resolve_dtype
    from pipeline.decoding.vllm_engine import VllmEngine
    from pipeline.io.layout import CONFIG, POLICY_META, RunLayout
    from pipeline.labelling.vllm_labels import measure_profile
    from pipeline.policy.cost import CostProfile

    run = RunLayout(Path(a.run))
    cfg = OmegaConf.create((run.train / CONFIG).read_text())
    cands = [int(b) for b in json.loads((run.policy / POLICY_META).read_text())["candidates"]]
    m, pr = cfg.model, cfg.profile
    device = resolve_device(str(m.device))
    dtype = str(resolve_dtype(str(m.dtype), device)).replace("torch.", "")
    target, draft = locate(m.target, m.target_revision, "model.target"), locate(m.draft, m.draft_revision,
                                                                               "model.draft")
    cs = [int(c) for c in pr.concurrency]
    engine = VllmEngine(target.path, draft.path, dtype, max_k=max(cands) - 1, max_num_seqs=max(cs),
                        max_model_len=max(int(n) for n in pr.context_lengths) + 2 * int(pr.steps) + 64,
                        seed=int(cfg.decode.seed), enforce_eager=device.type != "cuda",
                        trust_remote_code=bool(m.trust_remote_code), target_revision=target.revision,
                        draft_revision=draft.revision).start()
    try:
        d = measure_profile(engine, cands, cs, [int(n) for n in pr.context_lengths], int(pr.steps),
                            rounds=int(pr.min_repeats), seed=int(cfg.decode.seed),
                            meta={"device": f"{device}/{dtype}", "run": str(run.root)})
    finally:
        engine.shutdown()
    CostProfile.from_dict(d).save(a.out)
    k0 = d.get("speculative_k0", {})
    print(f"{a.out}: {engine.version}, b in {d['block_sizes']}, c in {d['concurrency']}, {d['wall_seconds']:.0f} s")
    for c in d["concurrency"]:
        part = d if c == d["top_level_concurrency"] else d["load"][str(c)]
        plain = part["measured"]["1"]["total"]
        print(f"  c={c}: plain vLLM {plain * 1e3:.2f} ms a step; speculative K = 0 "
              + (f"{k0[str(c)] * 1e3:.2f} ms ({k0[str(c)] / plain:.2f}x plain)" if str(c) in k0 else "not timed")
              + "; " + ", ".join(f"b={b} {part['measured'][str(b)]['total'] * 1e3:.2f}" for b in cands
                                 if str(b) in part["measured"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
