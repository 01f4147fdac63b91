"""The pipeline's non-GPU parts at cluster scale, on this machine (issue #66).

    python benchmarks/scale.py --prompts 100000                  # S3 at 30 ms a request, 16 logical GPUs
    python benchmarks/scale.py --prompts 10000 --latency-ms 0    # a local disk instead of the store
    python benchmarks/scale.py --prompts 2000 --vocab 151936     # label rows of the published width

What is real: the driver (``pipeline.executor.driver.run_stage``), the Ray actor pool on a multi-node Ray cluster of
this machine whose nodes advertise logical GPUs (``ray.cluster_utils.Cluster``, Ray's own; one actor per logical GPU,
its "models" on the CPU), the preflight, prepare (the real stage on a generated JSONL source, the bundled tokenizer),
real Parquet shards, sidecars, manifests, the lease and the skip/resume checks, and the S3 test server (moto) behind
the fault proxy (tests/fault_proxy.py) with ``--latency-ms`` added to every request, which the proxy counts.

What stands in, named as such: **the GPU's work.** The label worker's setup loads no model and its cost profile is a
fixed one (``StandInLabel``); ``process_shard`` reads its real prompt shard, sleeps ``--gpu-s-per-prompt`` a prompt
(0: the pure overhead), and writes label rows of the real schema whose logits are random fp16 values of width
``--vocab`` (151,936 is Qwen3's; a smaller width keeps 100k rows inside the test server's memory) and whose trace is
the size a ``--max-new-tokens`` decode at tau ~5 leaves. Everything around it (reading the prompt shard, the rows,
the reject/sidecar/shard writes, Ray's calls, the driver's loop) is the real code.

Printed: one table row per phase (wall seconds, the driver's CPU seconds, store requests, each per shard too), and
the GPUs' idle share of a 1M-prompt label run on 64 GPUs from the measured per-shard overheads and
``--published-gpu-s-per-prompt`` (2.25 s: ~1,600 prompts a GPU-hour, benchmarks/gpu_label_costs.py's estimate for
Qwen3-8B at the published settings). ``--json FILE`` keeps the numbers (benchmarks/results/scale.md was made from
them). Run nothing else on the machine meanwhile: wall times are this 2-core machine's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega vector tensor kernel shard prompt "
         "label block draft target verify accept cluster driver store object latency budget").split()


# ---- the store: moto behind the fault proxy, in processes of their own -------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_proxy(upstream: str, port: int, latency_s: float, counts: str) -> None:
    """The fault proxy with a latency and nothing else, counting requests by method into ``counts`` (a JSON file,
    rewritten every 0.2 s) until killed. Its own process: its threads must not be charged to the driver's CPU."""
    sys.path.insert(0, str(REPO / "tests"))
    from fault_proxy import FaultProxy

    proxy = FaultProxy(upstream, port=port, latency_s=latency_s)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        with proxy._lock:
            n = len(proxy.log)
            by = {}
            for m, _, _ in proxy.log:
                by[m] = by.get(m, 0) + 1
        tmp = counts + ".tmp"
        Path(tmp).write_text(json.dumps({"total": n, "by_method": by}))
        os.replace(tmp, counts)
        time.sleep(0.2)


class Store:
    """moto's S3 server and the latency proxy in front of it; ``requests()`` counts what reached the proxy."""

    def __init__(self, latency_ms: float, workdir: Path):
        self.moto_port, self.proxy_port = free_port(), free_port()
        self.counts = str(workdir / "proxy-counts.json")
        self.moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.moto_port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.proxy = subprocess.Popen(
            [sys.executable, __file__, "--serve-proxy", f"http://127.0.0.1:{self.moto_port}", str(self.proxy_port),
             str(latency_ms / 1e3), self.counts], start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{self.proxy_port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        self._wait()
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.moto_port}", aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="scale")

    def _wait(self) -> None:
        import urllib.request

        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.moto_port}", timeout=1)
                if Path(self.counts).exists():
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the S3 test server or the proxy did not start")
            time.sleep(0.2)

    def requests(self) -> int:
        time.sleep(0.5)  # the proxy rewrites its counts every 0.2 s
        return int(json.loads(Path(self.counts).read_text())["total"])

    def stop(self) -> None:
        for p in (self.proxy, self.moto):
            p.kill()
            p.wait(10)


