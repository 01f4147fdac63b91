"""``blockpilot deploy RUN --check-vllm``: deploy's claim, served by vLLM on this machine and measured.

Deploy prices plain vLLM, one fixed K and one schedule at every load of its grid and says which it serves at each
(pipeline.evaluation.vllm_options; with ``--cost-profile``, under the serving machine's costs: the check serves that
choice, not the labelling machine's). The check starts what deploy serves, plain vLLM (no ``--speculative-config``)
and, where the served configuration's K at c = 1 is not the fixed K deploy would otherwise print, that fixed K, side
by side (pipeline.decoding.vllm_server.ServerPool), and at the loads of the grid that cover it, c = 1, the middle
grid load and the largest (each no larger than vllm.max_num_seqs), sends the label set's val prompts (never an
evaluation set; 4 requests per slot, at least 16, at most ``vllm.check_prompts``, the val prompts sent again in
turn where there are fewer) at T = 0, one prompt a request, c in flight. Each of ``vllm.check_repeats`` repeats runs every server once in a fresh order (a repeat's servers share the
machine's state), and the served configuration's tokens/s are paired with plain's per repeat: the gain with a 95 %
t interval over the log ratios (pipeline.evaluation.load.paired_ratio, as evaluate's and tune's paired figures).

It fails (exit 1), naming the load and the figures, when (:func:`judge`):

* the served configuration is slower than plain vLLM beyond noise (the interval's upper end below 0) at a load
  where deploy said speculation pays there;
* at c = 1, it is slower than the fixed K beyond noise;
* a token differs from plain vLLM's at T = 0 where the dtype makes that exact (float32); in float16 / bfloat16 vLLM
  promises equality only up to numerics, and the agreement rate is reported instead;
* the server drafts a K the configuration does not set at 1..c running requests (vLLM's own lookup);
* a server refuses the configuration (its message).

Where deploy serves plain vLLM at a load, the speculative server of its choice is timed there too and its ratio
printed: the measured reason for plain. The acceptance (ours: the last step clipped; vLLM's own) and the cost
model's error are printed beside, not pass marks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

MIN_PROMPTS, PER_SLOT = 16, 4  # prompts a load: PER_SLOT waves of c, at least MIN_PROMPTS (vllm.check_prompts caps)


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


def check_loads(grid: Sequence[int], most: int) -> List[int]:
    """c = 1, the middle load of the grid and its largest, each at most ``most`` (the server's max_num_seqs)."""
    cs = sorted({int(c) for c in grid if int(c) <= most} | {1})
    return sorted({cs[0], cs[len(cs) // 2], cs[-1]})


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


def _interval(a: Sequence[float], b: Sequence[float]) -> Dict[str, Any]:
    from pipeline.evaluation.load import paired_ratio

    return paired_ratio(list(a), list(b))


def _pct(r: Dict[str, Any]) -> str:
    ci = r.get("ci95")
    return f"{r['gain']:+.1%}" + ("" if ci is None else f" [{ci[0]:+.1%}, {ci[1]:+.1%}]") + \
        f" over {r['repeats']} repeats"


def judge(m: Dict[str, Any]) -> List[str]:
    """The failures of one checked load (module docstring), from its measured figures: ``c``, ``running``, ``serves``
    (the option's name), ``k`` (K set at c), ``pays`` (deploy said speculation pays at c), ``modelled`` (deploy's x
    plain there, or None), ``served`` / ``plain`` / ``fixed`` (tokens/s per repeat, paired by index; ``served`` None
    where plain is served; ``fixed`` None where not timed), ``fixed_k``, ``exact`` (float32: tokens must be equal),
    ``same`` / ``total`` (prompts whose tokens equal plain's), ``drafted`` / ``allowed`` (K drafted, K the
    configuration sets at 1..running)."""
    out, c = [], m["c"]
    where = f"c={c}" + ("" if m["running"] == c else f" ({m['running']} running: fewer val prompts than c)")
    if m.get("served") is not None:
        vs = _interval(m["served"], m["plain"])
        slower = vs["ci95"] is not None and vs["ci95"][1] < 0
        if slower and m["pays"]:
            out.append(f"{where}: the served configuration ({m['serves']}, K={m['k']}) ran "
                       f"{sum(m['served']) / len(m['served']):.1f} tok/s against plain vLLM's "
                       f"{sum(m['plain']) / len(m['plain']):.1f}: {_pct(vs)}, slower beyond noise where deploy said "
                       f"speculation pays (modelled {m['modelled']:.3f}x plain)" if m.get("modelled") else
                       f"{where}: the served configuration ({m['serves']}, K={m['k']}) is slower than plain vLLM "
                       f"beyond noise: {_pct(vs)}, where deploy said speculation pays")
    if c == 1 and m.get("fixed") is not None:
        mine = m["served"] if m.get("served") is not None else m["plain"]
        vf = _interval(mine, m["fixed"])
        if vf["ci95"] is not None and vf["ci95"][1] < 0:
            out.append(f"{where}: the served configuration ({m['serves']}, K={m['k']}) ran "
                       f"{sum(mine) / len(mine):.1f} tok/s against the fixed K={m['fixed_k']}'s "
                       f"{sum(m['fixed']) / len(m['fixed']):.1f}: {_pct(vf)}, slower beyond noise at c = 1")
    if m["exact"] and m["same"] != m["total"]:
        out.append(f"{where}: speculation changed the tokens of {m['total'] - m['same']} of {m['total']} prompts at "
                   "T = 0 in float32 (exact there)")
    if not set(m.get("drafted") or []) <= set(m.get("allowed") or []):
        out.append(f"{where}: drafted K {sorted(m['drafted'])}, but the configuration sets {sorted(m['allowed'])} "
                   f"at 1..{m['running']} running requests")
    return out


def merge_verdicts(old: Dict[str, Dict[str, Any]], new: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """verdicts.json after a check: a new measurement of a (load, configuration) replaces the kept one unless the
    kept one was beyond noise (its interval off 0) and the new one is not: a check within noise does not erase a
    measured loss (else deploy would serve plain there, the next check see the speculative server within noise, and
    the one after serve it again)."""
    def decided(v: Dict[str, Any]) -> bool:
        ci = v.get("ci95")
        return bool(ci) and (ci[1] < 0 or ci[0] > 0)

    out = dict(old)
    for k, v in new.items():
        if k not in out or decided(v) or not decided(out[k]):
            out[k] = v
    return out


def _cost_model(run):
    """The run's LoadCost (the policy's cost profile), or None without one."""
    from pipeline.io.layout import COST_PROFILE
    from pipeline.policy.cost import CostProfile
    from pipeline.policy.load_cost import LoadCost

    path = run.policy / COST_PROFILE
    return LoadCost.from_profile(CostProfile.load(path)) if path.is_file() else None


def check_settings(run) -> Tuple[int, int]:
    """(vllm.check_repeats, vllm.check_prompts): the run's config where it has them, else conf/default.yaml's
    (a run made before the keys existed); validated as the config's checks do."""
    from omegaconf import OmegaConf

    from pipeline.io.layout import CONFIG
    from pipeline.runtime.config import load_config

    cfg = OmegaConf.create((run.train / CONFIG).read_text())
    v = cfg.get("vllm") or {}
    base = load_config().vllm
    repeats = int(v.get("check_repeats", base.check_repeats))
    prompts = int(v.get("check_prompts", base.check_prompts))
    if repeats < 2:
        raise ValueError(f"vllm.check_repeats = {repeats}: must be >= 2 (a paired interval needs two repeats)")
    if prompts < 1:
        raise ValueError(f"vllm.check_prompts = {prompts}: must be >= 1")
    return repeats, prompts


def check_vllm(output_dir: str, say=print, cost_profile: Optional[str] = None, deploy=None, pool=None,
               seed: int = 0, repeats: Optional[int] = None) -> int:
    """Serve what deploy prints and judge it (module docstring); exit status. ``deploy``: a Deploy to check instead
    of the run's (a test forces a losing one); ``pool``: a ServerPool to reuse (closed by the caller); ``repeats``:
    instead of vllm.check_repeats."""
    from omegaconf import OmegaConf

    from pipeline.decoding.vllm_engine import check_installed
    from pipeline.decoding.vllm_server import ServerPool, ServerRefused
    from pipeline.evaluation.deploy import load_deploy, served_configs, vllm_speculative_config
    from pipeline.evaluation.vllm_options import PLAIN
    from pipeline.io.layout import CONFIG, RunLayout
    from pipeline.io.storage import location

    version = check_installed()
    d = deploy if deploy is not None else load_deploy(output_dir, cost_profile)
    run = RunLayout(location(output_dir))
    cfg = OmegaConf.create((run.train / CONFIG).read_text())
    configured, most_prompts = check_settings(run)
    repeats = configured if repeats is None else int(repeats)
    served_at = served_configs(d)
    max_seqs = int(cfg.vllm.max_num_seqs)
    loads = check_loads(list(served_at), max_seqs)
    prompts = val_prompts(run, cfg.train, most_prompts)
    if not prompts:
        raise ValueError(f"{run.prompts}: no val prompt in the label set (train.val_fraction) to check with")
    tau_b = labels_tau(run, [p for p, _ in prompts])
    ids = [p for _, p in prompts]
    new = int(cfg.decode.max_new_tokens)
    import torch

    from pipeline.decoding.models import resolve_device, resolve_dtype

    device = resolve_device(str(cfg.model.device))
    dtype = str(resolve_dtype(str(cfg.model.dtype), device)).replace("torch.", "")
    exact = dtype == "float32"

    def at(c: int) -> Optional[Dict[str, Any]]:  # the config served at c: its grid point's (the range holding c)
        return served_at[max(x for x in served_at if x <= c)]

    fixed = vllm_speculative_config(d) if d.block_size > 1 else None
    need_fixed = fixed is not None and _configured_k(at(1), 1) != _configured_k(fixed, 1)
    opt = d.options
    spec_of_choice = None
    if opt is not None and opt.speculative:
        from pipeline.evaluation.deploy import option_config

        spec_of_choice = option_config(d, opt.speculative)
    configs = {json.dumps(at(c)) for c in loads} | {json.dumps(None)}
    if need_fixed:
        configs.add(json.dumps(fixed))
    if spec_of_choice is not None and any(at(c) is None for c in loads):
        configs.add(json.dumps(spec_of_choice))  # the measured reason for plain where deploy serves it
    longest = max(len(p) for p in ids) + new + 64  # room for a last step's drafts past the budget
    extra = [] if torch.cuda.is_available() else ["--enforce-eager"]  # CPU: compiling buys nothing, costs ~20 s
    if torch.cuda.is_available():  # the servers share one GPU
        extra += ["--gpu-memory-utilization", f"{float(cfg.vllm.gpu_memory_utilization) / len(configs):.3f}"]
    say(f"vLLM check ({version}, this machine): val label prompts at T = 0, {new} new tokens, c in {loads}, "
        f"{repeats} paired repeats each (servers side by side, a fresh order each repeat); deploy serves "
        + ("; ".join(f"c={c}: {json.dumps(at(c)) if at(c) else 'plain vLLM'}" for c in loads))
        + (f"; the fixed K={d.block_size - 1} at c = 1 beside it" if need_fixed else ""))
    logs = Path(run.root) / "deploy-check"
    logs.mkdir(parents=True, exist_ok=True)
    own = pool is None
    pool = pool if pool is not None else ServerPool(log_dir=logs)
    if pool.log_dir is None:
        pool.log_dir = logs
    kw = dict(dtype=dtype, max_model_len=longest, max_num_seqs=max_seqs, seed=int(cfg.decode.seed),
              extra_args=tuple(extra), cpu_kv_cache_gb=float(cfg.vllm.cpu_kv_cache_gb))
    try:
        wanted = [("plain" if key == "null" else "fixed" if need_fixed and key == json.dumps(fixed) else "served",
                   json.loads(key)) for key in sorted(configs)]
        try:
            servers = pool.start(wanted, d.target, **kw)
        except ServerRefused as err:
            say(f"vLLM check FAILED: a configuration was refused: {err}")
            return 1
        for key, server in servers.items():
            say(f"  {'plain vLLM' if key == 'null' else key}: up in {server.start_seconds:.0f} s (log: "
                f"{server.log_path})")
        rng = random.Random(seed)
        measured = []
        for c in loads:
            n = min(max(MIN_PROMPTS, PER_SLOT * c), most_prompts)
            these = [ids[i % len(ids)] for i in range(n)]  # the val prompts again where fewer: c stay in flight
            mine = json.dumps(at(c))
            timed = [json.dumps(None)] + ([mine] if at(c) is not None else []) + \
                ([json.dumps(fixed)] if c == 1 and need_fixed else []) + \
                ([json.dumps(spec_of_choice)] if at(c) is None and spec_of_choice is not None else [])
            timed = list(dict.fromkeys(timed))
            runs: Dict[str, List[Any]] = {k: [] for k in timed}
            for _ in range(repeats):
                order = timed[:]
                rng.shuffle(order)
                for k in order:
                    runs[k].append(servers[k].run(these, c, new))
            measured.append((c, n, mine, runs))
    finally:
        if own:
            pool.close()
    model = _cost_model(run)
    failures: List[str] = []
    verdicts: Dict[str, Dict[str, Any]] = {}

    def verdict(c: int, config: str, tps: List[float], plain: List[float]) -> None:
        r = _interval(tps, plain)
        verdicts[f"{c}|{config}"] = {"c": c, "config": config, "gain": r["gain"], "ci95": r["ci95"],
                                     "repeats": r["repeats"], "slower": bool(r["ci95"] and r["ci95"][1] < 0),
                                     "why": f"the speculative server measured {_pct(r)} against plain vLLM"}

    say("  c    serves          K set  K drafted  acceptance ours / vLLM's  labels' tau   tok/s served  tok/s plain  "
        "x plain, 95 % paired                       modelled  tokens = plain")
    notes = []
    for c, n, mine, runs in measured:
        running = min(c, n)  # requests in flight (n requests, the val prompts cycled where fewer)
        spec = json.loads(mine)
        plain = [r.throughput for r in runs[json.dumps(None)]]
        serves = PLAIN if spec is None else (opt.serve[max(x for x in opt.serve if x <= c)] if opt else "printed")
        k = _configured_k(spec, running)
        s_runs = runs.get(mine) if spec is not None else None
        ref = s_runs or runs[json.dumps(None)]
        last, base = ref[-1], runs[json.dumps(None)][-1]
        same = sum(a.token_ids == b.token_ids for a, b in zip(last.answers, base.answers))
        point = max(x for x in served_at if x <= c)
        modelled = opt.ratio(point) if opt is not None and spec is not None else None
        m = {"c": c, "running": running, "serves": serves, "k": k, "pays": bool(opt.pays(point)) if opt else
             spec is not None, "modelled": modelled, "served": None if s_runs is None else [r.throughput
                                                                                           for r in s_runs],
             "plain": plain, "fixed": ([r.throughput for r in runs[json.dumps(fixed)]] if c == 1 and need_fixed
                                       else None), "fixed_k": d.block_size - 1, "exact": exact, "same": same,
             "total": n, "drafted": last.drafted if spec is not None else [],
             "allowed": ({_configured_k(spec, x) for x in range(1, running + 1)} if spec else set())}
        failures += judge(m)
        if m["served"] is not None:
            verdict(c, mine, m["served"], plain)
        acc = "-" if last.tau is None else f"{last.tau:.2f} / {last.vllm_tau:.2f}"
        tau = tau_b.get(k + 1, float("nan")) if k else 1.0
        lab = f"{tau:.2f} (b={k + 1})" if k else "1 (b=1)"
        vs = _interval(m["served"], plain) if m["served"] is not None else None
        served_tps = sum(m["served"]) / repeats if m["served"] is not None else sum(plain) / repeats
        say(f"  {c:<4} {serves[:15]:<15} {k:<6} {','.join(map(str, m['drafted'])) or '-':<10} {acc:<25} {lab:<12} "
            f"{served_tps:12.1f}  {sum(plain) / repeats:11.1f}  "
            f"{'(plain itself)' if vs is None else _pct(vs):<42} "
            f"{'-' if modelled is None else f'{modelled:.3f}x':>8}  {same}/{n}" + ("" if exact else " (agreement)"))
        if m["fixed"] is not None:
            vf = _interval(m["served"] if m["served"] is not None else plain, m["fixed"])
            notes.append(f"c={c}: against the fixed K={d.block_size - 1} ({sum(m['fixed']) / repeats:.1f} tok/s): "
                         f"{_pct(vf)}")
        if spec is None and spec_of_choice is not None and json.dumps(spec_of_choice) in runs:
            alt = [r.throughput for r in runs[json.dumps(spec_of_choice)]]
            verdict(c, json.dumps(spec_of_choice), alt, plain)
            mod = opt.ratio(point, opt.speculative) if opt else None
            notes.append(f"c={c}: deploy serves plain vLLM here; the speculative server ({opt.speculative}) measured "
                         f"{_pct(_interval(alt, plain))} against it" + (f" (modelled {mod:.3f}x)" if mod else ""))
        if model is not None and spec is not None and m["served"] is not None:
            mod = tau * model.cost(1, running) / model.cost(k + 1, running) if k else None
            if mod is not None:
                notes.append(f"c={c}: the run's own cost model (labelling machine) says {mod:.3f}x, measured "
                             f"{1 + vs['gain']:.3f}x")
    for x in notes:
        say(f"  {x}")
    if deploy is None:  # the run's own claim: deploy takes these verdicts back (vllm_options.apply_verdicts)
        from pipeline.evaluation.deploy import VERDICTS

        path = logs / VERDICTS
        old = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps(merge_verdicts(old, verdicts), indent=1) + "\n")
        if any(v["slower"] for v in verdicts.values()):
            say(f"  verdicts: {path} (deploy now serves plain vLLM where the speculative server was measured "
                "slower beyond noise; run deploy again)")
    if len(ids) < max(max(MIN_PROMPTS, PER_SLOT * c) for c in loads):
        say(f"  note: {len(ids)} val prompts, sent again in turn to make up each load's requests")
    for f in failures:
        say(f"vLLM check FAILED: {f}")
    if not failures:
        say(f"vLLM check passed: at c in {loads} the configuration deploy serves was not slower than plain vLLM "
            "beyond noise where deploy said speculation pays" + (", nor than the fixed K at c = 1" if need_fixed
                                                                  else "")
            + f", drafted as set, tokens {'equal to plain at T = 0 (float32)' if exact else 'agreement reported'}")
    return 1 if failures else 0
