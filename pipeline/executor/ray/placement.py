"""Where a stage's actors go: how many workers it expects, what each asks Ray for, and on which nodes more of them
may start as the cluster changes (GPU pods that join after the stage started, nodes an actor could not set up on).

The count is decided once from the config and the cluster at the stage's start, never by falling back quietly:

* ``model.device=cuda``: one actor per GPU, whatever the cluster has right now. ``<stage>.num_workers`` of them, or
  with ``num_workers: null`` as many as the cluster has GPUs (at least one): then the stage waits for them
  (``workers.wait_s``) instead of starting CPU actors that would load an 8B model in fp32, and a GPU that joins
  later gets an actor too (``elastic``).
* ``model.device=auto``: the same when the cluster has a GPU now; without one, CPU actors, said in the log.
* ``model.device=cpu``: CPU actors, or one per (logical) GPU when the cluster advertises some: a local cluster with
  ``--num-gpus`` places actors as a GPU cluster does while the models run on the CPU (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional

from pipeline.executor.stage import Resources

NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node (its id): what an actor's label_selector can avoid


@dataclass
class Placement:
    """The workers a stage expects and what each asks Ray for."""

    num_workers: int  # expected at the start (the preflight waits for every one)
    num_gpus: float  # per actor
    num_cpus: float
    device: str  # "cuda" | "cpu": where the models run (the label fingerprint's device kind)
    elastic: bool = False  # one more actor for every GPU that joins later
    key: str = "num_workers"  # the config key that sets the count, for messages
    why: str = ""  # why this many, for the log ("label.num_workers=2")
    note: str = ""  # what the cluster made of the device ("no GPU in the cluster, so CPU actors ..."), or ""

    @property
    def reason(self) -> str:
        """``why`` and ``note`` in one clause, for the log."""
        return f"{self.why}; {self.note}" if self.note else self.why

    @property
    def on_gpu(self) -> bool:
        return self.num_gpus > 0

    def ask(self) -> Dict[str, float]:
        """What one actor asks Ray for, as Ray's resources name it."""
        return {k: v for k, v in (("GPU", self.num_gpus), ("CPU", self.num_cpus)) if v}

    def asks(self) -> str:
        """``ask()`` for a log line ("GPU 1 + CPU 0.5"): a closing block never prints a dict."""
        return " + ".join(f"{k} {v:g}" for k, v in self.ask().items()) or "nothing"

    def describe(self) -> str:
        more = ", and one more for every GPU that joins" if self.elastic else ""
        return f"{self.num_workers} actor(s) of {self.asks()}{more}, models on {self.device}"


def plan_workers(res: Resources, cluster: Dict[str, float]) -> Placement:
    """The placement for a stage's resources on a cluster whose ``ray.cluster_resources()`` is ``cluster``."""
    gpus = int(cluster.get("GPU", 0))
    n, device, key = res.num_workers, res.device, res.workers_key or "num_workers"
    if device.startswith("cuda") or gpus > 0:
        runs_on = "cpu" if device == "cpu" else "cuda"
        expected = n or max(gpus, 1)
        why = f"{key}={n}" if n else f"{key}=null: every GPU ({gpus} now)"
        note = "models on the CPU (model.device=cpu)" if runs_on == "cpu" else ""
        return Placement(expected, 1.0, res.cpus_per_worker, runs_on, elastic=n is None, key=key, why=why,
                         note=note)
    cpus = cluster.get("CPU", 1)
    # Leave one worker's worth of CPU for the driver and Ray's own tasks.
    expected = n or max(1, int(cpus / res.cpus_per_worker) - 1)
    why = f"{key}={n}" if n else f"{key}=null: the cluster's {cpus:g} CPUs less one"
    note = "no GPU in the cluster, so CPU actors (model.device=cuda waits for GPUs instead)" if device == "auto" else ""
    return Placement(expected, 0.0, res.cpus_per_worker, "cpu", key=key, why=why, note=note)


def avoiding(nodes: Iterable[str]) -> Optional[Dict[str, str]]:
    """An actor's ``label_selector`` that keeps it off ``nodes`` (None for none): Ray then places it on any other
    node with the resources, or keeps it pending until one joins."""
    nodes = sorted(set(nodes))
    return {NODE_ID_LABEL: f"!in({', '.join(nodes)})"} if nodes else None


def could_host(nodes, place: Placement, avoid: Iterable[str]) -> bool:
    """Whether an alive node outside ``avoid`` has, in all, the resources one actor asks for (``nodes``:
    ``ray.nodes()``); busy or not, a node that has them will take the actor once they are free."""
    avoid = set(avoid)
    return any(n.get("Alive") and n["NodeID"] not in avoid
               and all(n.get("Resources", {}).get(k, 0) >= v for k, v in place.ask().items()) for n in nodes)