class LocalDisk:
    """``--latency-ms 0``: output on this machine's disk; no request is counted."""

    def __init__(self, workdir: Path):
        self.env: Dict[str, str] = {}

    def requests(self) -> int:
        return 0

    def stop(self) -> None:
        pass


# ---- the stand-in for the GPU's work -----------------------------------------------------------------------------

def stand_in_class():
    from stages.label import LabelStage

    class StandInLabel(LabelStage):
        """label with the GPU's work stood in for (see the module docstring); every other part is LabelStage's."""

        gpu_s_per_prompt = 0.0
        vocab = 1024

        def setup(self, worker) -> None:
            import torch

            from pipeline.policy.cost import CostProfile

            self.worker = worker
            self.device, self.compiled, self.profile_sharing = "stand-in/bfloat16", False, None
            self.models = SimpleNamespace(vocab_size=self.vocab, device=torch.device("cpu"), dtype=torch.bfloat16)
            # A fixed profile: 20 ms + 1 ms a drafted token (the shape, not a measurement).
            self.cost_profile = CostProfile(seconds={b: 0.02 + 0.001 * b for b in range(1, 2 * max(self.candidates))},
                                            meta={"wall_seconds": 0.0, "rounds": 1, "stable": True, "stand_in": True})
            self.step_cost = self.cost_profile.costs(self.candidates)

        def process_shard(self, input, rejects):
            import numpy as np

            from pipeline.io.storage import read_table
            from pipeline.labelling.shard import label_row, label_table

            table = read_table(input, columns=["prompt_id", "source", "input_ids", "prompt_tokens"])
            time.sleep(self.gpu_s_per_prompt * table.num_rows)  # THE STAND-IN: the GPU decoding these prompts
            rng = np.random.default_rng(abs(hash(str(input))) % (1 << 32))
            cands, tb, m = self.candidates, self.trace_block_size, self.cfg.decode.max_new_tokens
            rows = []
            for rec in table.select(["prompt_id", "source", "prompt_tokens"]).to_pylist():
                tau = np.sort(rng.uniform(1.0, 6.0, len(cands))).astype(float)
                steps = max(1, int(m / 5))
                out = SimpleNamespace(
                    candidates=cands, tau=list(tau), steps=[int(m / t) for t in tau], new_tokens=[m] * len(cands),
                    decode_seconds=[0.0] * len(cands), label_block_size=cands[-1], label_index=len(cands) - 1,
                    label_speedup_index=len(cands) - 1, prefill_seconds=0.0, trace_seconds=0.0,
                    trace=SimpleNamespace(block_size=tb, stopped=False,
                                          match=rng.integers(0, tb, steps).tolist(),
                                          confidence=rng.random((steps, tb)).astype(np.float32).tolist()))
                logits = rng.standard_normal(self.vocab, dtype=np.float32).astype(np.float16)
                rows.append(label_row(rec, out, logits, self.worker.identity))
            from pipeline.io.storage import location

            return label_table(rows, self.vocab, {**self.shard_metadata(), "batching": {}, "continuations": [],
                                                  "input_shard": location(input).name})

    return StandInLabel


# ---- timing the real driver's phases ------------------------------------------------------------------------------

