"""Evaluate at load: the evaluation prompts served c at a time by the batched engine (continuous batching), each method
timed in wall clock, interleaved and repeated, beside the cost model's seconds for the same steps.

Per c of ``evaluate.concurrency`` (c > 1; c = 1 is evaluate's per-prompt pass), the methods are ``AR``, every
candidate ``b=N``, and ``adaptive``: the policy at c (pipeline.policy.blocksize.BlockSizePolicy.at_load: its fallback
the train-chosen b at c, the schedule b*(c)). The baselines of the headline are ``AR`` (no speculation, a choice at
every load), ``b*(c)`` (the train-chosen b at c, which is AR itself where not speculating is modelled fastest) and
``b*(1)`` (the c = 1 choice, what a user deploys today at every load). A method whose
choice for every request equals another's is the same computation: it is not decoded again, its rows name the
method it shares (``same_as``), and its gain over it is exactly 0.

Wall clock: every repeat runs its decodes in **lockstep** (pipeline.decoding.batched.lockstep: one forward of each in
turn, in an order shuffled per repeat, each run's clock stopped while another runs), so that the machine's drift,
+-10 % within minutes on a shared 2-core machine, hits every method of a repeat alike; the first repeat runs every
distinct decode, the later ones adaptive and its baselines (AR among them) only. The measured gain is the ratio of mean throughputs;
its interval is a t interval over the repeats' paired log ratios. Modelled: the ragged step model
(pipeline.policy.load_cost.LoadCost.step_seconds) over each run's own steps, plus its measured prefill seconds.
Ray-free.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

ADAPTIVE = "adaptive"

LOAD_CARD = """
## `load.parquet` and `load.json`: the evaluation at load (each c > 1 of `evaluate.concurrency`)

