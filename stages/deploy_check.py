"""``blockpilot deploy RUN --check-vllm``: what deploy prints, served by vLLM on this machine and measured.

vLLM is started with the printed configuration (the schedule by load when deploy prints one, else the fixed K), and
once more without speculation. The label set's val prompts (never an evaluation set) go through its OpenAI API at
c = 1 and at the largest evaluated c (``evaluate.concurrency``), T = 0, one prompt a request, c in flight
(pipeline.decoding.vllm_server). Printed at each load:

* K as configured there, and the K the server drafted at (its per-request ``per_step_drafted``);
* the server's acceptance length (ours: the last step clipped; and vLLM's own) against the labels' tau at that b on
  the same prompts;
* its throughput against the server without speculation, and whether their tokens are equal (T = 0: lossless).

It fails (exit 1) when a server refuses the configuration (with the server's message), when the server drafts a K the
configuration does not set at that load, or when speculation changes a token at T = 0. The acceptance and the
throughput are measurements to read, not pass marks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

CHECK_PROMPTS = 64  # val prompts per load: at c = 16, four times the slots, so most steps run with every slot full


def _configured_k(spec: Optional[Dict[str, Any]], batch: int) -> int:
    """K the configuration sets at ``batch`` running requests (vLLM's rule: a range's K holds to the next range)."""
    if not spec:
        return 0
    ranges = spec.get("num_speculative_tokens_per_batch_size")
    if not ranges:
        return int(spec["num_speculative_tokens"])
    k = int(ranges[0][2])
    for start, _end, kk in sorted(ranges):
        if start <= batch:
            k = int(kk)
    return min(k, int(spec["num_speculative_tokens"]))


def val_prompts(run, train_cfg, limit: int) -> List[Tuple[str, List[int]]]:
    """(prompt_id, input ids) of the label set's val split, in the prompt shards' order, at most ``limit``."""
    from pipeline.io.shards import list_shards
    from pipeline.io.storage import read_table
    from pipeline.policy.blocksize import split_of

    calib = train_cfg.calibration_fraction if train_cfg.objective == "speed" else 0.0
    got = []
    for shard in list_shards(run.prompts):
        for r in read_table(shard, columns=["prompt_id", "input_ids"]).to_pylist():
            if split_of(r["prompt_id"], train_cfg.val_fraction, calib) == "val":
                got.append((r["prompt_id"], list(r["input_ids"])))
    return got[:limit]


def labels_tau(run, ids: List[str]) -> Dict[int, float]:
    """{b: mean tau over ``ids``} from the label shards."""
    from pipeline.io.shards import list_shards
    from pipeline.io.storage import read_table

    want, rows = set(ids), []
    for shard in list_shards(run.labels):
        rows += [r for r in read_table(shard, columns=["prompt_id", "candidates", "tau"]).to_pylist()
                 if r["prompt_id"] in want]
    out: Dict[int, List[float]] = {}
    for r in rows:
        for b, t in zip(r["candidates"], r["tau"]):
            out.setdefault(int(b), []).append(float(t))
    return {b: sum(v) / len(v) for b, v in out.items()}


def _cost_model(run):
    """The run's LoadCost (the policy's cost profile), or None without one."""
    from pipeline.io.layout import COST_PROFILE
    from pipeline.policy.cost import CostProfile
    from pipeline.policy.load_cost import LoadCost

    path = run.policy / COST_PROFILE
    return LoadCost.from_profile(CostProfile.load(path)) if path.is_file() else None


def check_vllm(output_dir: str, say=print) -> int:
    from omegaconf import OmegaConf

    from pipeline.decoding.vllm_engine import check_installed
    from pipeline.decoding.vllm_server import ServerRefused, VllmServer
    from pipeline.evaluation.deploy import load_deploy, vllm_schedule_config, vllm_speculative_config
    from pipeline.io.layout import CONFIG, RunLayout
    from pipeline.io.storage import location

    version = check_installed()
    d = load_deploy(output_dir)
    run = RunLayout(location(output_dir))
    cfg = OmegaConf.create((run.train / CONFIG).read_text())
    ev = run.root / "eval" / CONFIG
    concurrency = [int(c) for c in OmegaConf.create(ev.read_text()).evaluate.concurrency] if ev.is_file() else \
        [int(c) for c in cfg.evaluate.concurrency]
    loads = sorted({1, max(concurrency)})
    spec = vllm_schedule_config(d) or (vllm_speculative_config(d) if d.block_size > 1 else None)
    prompts = val_prompts(run, cfg.train, CHECK_PROMPTS)
    if not prompts:
        raise ValueError(f"{run.prompts}: no val prompt in the label set (train.val_fraction) to check with")
    tau_b = labels_tau(run, [p for p, _ in prompts])
    ids = [p for _, p in prompts]
    new = int(cfg.decode.max_new_tokens)
    import torch

    from pipeline.decoding.models import resolve_device, resolve_dtype

    device = resolve_device(str(cfg.model.device))
    dtype = str(resolve_dtype(str(cfg.model.dtype), device)).replace("torch.", "")
    longest = max(len(p) for p in ids) + new + 64  # room for a last step's drafts past the budget
    eager = [] if torch.cuda.is_available() else ["--enforce-eager"]  # CPU: compiling buys nothing, costs ~20 s
    say(f"vLLM check ({version}, this machine): {len(ids)} val label prompts a load, T = 0, {new} new tokens, "
        f"c in {loads}; configuration: {json.dumps(spec) if spec else 'no speculation'}")
    runs: Dict[str, Dict[int, Any]] = {}
    logs = Path(run.root) / "deploy-check"
    logs.mkdir(parents=True, exist_ok=True)
    for name, conf in (("served", spec), ("no speculation", None)):
        if name == "served" and conf is None:
            continue
        server = VllmServer(d.target, conf, dtype=dtype, max_model_len=longest, max_num_seqs=max(loads),
                            seed=int(cfg.decode.seed), log_path=logs / f"{name.replace(' ', '-')}.log",
                            extra_args=eager)
        try:
            with server:
                say(f"  {name}: vLLM up in {server.start_seconds:.0f} s (log: {server.log_path})")
                runs[name] = {c: server.run(ids, c, new) for c in loads}
        except ServerRefused as err:
            say(f"vLLM check FAILED: the {name} configuration was refused: {err}")
            return 1
    plain = runs["no speculation"]
    served = runs.get("served", plain)
    model = _cost_model(run)
    failures, errors = [], []
    say("  c    running  K set  K drafted  acceptance ours / vLLM's  labels' tau at b   tok/s  no-spec tok/s  "
        "x no spec  modelled  tokens = no spec")
    for c in loads:
        s, p = served[c], plain[c]
        running = min(c, len(ids))  # requests in flight: the val split may hold fewer prompts than c
        k = _configured_k(spec, running)
        allowed = {_configured_k(spec, n) for n in range(1, running + 1)} if spec else set()
        drafted = s.drafted
        same = sum(a.token_ids == b.token_ids for a, b in zip(s.answers, p.answers))
        if not set(drafted) <= allowed:
            failures.append(f"c={c}: drafted K {drafted}, but the configuration sets {sorted(allowed)} "
                            f"at 1..{running} running requests")
        if same != len(ids):
            failures.append(f"c={c}: speculation changed the tokens of {len(ids) - same} of {len(ids)} prompts at "
                            "T = 0")
        acc = "-" if s.tau is None else f"{s.tau:.2f} / {s.vllm_tau:.2f}"
        tau = tau_b.get(k + 1, float("nan")) if k else 1.0
        lab = f"{tau:.2f} (b={k + 1})" if k else "1 (b=1)"
        measured = s.throughput / p.throughput
        modelled = None if model is None else tau * model.cost(1, running) / model.cost(k + 1, running)
        if modelled is not None:
            errors.append((c, modelled / measured - 1))
        say(f"  {c:<4} {running:<8} {k:<6} {','.join(map(str, drafted)) or '-':<10} {acc:<25} {lab:<17} "
            f"{s.throughput:7.1f}  {p.throughput:13.1f}  {measured:8.3f}x  "
            f"{'-' if modelled is None else f'{modelled:.3f}x':>8}  {same}/{len(ids)}")
    if errors:
        say("  the run's cost model (train/policy/cost_profile.json, labels' tau) against vLLM's measured x no "
            "speculation: " + ", ".join(f"c={c} {e:+.1%}" for c, e in errors)
            + f" (profile timed in {model.profile.meta.get('engine') or 'our engine'})")
    if len(ids) < max(loads):
        say(f"  note: {len(ids)} val prompts, so at most {len(ids)} requests ran together at c={max(loads)} "
            "(more label prompts, or train.val_fraction, give a full load)")
    for f in failures:
        say(f"vLLM check FAILED: {f}")
    if not failures:
        say("vLLM check passed: the configuration served, drafted as set at each load, lossless at T = 0")
    return 1 if failures else 0