class Clock:
    """Wall and driver-CPU seconds and store requests of named phases; wraps the real functions (timing only)."""

    def __init__(self, store):
        self.store = store
        self.phases: Dict[str, Dict[str, float]] = {}
        self.sent: Dict[str, float] = {}
        self.back: Dict[str, float] = {}
        self.worker_seconds: List[float] = []
        self.first_send: Optional[float] = None

    @staticmethod
    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    @contextmanager
    def phase(self, name: str, requests: bool = True):
        req0 = self.store.requests() if requests else 0
        t0, c0 = time.monotonic(), self.cpu()
        yield
        self.add(name, time.monotonic() - t0, self.cpu() - c0, (self.store.requests() - req0) if requests else None)

    def add(self, name: str, wall: float, cpu: float, requests: Optional[int]) -> None:
        p = self.phases.setdefault(name, {"wall_s": 0.0, "driver_cpu_s": 0.0, "requests": 0})
        p["wall_s"] += wall
        p["driver_cpu_s"] += cpu
        p["requests"] = None if requests is None or p["requests"] is None else p["requests"] + requests

    def wrap(self, owner, attr: str, name: str) -> None:
        """Time every call of ``owner.attr`` as phase ``name`` (wall and driver CPU; requests not counted inside
        the run: counting costs a 0.5 s sleep)."""
        fn = getattr(owner, attr, None)
        if fn is None:
            return
        clock = self

        def timed(*a, **k):
            t0, c0 = time.monotonic(), clock.cpu()
            try:
                return fn(*a, **k)
            finally:
                clock.add(name, time.monotonic() - t0, clock.cpu() - c0, None)

        setattr(owner, attr, timed)

    def install(self, stage) -> None:
        """The phase timers: on ``stage`` each run, on the driver's classes and modules once."""
        import pipeline.executor.driver as driver
        from pipeline.executor.folder import StageFolder
        from pipeline.executor.ray.pool_run import PoolRun

        self.wrap(stage, "plan", "planning")  # an instance attribute, gone before the stage is shipped (below)
        if getattr(PoolRun, "_scale_timed", False):
            return
        PoolRun._scale_timed = True
        self.wrap(StageFolder, "previous_summary", "skip check")
        self.wrap(driver, "_place", "to-do check")
        self.wrap(driver, "write_manifest", "manifest")
        self.wrap(driver, "_complete", "closing (finalize, summary, card)")
        self.wrap(PoolRun, "start", "preflight")
        clock, send, init = self, PoolRun.send, PoolRun.__init__

        def timed_send(run, a, task):
            now = time.monotonic()
            clock.first_send = clock.first_send or now
            clock.sent[task.name] = now
            return send(run, a, task)

        def init_with_done(run, pool, ray, stage, tasks, done):
            stage.__dict__.pop("plan", None)  # the timing wrapper holds this process's locks: not for the actors
            def recorded(task, result, error):
                clock.back[task.name] = time.monotonic()
                if result:
                    clock.worker_seconds.append(float(result.get("seconds", 0.0)))
                return done(task, result, error)

            init(run, pool, ray, stage, tasks, recorded)

        PoolRun.send, PoolRun.__init__ = timed_send, init_with_done


# ---- the run -------------------------------------------------------------------------------------------------------

def write_source(path: Path, n: int, seed: int = 0) -> None:
    """``n`` distinct prompts of 20-120 words (a chat prompt of ~40-200 tokens with the bundled tokenizer)."""
    import random

    rnd = random.Random(seed)
    with path.open("w") as fh:
        for i in range(n):
            words = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(20, 120)))
            fh.write(json.dumps({"prompt": f"Request {i}: {words}?"}) + "\n")


def config(args, output: str, source: Path, address: str, workdir: Path):
    from pipeline.runtime.config import load_config

    conf = workdir / "scale.yaml"
    conf.write_text(json.dumps({  # JSON is YAML
        "output_dir": output, "progress": True,
        "model": {"device": "cpu"},
        "decode": {"max_new_tokens": args.max_new_tokens},
        "prepare": {"sources": [{"name": "synthetic", "kind": "jsonl", "path": str(source), "field": "prompt"}],
                    "limit": None, "shard_size": args.shard_size},
        "label": {"num_workers": None if address else args.nodes * args.gpus_per_node},
        "workers": {"cpus_per_worker": 1, "max_retries": 1},
        "ray": {"address": address}}))
    return load_config(config_file=str(conf))