Every evaluation prompt served c at a time by the batched engine (continuous batching), one row per c x method x
timed repeat. `load.json` holds per c the table (`methods`), the `headline` (adaptive against `AR`, `b*(c)`, the
train-chosen b at c as tune's load check left it (`tune/load_check.json`; AR where b*(c) = 1), and `b*(1)`, the c = 1 choice: `measured` gain of mean throughputs with a paired t interval over
the repeats, `modelled_gain`) and the `cost_model` (modelled / measured speedup over AR - 1 per method); its `where`
says where the pass ran (the Ray node and GPU ids of the task, with its device; a list, one per chunk, when the
prompts were cut into chunks), and each c its `chunks` and `engines_at_once` (how many methods' engines ran in
lockstep: all of them unless their slot caches exceed the memory plan's budget, pipeline/executor/memory_checks.py;
then the methods run in groups, adaptive with its baselines; the fewest of any chunk). On GPUs each load's prompts
are cut into chunks of whole waves, one per GPU worker (`load/<c>-<chunk>.parquet` and `.json`, each saved as it
ends: a rerun decodes only the chunks missing), and the rows here merge them (`merge_chunks`: the whole-run
throughput and latencies then count each chunk's ragged tail; the `full_*` steady state does not).

| column | meaning |
| --- | --- |
| `concurrency` | c: requests decoding together |
| `method` | `AR`, `b=N`, `adaptive` (the policy at c) |
| `repeat` | the timed repeat (0-based; adaptive and its baselines, AR among them, run `evaluate.load_repeats` times, the rest once) |
| `same_as` | the method whose decode this is, when both choose the same for every request (not decoded twice), else null |
| `requests`, `new_tokens`, `steps` | prompts served, tokens generated in all, batched decode steps |
| `block_sizes` | the distinct block sizes the method's requests ran at |
| `wall_seconds` | measured seconds of the whole run (prefills included) |
| `prefill_seconds`, `decode_seconds` | measured seconds of the prefill forwards, of the decode steps |
| `modelled_decode_seconds` | the ragged cost model's seconds for the same decode steps (cost_profile.json v3) |
| `throughput`, `modelled_throughput` | new tokens per second: measured; modelled (decode model + measured prefill) |
| `latency_mean`, `latency_p50`, `latency_p95` | per request, seconds from its admission (prefill) to its last token |
| `latencies` | per request, seconds from its admission to its last token (in prompt order) |
| `full_steps`, `full_tokens` | the decode steps with all c rows running (the steady state a server with more requests than slots runs, and what b*(c) models), and the tokens they committed |
| `full_decode_seconds`, `modelled_full_decode_seconds` | measured seconds of those steps; the ragged cost model's |
| `full_throughput`, `modelled_full_throughput` | tokens per second over those steps (decode only): measured; the ragged cost model's; null without a full step |
| `window_throughput` | tokens per second over the full steps of the window all runs of its lockstep share (the turns until the first of them leaves its full steps: `window_throughputs`); the paired measure tune's load check decides on; null when the run had no lockstep partner or a run of its lockstep no full step, and in a row merged from several chunks (each chunk's lockstep has its own window) |
"""


# Student's t 0.975 quantiles by degrees of freedom (standard tables; scipy is not in the stack): a paired interval
# over a handful of repeats.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def _t95(df: int) -> float:
    return T975.get(df) or T975[max(k for k in T975 if k <= df)] if df < 30 else 1.96 + 2.4 / df


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> Dict[str, Any]:
    """mean(a) / mean(b) - 1 with a 95 % t interval over the paired log ratios log(a_i / b_i) (repeats interleaved,
    so a pair shares the machine's state); exactly 0 with [0, 0] for identical lists."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    gain = float(a.mean() / b.mean() - 1)
    if np.array_equal(a, b):
        return {"gain": 0.0, "ci95": [0.0, 0.0], "repeats": int(len(a)), "identical": True}
    d = np.log(a / b)
    if len(d) < 2:
        return {"gain": gain, "ci95": None, "repeats": int(len(d))}
    half = _t95(len(d) - 1) * float(d.std(ddof=1)) / math.sqrt(len(d))
    return {"gain": gain, "ci95": [math.expm1(d.mean() - half), math.expm1(d.mean() + half)],
            "repeats": int(len(d))}


def window_throughputs(runs: Sequence, c: int) -> List[Optional[float]]:
    """Tokens per second of runs driven in one lockstep, each over the same window of turns: their first W forwards,
    W the turn where the first of them left its full steps (all c rows running). Full-step throughputs over each
    run's whole full phase pair badly: AR's full phase lasts about twice b's (at c = 16, 273 steps against 106), so
    most of AR's is timed while b is in its tail or done, and a drift there hits AR alone. Paired by the window, AR
    against b = 4 at c = 16 spread 2.4 % per repeat over the full phases where two identical decodes spread 0.6 %
    (benchmarks/results/load-check-noise.md). None for every run when one has no full step (or runs alone)."""
    def last_full(run):
        idx = [i for i, s in enumerate(run.steps) if s.kind == "decode" and s.rows == c]
        return idx[-1] if idx else None

    ends = [last_full(r) for r in runs]
    if len(runs) < 2 or None in ends:
        return [None] * len(runs)
    w = min(ends) + 1
    out = []
    for run in runs:
        full = [s for s in run.steps[:w] if s.kind == "decode" and s.rows == c]
        out.append(sum(s.committed for s in full) / sum(s.draft_seconds + s.verify_seconds for s in full))
    return out


def run_row(c: int, method: str, repeat: int, run, load_cost, same_as: Optional[str] = None) -> Dict[str, Any]:
    """One timed batched run as a row: measured and modelled seconds, throughput, per-request latency."""
    decode = [s for s in run.steps if s.kind == "decode"]
    prefill = sum(s.verify_seconds for s in run.steps if s.kind == "prefill")
    measured_steps = sum(s.draft_seconds + s.verify_seconds for s in decode)
    modelled_steps = load_cost.run_seconds(run.steps) if load_cost is not None else None
    # The steady state: the steps with all c rows running, what a server with more requests than slots runs and
    # what the schedule b*(c) models (full steps of c rows). A finite prompt set also has a ragged tail, longer for
    # a speculative method whose requests finish at scattered steps than for AR's (at c = 16 on the default run
    # b = 4 took 177 steps for 5,235 tokens, 106 of them with all rows running; AR 381, 273 of them full).
    full = [s for s in decode if s.rows == c]
    full_measured = sum(s.draft_seconds + s.verify_seconds for s in full)
    full_modelled = load_cost.run_seconds(full) if load_cost is not None and full else None
    full_tokens = sum(s.committed for s in full)
    lat = np.array([r.latency for r in run.requests])
    sizes = sorted({int(r.choice[0]) for r in run.requests})
    return {"concurrency": int(c), "method": method, "repeat": int(repeat), "same_as": same_as,
            "requests": len(run.requests), "new_tokens": int(run.new_tokens), "steps": len(decode),
            "block_sizes": sizes, "wall_seconds": float(run.wall_seconds), "prefill_seconds": float(prefill),
            "decode_seconds": float(measured_steps),
            "modelled_decode_seconds": None if modelled_steps is None else float(modelled_steps),
            "throughput": run.new_tokens / run.wall_seconds,
            "modelled_throughput": None if modelled_steps is None else run.new_tokens / (modelled_steps + prefill),
            "full_steps": len(full), "full_tokens": int(full_tokens), "full_decode_seconds": float(full_measured),
            "modelled_full_decode_seconds": None if full_modelled is None else float(full_modelled),
            "full_throughput": full_tokens / full_measured if full_measured > 0 else None,
            "modelled_full_throughput": full_tokens / full_modelled if full_modelled else None,
            **_latencies(lat)}


def _latencies(lat: np.ndarray) -> Dict[str, Any]:
    return {"latencies": [float(x) for x in lat], "latency_mean": float(lat.mean()),
            "latency_p50": float(np.percentile(lat, 50)), "latency_p95": float(np.percentile(lat, 95))}


SUMMED = ("requests", "new_tokens", "steps", "wall_seconds", "prefill_seconds", "decode_seconds", "full_steps",
          "full_tokens", "full_decode_seconds")


def merge_chunks(chunks: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One load's rows over chunks of its prompts (each decoded apart, :func:`evaluate_at_load` on a contiguous
    chunk) as one part over all of them gives them: per method x repeat (those in every chunk: a method that shares
    a decode in one chunk and not in another keeps the repeats they all have), the sums of the chunks' tokens,
    steps and seconds, and the throughputs and latencies over those sums; ``same_as`` where every chunk agrees.
    Adaptive and its baselines are timed in every repeat of every chunk, each chunk's repeat in one lockstep, so
    their merged repeats stay paired. Exact up to the decode order, except where a statistic depends on which
    prompts share a wave: each chunk starts with a full wave and ends with its own ragged tail (rows < c), so the
    whole-run ``throughput``, ``wall_seconds`` and the latencies of k chunks count k tails where one part counts one;
    the ``full_*`` steady state does not. ``window_throughput`` is each chunk's own lockstep's: null once merged."""
    if len(chunks) == 1:
        return chunks[0]
    by = [{(r["method"], r["repeat"]): r for r in rows} for rows in chunks]
    out = []
    for key in (k for k in by[0] if all(k in b for b in by[1:])):
        rs = [b[key] for b in by]
        row = {**rs[0], **{k: sum(r[k] for r in rs) for k in SUMMED}, "window_throughput": None,
               "block_sizes": sorted({b for r in rs for b in r["block_sizes"]}),
               "same_as": rs[0]["same_as"] if all(r["same_as"] == rs[0]["same_as"] for r in rs) else None}
        for k in ("modelled_decode_seconds", "modelled_full_decode_seconds"):
            row[k] = None if any(r[k] is None for r in rs) else sum(r[k] for r in rs)
        modelled, full, full_modelled = (row["modelled_decode_seconds"], row["full_decode_seconds"],
                                         row["modelled_full_decode_seconds"])
        row.update(throughput=row["new_tokens"] / row["wall_seconds"],
                   modelled_throughput=None if modelled is None else
                   row["new_tokens"] / (modelled + row["prefill_seconds"]),
                   full_throughput=row["full_tokens"] / full if full > 0 else None,
                   modelled_full_throughput=row["full_tokens"] / full_modelled if full_modelled else None,
                   **_latencies(np.array([x for r in rs for x in r["latencies"]])))
        out.append(row)
    return out


def evaluate_at_load(batched, prompts: List[List[int]], c: int, choosers: Dict[str, Callable], baselines: Sequence[str],
                     repeats: int, max_new_tokens: int, load_cost=None, seed: int = 0,
                     log: Callable[[str], None] = lambda s: None, max_engines: Optional[int] = None,
                     until: Optional[Callable[[List[Dict[str, Any]]], bool]] = None,
                     **sampling) -> List[Dict[str, Any]]:
    """Rows for every method of ``choosers`` ({method: choose(i, logits, hidden)}) at concurrency c. Methods whose
    choices coincide for every request share one decode (the first named); ``baselines`` and ``adaptive`` are
    timed ``repeats`` times, the rest once. ``sampling``: temperature, top_p, top_k as the engine takes them; at
    T > 0 each repeat draws afresh (torch's generator seeded ``seed`` + repeat).

    ``max_engines`` bounds the engines in lockstep (each holds its own slot caches: the memory plan's choice): a
    repeat's methods then run in groups of that many, adaptive and its baselines in the first group together (their
    paired ratios stay within one lockstep), the groups one after the other.

    ``until(rows)``: asked after each repeat with the rows so far; True ends the repeats there (``repeats`` is then a
    cap: tune's sequential load check)."""
    choices = _choices(batched, prompts, choosers)
    distinct: Dict[str, str] = {}  # method -> the method whose decode it is
    for m in choosers:
        distinct[m] = next((o for o in distinct if distinct[o] == o and choices[o] == choices[m]), m)
    timed = [m for m in choosers if distinct[m] == m]
    repeated = {distinct[m] for m in [*baselines, ADAPTIVE] if m in distinct}
    rng = np.random.default_rng(seed)
    rows: List[Dict[str, Any]] = []
    for rep in range(repeats):
        order = [m for m in timed if rep == 0 or m in repeated]
        order = [order[i] for i in rng.permutation(len(order))]
        order = [m for m in order if m in repeated] + [m for m in order if m not in repeated]
        size = max(1, min(max_engines or len(order), len(order)))
        t0 = time.perf_counter()
        torch.manual_seed(seed + rep)
        runs = []
        for g in range(0, len(order), size):
            group = order[g:g + size]
            runs += batched.run_lockstep([lambda j, lg, h, fc=choices[m]: fc[j] for m in group], prompts, c,
                                         max_new_tokens, **sampling)
        windows = []
        for g in range(0, len(order), size):
            windows += window_throughputs(runs[g:g + size], c)
        for m, run, window in zip(order, runs, windows):
            rows.append({**run_row(c, m, rep, run, load_cost), "window_throughput": window})
        log(f"c={c} repeat {rep + 1}/{repeats}: {len(order)} methods, {size} at a time in lockstep "
            f"({time.perf_counter() - t0:.1f} s): "
            + ", ".join(f"{m} {r['throughput']:.0f}" for m, r in zip(order, rows[-len(order):])) + " tok/s")
        if until is not None and until(rows):
            break
    for m, o in distinct.items():  # the methods that share a decode: its rows under their name
        if o != m:
            rows += [{**r, "method": m, "same_as": o} for r in rows if r["method"] == o and r["same_as"] is None]
    return rows


def _choices(batched, prompts, choosers) -> Dict[str, List]:
    """Each method's (block size, rule) per request, from the prompt's prefill (one packed prefill pass for all, the
    same logits every method reads)."""
    seen: Dict[int, tuple] = {}

    def record(i, logits, hidden):
        seen[i] = (logits, hidden)
        return (1, None)

    batched.run(prompts, slots=max(1, min(len(prompts), 16)), max_new_tokens=1, choose=record)
    return {m: [tuple(ch(i, *seen[i])) for i in range(len(prompts))] for m, ch in choosers.items()}


def load_summary(rows: List[Dict[str, Any]], c: int, baselines: Dict[str, str]) -> Dict[str, Any]:
    """The table and the headline at c: per method mean measured and modelled throughput and latency; adaptive
    against each baseline ({name: method}), measured (paired over repeats) and modelled; the cost model's mean
    |speedup error| (modelled / measured speedup over AR, per method)."""
    at = [r for r in rows if r["concurrency"] == c]
    def order(m):  # AR, the fixed b ascending, the rest by name, adaptive last
        return (0, 0, "") if m == "AR" else (1, int(m[2:]), "") if m.startswith("b=") else (2, m == ADAPTIVE, m)

    methods = sorted(dict.fromkeys(r["method"] for r in at), key=order)
    table = {}
    for m in methods:
        rs = [r for r in at if r["method"] == m]
        table[m] = {k: float(np.mean([r[k] for r in rs])) for k in ("throughput", "latency_mean", "latency_p95",
                                                                  "wall_seconds")}
        mt = [r["modelled_throughput"] for r in rs if r["modelled_throughput"] is not None]
        table[m].update(modelled_throughput=float(np.mean(mt)) if mt else None, repeats=len(rs),
                        same_as=rs[0]["same_as"], block_sizes=rs[0]["block_sizes"])
        for k in ("full_throughput", "modelled_full_throughput"):  # rows written before the column: absent
            vals = [r[k] for r in rs if r.get(k) is not None]
            table[m][k] = float(np.mean(vals)) if vals else None
    head = {}
    for name, base in baselines.items():
        a = [r["throughput"] for r in at if r["method"] == ADAPTIVE]
        b = [r["throughput"] for r in at if r["method"] == base]
        n = min(len(a), len(b))
        measured = paired_ratio(a[:n], b[:n]) if n else None
        ma, mb = table.get(ADAPTIVE, {}).get("modelled_throughput"), table.get(base, {}).get("modelled_throughput")
        head[name] = {"baseline": base, "measured": measured,
                      "modelled_gain": None if not (ma and mb) else ma / mb - 1}
    errors, full_errors = _speedup_errors(table, "throughput"), _speedup_errors(table, "full_throughput")
    fastest = {k: max((m for m in table if table[m].get(k)), key=lambda m: table[m][k], default=None)
               for k in ("throughput", "full_throughput")}
    return {"concurrency": c, "methods": table, "headline": head, "fastest": fastest,
            "cost_model": {"speedup_error": errors,
                           "mean_abs_speedup_error": float(np.mean(np.abs(list(errors.values())))) if errors else None,
                           "full_speedup_error": full_errors,
                           "mean_abs_full_speedup_error": float(np.mean(np.abs(list(full_errors.values()))))
                           if full_errors else None}}


def _speedup_errors(table: Dict[str, Dict[str, Any]], key: str) -> Dict[str, float]:
    """{method: modelled speedup over AR / measured speedup over AR - 1} for a throughput ``key`` of the table
    (its modelled twin is ``modelled_`` + key), every method but AR where both are known."""
    ar, mkey = table.get("AR") or {}, f"modelled_{key}"
    if not (ar.get(key) and ar.get(mkey)):
        return {}
    return {m: (t[mkey] / ar[mkey]) / (t[key] / ar[key]) - 1 for m, t in table.items()
            if m != "AR" and t.get(key) and t.get(mkey)}


def render_load(s: Dict[str, Any]) -> List[str]:
    """A short table per load, as the run's closing lines print it."""
    c, t = s["concurrency"], s["methods"]
    ar = t.get("AR", {}).get("throughput")
    ar_full = t.get("AR", {}).get("full_throughput")
    lines = [f"c={c}: method              tok/s  modelled   x AR  latency p50/p95 s   full steps: tok/s modelled  x AR"]
    for m, r in t.items():
        mod = f"{r['modelled_throughput']:8.1f}" if r.get("modelled_throughput") else "       -"
        same = f"  (= {r['same_as']})" if r.get("same_as") else ""
        fu, fm = r.get("full_throughput"), r.get("modelled_full_throughput")
        fmod = f"{fm:8.1f}" if fm else "       -"
        full = f"   {fu:7.1f}  {fmod}  {fu / ar_full if ar_full else 0:5.2f}x" if fu else "   -"
        lines.append(f"  {m:<20} {r['throughput']:7.1f}  {mod}  {r['throughput'] / ar if ar else 0:5.2f}x  "
                     f"{r['latency_mean']:.2f}/{r['latency_p95']:.2f}{' ' * 8}{full}{same}")
    for name, h in s["headline"].items():
        me = h["measured"]
        ci = me.get("ci95") if me else None
        ci_s = f"[{ci[0]:+.2%}, {ci[1]:+.2%}]" if ci else "(no interval)"
        mod = f"{h['modelled_gain']:+.2%}" if h["modelled_gain"] is not None else "-"
        lines.append(f"  adaptive vs {name} ({h['baseline']}): measured {me['gain']:+.2%} {ci_s} over "
                     f"{me['repeats']} repeats; modelled {mod}")
    err, full_err = s["cost_model"]["mean_abs_speedup_error"], s["cost_model"].get("mean_abs_full_speedup_error")
    if err is not None:
        lines.append(f"  cost model: mean |speedup error| {err:.1%}"
                     + (f" (full steps alone: {full_err:.1%})" if full_err is not None else ""))
    fastest = s.get("fastest") or {}
    if fastest.get("full_throughput"):
        lines.append(f"  fastest: {fastest['throughput']} over the whole run (its ragged tail included), "
                     f"{fastest['full_throughput']} over the full steps (the steady state b*(c) models)")
    k = s.get("engines_at_once")
    if k and k < len(t):
        lines.append(f"  timed {k} method(s) at a time: every method's slot caches at once exceed the memory plan")
    return lines
