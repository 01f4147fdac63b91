"""Where the 0.547x comes from (issue 68, point 6): plain vLLM against the schedule deploy printed, and against a
speculative server whose schedule is K = 0 at every batch size, at c = 16 with one wave of 16 requests and with
several (64 prompts), interleaved and repeated on the servers kept up side by side.

    .venv/bin/python benchmarks/vllm_k0_cost.py RUN_DIR --repeats 5 --out /tmp/k0.json

RUN_DIR is a default run (``blockpilot run``); its val label prompts are sent at T = 0, ``decode.max_new_tokens`` new
tokens each (pipeline.decoding.vllm_server, as ``deploy --check-vllm``). Each repeat runs every (server, scenario) in
a fresh random order; ratios are paired per repeat (pipeline.evaluation.load.paired_ratio: mean ratio - 1, 95 % t
interval over the log ratios). ``uptime`` is recorded before and after each repeat: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--c", type=int, default=16)
    ap.add_argument("--waves", type=int, default=4, help="the several-waves scenario: waves x c prompts")
    ap.add_argument("--inner", type=int, default=4, help="one-wave runs back to back per repeat (each its own wave "
                    "of c; tokens/s over all): one wave alone lasts under a second here")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from omegaconf import OmegaConf

    from pipeline.decoding.vllm_server import VllmServer
    from pipeline.evaluation.deploy import load_deploy, vllm_schedule_config
    from pipeline.evaluation.load import paired_ratio
    from pipeline.io.layout import CONFIG, RunLayout
    from stages.deploy_check import val_prompts

    run = RunLayout(Path(a.run))
    cfg = OmegaConf.create((run.train / CONFIG).read_text())
    d = load_deploy(a.run)
    printed = vllm_schedule_config(d)
    if printed is None:
        ap.error("the run's deploy prints no schedule")
    k0 = {**printed, "num_speculative_tokens_per_batch_size": [[1, 1024, 0]]}
    prompts = [p for _, p in val_prompts(run, cfg.train, a.c * a.waves)]
    if len(prompts) < a.c * a.waves:
        ap.error(f"{len(prompts)} val prompts < {a.c * a.waves}")
    new = int(cfg.decode.max_new_tokens)
    longest = max(map(len, prompts)) + new + 64
    scen = {"one wave": prompts[:a.c], f"{a.waves} waves": prompts}
    servers = {name: VllmServer(d.target, spec, max_model_len=longest, max_num_seqs=a.c, seed=int(cfg.decode.seed),
                                log_path=Path(f"/tmp/k0-{name.replace(' ', '-')}.log"), extra_args=["--enforce-eager"])
               for name, spec in (("plain", None), ("printed schedule", printed), ("schedule K = 0 everywhere", k0))}
    rows, loads = [], []
    try:
        for name, s in servers.items():
            s.start()
            print(f"{name}: up in {s.start_seconds:.0f} s", flush=True)
        for s in servers.values():  # warm-up: first requests allocate
            s.run(prompts[:a.c], a.c, 16)
        rng = random.Random(0)
        for r in range(a.repeats):
            loads.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
            order = [(n, sc) for n in servers for sc in scen]
            rng.shuffle(order)
            for n, sc in order:
                if sc == "one wave":
                    parts = [servers[n].run(scen[sc], a.c, new) for _ in range(a.inner)]
                    got = type(parts[0])(a.c, sum(p.seconds for p in parts), [x for p in parts for x in p.answers])
                else:
                    got = servers[n].run(scen[sc], a.c, new)
                drafted = got.drafted
                rows.append({"repeat": r, "server": n, "scenario": sc, "tokens": got.tokens, "seconds": got.seconds,
                             "throughput": got.throughput, "drafted": drafted,
                             "tokens_ids": [x.token_ids for x in got.answers]})
                print(f"repeat {r} {n:26s} {sc:9s} {got.throughput:8.1f} tok/s K drafted {drafted}", flush=True)
        loads.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    finally:
        for s in servers.values():
            s.stop()
    out = {"run": a.run, "printed": printed, "c": a.c, "new_tokens": new, "repeats": a.repeats, "uptime": loads,
           "ratios": {}, "throughput": {}}
    for sc in scen:
        def thr(n):
            return [x["throughput"] for x in sorted(rows, key=lambda x: x["repeat"])
                    if x["server"] == n and x["scenario"] == sc]
        out["throughput"][sc] = {n: thr(n) for n in servers}
        plain = thr("plain")
        for n in servers:
            if n != "plain":
                out["ratios"][f"{sc}: {n} / plain"] = paired_ratio(thr(n), plain)
        out["ratios"][f"{sc}: printed schedule / schedule K = 0 everywhere"] = paired_ratio(
            thr("printed schedule"), thr("schedule K = 0 everywhere"))
        same = [x["tokens_ids"][:a.c] for x in rows if x["scenario"] == sc and x["repeat"] == 0]
        out.setdefault("tokens_equal", {})[sc] = all(t == same[0] for t in same)
        out.setdefault("drafted", {})[sc] = {n: sorted({k for x in rows if x["server"] == n and x["scenario"] == sc
                                                        for k in x["drafted"]}) for n in servers}
    for k, v in out["ratios"].items():
        lo, hi = v["ci95"] or (float("nan"), float("nan"))
        print(f"{k}: {1 + v['gain']:.3f}x [{1 + lo:.3f}, {1 + hi:.3f}] over {v['repeats']} repeats")
    print("uptime:", *loads, sep="\n  ")
    if a.out:
        for x in rows:
            del x["tokens_ids"]
        out["rows"] = rows
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