def ray_asks(cfg, stage: str) -> list:
    """What each part of ``stage`` asks Ray for, from the config alone (no cluster): ``blockpilot submit --dry-run``.
    The count of GPU actors is the cluster's GPUs when the config leaves it null, known only once the job runs."""
    w, device = cfg.workers, cfg.model.device
    cpu = f"CPU: {w.cpus_per_worker:g}"

    def actors(key: str, n) -> str:
        count = f"{n} actor(s)" if n else "one actor per GPU (and per GPU that joins)"
        if device.startswith("cuda"):
            return f"{count}, each {{GPU: 1, {cpu}}}, models on cuda (waits up to workers.wait_s={w.wait_s:g} s)"
        gpu = f"{count}, each {{GPU: 1, {cpu}}}, on a cluster with GPUs, models on " + \
            ("the CPU (model.device=cpu)" if device == "cpu" else "cuda")
        return f"{gpu}; without GPUs {n or 'the CPUs less one'} actor(s) of {{{cpu}}}, models on the CPU ({key})"

    t = cfg.train
    gpu_train = "a GPU each" if t.use_gpu else "no GPU" if t.use_gpu is False else \
        "a GPU each if the cluster has one per worker"
    mlp = ""
    if t.model == "mlp":  # the paper's MLP: at V = 151,936 its first layer alone is 311M parameters
        try:
            from pipeline.decoding.memory import GiB, policy_plan

            from pipeline.executor.memory_checks import model_configs

            vocab = model_configs(cfg)[0].vocab_size
            plan = policy_plan(vocab, 2 * cfg.label.k + 1, t.hidden, t.n_layers, t.batch_size, device="cpu")
            mlp = f", {plan.weights['policy parameters'] / 4e6:.0f}M parameters at V={vocab}: " \
                  f"{plan.peak / GiB:.1f} GiB per worker"
        except Exception as err:  # noqa: BLE001 - the target's config out of reach here (a hub id offline)
            mlp = f" (its memory: the target's config is not readable here: {type(err).__name__})"
    parts = {
        "prepare": ["prepare: in the job's driver (tokenizer only; asks nothing)"],
        "label": [f"label: {actors('label.num_workers', cfg.label.num_workers)}; each plans its memory at "
                  f"label.batch_size={cfg.label.batch_size} (blockpilot preflight prints the plan)"],
        "train": [f"train: Ray Train, {t.num_workers} worker(s) of {{CPU: 1 or 0.5}} and {gpu_train} "
                  f"(train.use_gpu={t.use_gpu}); model {t.model}{mlp}"],
        "tune": [f"tune: {actors('tune.num_workers', cfg.tune.num_workers)}"],
        "evaluate": [f"evaluate: {actors('evaluate.num_workers', cfg.evaluate.num_workers)}"] + (
            [f"evaluate at load (c = {', '.join(str(c) for c in cfg.evaluate.concurrency if c > 1)}): one task "
             f"asking what one evaluate actor asks, after the actors are gone"]
            if any(c > 1 for c in cfg.evaluate.concurrency) else []),
    }
    driver = ["the job's driver (the entrypoint, on the node the job server picks, usually the head): plans, "
              "preflight, manifests; asks Ray for nothing"]
    order = ("prepare", "label", "train", "tune", "evaluate") if stage == "run" else (stage,)
    return driver + [line for s in order for line in parts.get(s, [])]


def expected_label_workers(cfg) -> int:
    """How many label workers prepare cuts the prompt shards for (pipeline/executor/sharding.py): label.num_workers,
    else (null: one per GPU) the placement label will make on the cluster this job joined (RAY_ADDRESS or
    ray.address), else on this machine's devices (ray.num_gpus / num_cpus, or what torch and the OS see), without
    starting a Ray."""
    import os

    from pipeline.executor.stage import Resources

    if cfg.label.num_workers:
        return int(cfg.label.num_workers)
    res = Resources(actors=True, num_workers=None, cpus_per_worker=cfg.workers.cpus_per_worker,
                    workers_key="label.num_workers", device=cfg.model.device)
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        from .runtime import init_ray

        return plan_workers(res, init_ray(cfg.ray).cluster_resources()).num_workers
    import torch

    here = {"GPU": cfg.ray.num_gpus if cfg.ray.num_gpus is not None else torch.cuda.device_count(),
            "CPU": cfg.ray.num_cpus or os.cpu_count() or 1}
    return plan_workers(res, here).num_workers