def run_prepare(cfg_dict: Dict[str, Any], env: Dict[str, str], out: str) -> None:
    """prepare in a process of its own (its peak RSS is the head's memory for prepare)."""
    os.environ.update(env)
    from omegaconf import OmegaConf

    from pipeline.runtime.config import PipelineConfig
    from stages import prepare

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PipelineConfig), cfg_dict))
    t0 = time.monotonic()
    summary = prepare.run(cfg)
    r = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_text(json.dumps({"wall_s": time.monotonic() - t0, "peak_rss_mb": r.ru_maxrss / 1024,
                                     "cpu_s": r.ru_utime + r.ru_stime, "rows": summary.get("rows"),
                                     "shards": summary.get("shards")}))


def run_tune_read(cfg_dict: Dict[str, Any], env: Dict[str, str], out: str) -> None:
    """tune's read of the label rows' traces (pipeline.evaluation.rule_search.read_traced, with tune.max_rows where
    the code has it) in a process of its own: its peak RSS is what tune holds in the head."""
    import inspect

    os.environ.update(env)
    from pipeline.evaluation.rule_search import read_traced
    from pipeline.io.layout import RunLayout
    from pipeline.io.shards import list_shards
    from pipeline.io.storage import location

    t = cfg_dict["train"]  # the splits are train's
    cap = {"max_rows": cfg_dict["tune"]["max_rows"]} if "max_rows" in inspect.signature(read_traced).parameters else {}
    t0 = time.monotonic()
    got = read_traced(list_shards(RunLayout(location(cfg_dict["output_dir"])).labels), t["val_fraction"],
                      t["calibration_fraction"], **cap)
    r = resource.getrusage(resource.RUSAGE_SELF)
    rows = sum(len(v) for k, v in got.items() if k != "counts")
    Path(out).write_text(json.dumps({"wall_s": time.monotonic() - t0, "peak_rss_mb": r.ru_maxrss / 1024,
                                     "cpu_s": r.ru_utime + r.ru_stime, "rows": rows, **cap}))


def in_child(fn, cfg, env: Dict[str, str], workdir: Path, name: str) -> Dict[str, Any]:
    """``fn(cfg as a dict, env, result file)`` in a spawned process; its JSON result."""
    from dataclasses import asdict

    got = workdir / f"{name}.json"
    p = mp.get_context("spawn").Process(target=fn, args=(asdict(cfg), env, str(got)))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{name} failed ({p.exitcode})")
    return json.loads(got.read_text())


def cluster(nodes: int, gpus_per_node: int, env: Dict[str, str]):
    from ray.cluster_utils import Cluster

    os.environ.update(env)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # The workers import this checkout's code (not an installed copy's): the same code as the driver's.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False})
    for _ in range(nodes):
        c.add_node(num_cpus=gpus_per_node, num_gpus=gpus_per_node)
    c.wait_for_nodes()
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10000, help="label prompts prepared and labelled")
    ap.add_argument("--nodes", type=int, default=4, help="worker nodes of the local Ray cluster")
    ap.add_argument("--gpus-per-node", type=int, default=4, help="logical GPUs a node advertises (an actor each)")
    ap.add_argument("--latency-ms", type=float, default=30.0, help="added to every store request; 0 = a local disk")
    ap.add_argument("--vocab", type=int, default=1024, help="logits width of a label row (151936: Qwen3's)")
    ap.add_argument("--shard-size", type=int, default=64, help="prepare.shard_size")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="decode.max_new_tokens (the trace's size)")
    ap.add_argument("--gpu-s-per-prompt", type=float, default=0.0, help="THE STAND-IN's seconds a prompt (0: overhead only)")
    ap.add_argument("--published-gpu-s-per-prompt", type=float, default=2.25,
                    help="a prompt's GPU seconds on the real cluster, for the idle share (2.25: ~1,600 a GPU-hour)")
    ap.add_argument("--target-prompts", type=int, default=1_000_000, help="the run the idle share is computed for")
    ap.add_argument("--target-gpus", type=int, default=64)
    ap.add_argument("--prepare-only", action="store_true",
                    help="prepare alone (its wall, head peak RSS and requests), no Ray cluster: e.g. at 1M prompts")
    ap.add_argument("--json", help="write the measured numbers here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--serve-proxy", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_proxy:
        upstream, port, latency, counts = args.serve_proxy
        serve_proxy(upstream, int(port), float(latency), counts)
        return 0

    workdir = Path(tempfile.mkdtemp(prefix="bp-scale-"))
    store = Store(args.latency_ms, workdir) if args.latency_ms > 0 else LocalDisk(workdir)
    output = f"s3://scale/run-{args.prompts}" if args.latency_ms > 0 else str(workdir / "run")
    clock = Clock(store)
    c = None
    try:
        t = time.monotonic()
        source = workdir / "prompts.jsonl"
        write_source(source, args.prompts)
        print(f"[scale] {args.prompts} prompts generated in {time.monotonic() - t:.1f} s; output {output}; "
              f"latency {args.latency_ms:g} ms", flush=True)
        if not args.prepare_only:
            c = cluster(args.nodes, args.gpus_per_node, store.env)
        # without a cluster, prepare cuts shards for label.num_workers = the workers the harness would start
        cfg = config(args, output, source, c.address if c else None, workdir)
        r0 = store.requests()
        prep = in_child(run_prepare, cfg, store.env, workdir, "prepare")
        prep["requests"] = store.requests() - r0
        shards = prep["shards"]
        print(f"[scale] prepare: {prep['rows']} prompts in {shards} shards, {prep['wall_s']:.1f} s, peak RSS "
              f"{prep['peak_rss_mb']:.0f} MB, {prep['requests']} requests", flush=True)
        if args.prepare_only:
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "prepare": prep}, indent=1) + "\n")
            return 0

        from pipeline.executor.ray.executor import execute

        StandIn = stand_in_class()
        StandIn.gpu_s_per_prompt, StandIn.vocab = args.gpu_s_per_prompt, args.vocab

        def label():
            stage = StandIn(cfg)
            clock.install(stage)
            return execute(stage)

        t_label = time.monotonic()
        with clock.phase("label (first run)"):
            summary = label()
        start_to_first = (clock.first_send or time.monotonic()) - t_label
        turnaround = [clock.back[n] - clock.sent[n] for n in clock.sent if n in clock.back]
        first = dict(clock.phases)
        clock.phases = {}
        with clock.phase("rerun: complete"):
            again = label()
        assert again.get("skipped"), again
        rerun = dict(clock.phases)
        clock.phases = {}
        from pipeline.io.storage import location

        victim = location(output) / "labels" / "part-00001.parquet"
        victim.unlink()
        with clock.phase("rerun: one shard deleted"):
            third = label()
        assert not third.get("skipped") and third["rows"] == summary["rows"], third
        deleted = dict(clock.phases)
        r0 = store.requests()
        tune = in_child(run_tune_read, cfg, store.env, workdir, "tune-read")
        tune["requests"] = store.requests() - r0
        print(f"[scale] tune's read: {tune['rows']} rows, {tune['wall_s']:.1f} s, peak RSS {tune['peak_rss_mb']:.0f} MB",
              flush=True)
    finally:
        if c is not None:
            import ray

            ray.shutdown()
            c.shutdown()
        store.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    result = {"args": vars(args), "prepare": prep, "label": first, "rerun_complete": rerun,
              "rerun_one_deleted": deleted, "tune_read": tune, "shards": shards, "workers": args.nodes * args.gpus_per_node,
              "start_to_first_dispatch_s": start_to_first, "turnaround_s": turnaround,
              "worker_seconds": clock.worker_seconds}
    report(result, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def report(r: Dict[str, Any], args) -> None:
    import statistics as st

    shards, prompts = r["shards"], r["prepare"]["rows"]
    print(f"\n## {prompts:,} prompts, {shards:,} shards, {r['workers']} workers (logical GPUs), "
          f"{args.latency_ms:g} ms a request, V = {args.vocab}, stand-in {args.gpu_s_per_prompt:g} s a prompt\n")
    print("| phase | wall s | driver CPU s | requests | wall ms / shard | requests / shard |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")

    def row(name, p):
        req = p.get("requests")
        print(f"| {name} | {p['wall_s']:.1f} | {p.get('driver_cpu_s', p.get('cpu_s', 0)):.1f} | "
              f"{'' if req is None else req} | {1e3 * p['wall_s'] / shards:.2f} | "
              f"{'' if req is None else f'{req / shards:.2f}'} |")

    row("prepare (own process)", {**r["prepare"], "driver_cpu_s": r["prepare"]["cpu_s"]})
    row("tune's read of the traces (own process)", {**r["tune_read"], "driver_cpu_s": r["tune_read"]["cpu_s"]})
    for group in ("label", "rerun_complete", "rerun_one_deleted"):
        for name, p in r[group].items():
            row(f"{group}: {name}" if group != "label" or name.startswith("label") else f"label: {name}", p)
    print(f"\nprepare peak RSS {r['prepare']['peak_rss_mb']:.0f} MB; tune's read peak RSS "
          f"{r['tune_read']['peak_rss_mb']:.0f} MB ({r['tune_read']['rows']} rows); label start to first shard dispatched "
          f"{r['start_to_first_dispatch_s']:.1f} s")
    t = r["turnaround_s"]
    if t:
        gpu = args.gpu_s_per_prompt * args.shard_size
        over = [x - gpu for x in t]
        print(f"per shard, send to result at the driver: median {st.median(t):.3f} s (stand-in GPU {gpu:.3f} s), "
              f"overhead median {st.median(over):.3f} s, p90 {sorted(over)[int(0.9 * len(over))]:.3f} s")
    idle_share(r, args)


BOOKKEEPING = ("skip check", "planning", "to-do check", "manifest", "closing (finalize, summary, card)")


def idle_share(r: Dict[str, Any], args) -> Dict[str, float]:
    """The GPUs' idle share of a ``--target-prompts`` label run on ``--target-gpus``, from this run's measured costs.

    A GPU waits (a) while the driver does the bookkeeping that grows with the shard count (the skip and to-do
    checks, planning, the manifest, finalize: :data:`BOOKKEEPING`), scaled linearly per shard from this run; (b) for
    the rest of the stage's start (Ray, the models' provenance, the actors' set-up) and the preflight, as measured
    here: neither reads a shard (with the code of #66; before it every actor's preflight read every prompt shard,
    which benchmarks/results/scale.md extrapolates apart); (c) each shard's overhead, send to result at the driver
    less the stand-in's seconds (reading the prompt shard, writing the rejects, sidecar and shard, Ray's calls)."""
    import statistics as st

    shards, label = r["shards"], r["label"]
    target_shards = args.target_prompts / args.shard_size
    per_gpu = target_shards / args.target_gpus
    gpu_per_shard = args.published_gpu_s_per_prompt * args.shard_size
    over = st.median([x - args.gpu_s_per_prompt * args.shard_size for x in r["turnaround_s"]]) \
        if r["turnaround_s"] else 0.0
    wall = {k: label.get(k, {}).get("wall_s", 0.0) for k in (*BOOKKEEPING, "preflight")}
    before_first = ("skip check", "planning", "to-do check", "preflight")
    start_rest = max(0.0, r["start_to_first_dispatch_s"] - sum(wall[k] for k in before_first))
    waits = {"bookkeeping (scaled per shard)": sum(wall[k] for k in BOOKKEEPING) / shards * target_shards,
             "start: Ray, provenance, set-up (as measured)": start_rest,
             "preflight (as measured)": wall["preflight"],
             "per-shard overhead": per_gpu * max(0.0, over)}
    busy = per_gpu * gpu_per_shard
    idle = sum(waits.values())
    print(f"\nGPU idle share at {args.target_prompts:,} prompts on {args.target_gpus} GPUs "
          f"({target_shards:,.0f} shards, {per_gpu:.0f} a GPU, {gpu_per_shard:.0f} GPU-s a shard): "
          f"{100 * idle / (idle + busy):.2f} % ({idle / 60:.1f} min idle of {(idle + busy) / 3600:.2f} h)")
    for k, v in waits.items():
        print(f"  {k}: {v:.0f} s")
    r["idle"] = {"waits_s": waits, "busy_s": busy, "share": idle / (idle + busy)}
    return waits


if __name__ == "__main__":
    sys.exit(main())
