"""train: Ray Train fits the BlockPilot MLP policy on the label shards, with checkpoints and resume.

Data: ``ray.data.read_parquet`` over the validated label shards, split train/val by a hash of prompt_id. The
train split is sharded across workers; every worker sees the whole val split (metrics are computed on rank 0).
Checkpoints: every ``train.checkpoint_every`` epochs and at the last, under ``output_dir/train/ray/`` (model,
optimizer, epoch, metric history); a killed run relaunched with the same output_dir continues from the last one
(Ray Train's get_checkpoint()).
Output: ``train/metrics.jsonl``, ``train/curves.png``, ``train/policy/`` (model.safetensors + policy.json + the
cost profile). What runs on the workers and what the driver computes is in :mod:`pipeline.training`; this module
wires it to Ray.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from pipeline.data.validate import validate_dataset
from pipeline.executor.folder import StageFolder
from pipeline.io.layout import CURVES, MANIFEST, METRICS, POLICY, RunLayout
from pipeline.io.shards import file_sha256
from pipeline.io.storage import arrow_filesystem, resolve
from pipeline.runtime.config import PipelineConfig
from pipeline.runtime.log import get as log
from pipeline.training import checkpoint
from pipeline.training.data import (LABEL_COLUMN, InMemoryShard, SplitData, as_tau, histogram, in_split,
                                    uses_costs, with_rule_tau)
from pipeline.training.export import ExportInput, export_policy
from pipeline.training.plots import plot_curves
from pipeline.training.problem import Problem, cost_profile_path, load_problem
from pipeline.training.progress import EpochLog, write_history
from pipeline.training.summary import summary_lines, train_summary

from pipeline.executor.ray.runtime import init_ray, quiet_ray_train_reports, ray_train_logging_config

RUN_NAME = "ray"  # Ray Train's run folder under train/: the checkpoints


# ---- on every Ray Train worker -----------------------------------------------------------------------------------

def dataset_shard(config: Dict[str, Any], name: str):
    """This worker's part of split ``name``: Ray Data's shard, or, for a small label set (SMALL_LABEL_BYTES), the
    split from the object store (the train split of the MLP divided among the workers, as Ray Data splits it)."""
    import ray
    import ray.train

    refs = config.get("in_memory")
    if refs is None:
        return ray.train.get_dataset_shard(name)
    shard = InMemoryShard(ray.get(refs[name]))
    if name in config["split_across_workers"]:
        ctx = ray.train.get_context()
        shard = shard.part(ctx.get_world_rank(), ctx.get_world_size())
    return shard


class Checkpointer:
    """Checkpoints through Ray Train: the folder's contents are :mod:`pipeline.training.checkpoint`'s."""

    def __init__(self, rank: int):
        self.rank = rank

    def restore(self, model, opt):
        """(first epoch to run, metric history so far): from the last checkpoint of a killed run, else (0, [])."""
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if not ckpt:
            return 0, []
        with ckpt.as_directory() as d:
            start, history = checkpoint.restore(Path(d), model, opt)
        print(f"[train] resuming from the checkpoint of epoch {start - 1}", flush=True)
        return start, history

    def save_and_report(self, model, opt, epoch: int, metrics: Dict[str, Any],
                        history: List[Dict[str, Any]]) -> None:
        """Rank 0 writes the checkpoint; every rank reports (Ray Train needs each worker's report)."""
        import ray.train
        from ray.train import Checkpoint

        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if self.rank == 0:
                checkpoint.save_state(Path(d), model, opt, epoch, history)
                ckpt = Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=ckpt)


def train_loop(config: Dict[str, Any]) -> None:
    """Runs on every Ray Train worker: restore, then the epochs (pipeline.training.loop.fit), reporting with a
    checkpoint and, on rank 0, rewriting metrics.jsonl after each report; or the ridge fit (one report)."""
    import ray.train
    import torch

    from pipeline.policy.blocksize import BlockSizeMLP
    from pipeline.training.loop import fit

    quiet_ray_train_reports()
    t = config["train"]
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(t["seed"] + rank)
    if t["model"] == "ridge":
        return ridge_loop(config, rank)
    model = BlockSizeMLP(config["vocab_size"], config["num_actions"], t["hidden"], t["n_layers"], t["dropout"])
    opt = torch.optim.Adam(model.parameters(), lr=t["lr"])
    checkpointer = Checkpointer(rank)
    start_epoch, history = checkpointer.restore(model, opt)
    model = ray.train.torch.prepare_model(model)
    train_data = SplitData(dataset_shard(config, "train"), config, shuffle=True)
    val_data = SplitData(dataset_shard(config, "val"), config, shuffle=False)

    def report(epoch, metrics, history):
        checkpointer.save_and_report(model, opt, epoch, metrics, history)
        if rank == 0:
            write_history(history, config["train_dir"])

    fit(model, opt, train_data, val_data, config, start_epoch, history, report)


def ridge_loop(config: Dict[str, Any], rank: int) -> None:
    """The ridge fit (pipeline.training.ridge) on a Ray Train worker: every worker sees every train and calibration
    row (the closed form needs them all) and fits the same model; one report, as "epoch 0", with its checkpoint.
    A rerun after that checkpoint fits nothing. ``train.cache_max_gb`` bounds the fit's memory
    (pipeline.training.ridge.check_memory; the driver checks it before Ray starts)."""
    import torch

    from pipeline.policy.blocksize import LinearPolicyModel, transform_inputs
    from pipeline.training.loop import validate
    from pipeline.training.ridge import fit_ridge

    model = LinearPolicyModel(config["vocab_size"], config["num_actions"])
    checkpointer = Checkpointer(rank)
    start, history = checkpointer.restore(model, None)
    if start > 0:
        return

    def gather(name: str):
        parts = list(SplitData(dataset_shard(config, name), config, shuffle=False).epoch(0))
        if not parts or not sum(len(p[1]) for p in parts):
            return np.zeros((0, config["vocab_size"]), np.float32), np.zeros((0, config["num_actions"]), np.float32)
        x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        return transform_inputs(x, config["train"]["input_transform"]).numpy(), np.concatenate([p[2] for p in parts])

    sp = config["speed"]
    (xt, tt), (xc, tc) = gather("train"), gather("calib")
    fitted, info = fit_ridge(np.concatenate([xt, xc]), np.concatenate([tt, tc]), config["costs"],
                             sp["fallback_index"], sp["scale"], max_gb=config["train"]["cache_max_gb"])
    model.load_state_dict(fitted.state_dict())
    # The margin rides with the metrics into the checkpoint's history: the export reads it there (the fit saw the
    # calibration rows, so the driver cannot calibrate on them again).
    metrics = {"epoch": 0, "train_loss": info["train_loss"], "ridge_alpha": info["alpha"],
               "ridge_ratio": info["ratio"], "ridge_calibration": info["calibration"], **validate(model, SplitData(
                   dataset_shard(config, "val"), config, shuffle=False), 0, config)}
    history.append(metrics)
    checkpointer.save_and_report(model, None, 0, metrics, history)
    if rank == 0:
        write_history(history, config["train_dir"])


# ---- on the driver -----------------------------------------------------------------------------------------------

def fingerprint(cfg: PipelineConfig, labels_dir: Path) -> Dict[str, Any]:
    """What the policy learns from: the label set (its manifest) and the train settings that shape the model."""
    fp = {"labels_manifest_sha256": file_sha256(labels_dir / MANIFEST), "train": vars(cfg.train).copy()}
    profile = cost_profile_path(cfg.train, labels_dir)
    fp["cost_profile_sha256"] = file_sha256(profile) if profile.is_file() else None
    for key in ("num_workers", "use_gpu", "max_failures", "cache_max_gb"):  # how it runs, not what it learns
        fp["train"].pop(key)
    return fp


# Label sets whose columns train reads are at most this many bytes (uncompressed) are read by the driver and handed
# to Ray Train's workers through the object store: Ray Data's read and map tasks, each a fresh worker process, took
# ~14 s of a 43 s train of 16 rows on a 2-core machine, and its split of an in-memory dataset still started four
# actors (~8 CPU-s; pipeline.training.data.InMemoryShard). A default run's 520 rows x 4,096 logits are ~9 MB; at
# V = 151,936 this is ~110 rows. Larger sets stream through Ray Data.
SMALL_LABEL_BYTES = 64 * 2**20


def _columns_bytes(shards, columns) -> int:
    from pipeline.io.storage import parquet_file

    total = 0
    for p in shards:
        meta = parquet_file(p).metadata
        names = [meta.schema.column(i).path.split(".")[0] for i in range(meta.num_columns)]
        total += sum(meta.row_group(g).column(i).total_uncompressed_size for g in range(meta.num_row_groups)
                     for i, n in enumerate(names) if n in columns)
    return total


def _datasets(cfg: PipelineConfig, problem: Problem, labels_dir) -> Dict[str, Any]:
    """The train and val splits (and calibration, for ridge): for a small label set (SMALL_LABEL_BYTES) their columns
    read here, as numpy arrays the workers take from the object store (pipeline.training.data.InMemoryShard); else
    Ray Datasets streaming over the shards, read through the stages' own filesystem client (local or object
    storage)."""
    frac = cfg.train.val_fraction
    calib = cfg.train.calibration_fraction if cfg.train.objective == "speed" else 0.0
    columns = ["prompt_id", "logits", cfg.train.tau_column, LABEL_COLUMN]

    def keep(batch, split: str, rule_tau):
        mask = in_split(batch["prompt_id"], split, frac, calib)
        out = as_tau({k: v[mask] for k, v in batch.items()}, cfg.train.tau_column, problem.candidates)
        if rule_tau and mask.any():  # the rule actions' columns after the candidates' (pipeline.training.problem)
            out["tau"] = with_rule_tau(np.stack(out["tau"]), out["prompt_id"], rule_tau)
        return out

    # The ridge fit also reads the calibration rows: its penalty comes from leave-one-out predictions over train +
    # calibration, its margin from out-of-fold ones (the MLP's margin is calibrated on the driver, on the
    # calibration rows).
    splits = ("train", "val", "calib") if cfg.train.model == "ridge" else ("train", "val")
    if _columns_bytes(problem.shards, columns) <= SMALL_LABEL_BYTES:
        import pyarrow as pa

        from pipeline.io.storage import read_table

        table = pa.concat_tables([read_table(p, columns=columns) for p in problem.shards])
        whole = {c: (np.stack([np.asarray(x, dtype=np.float32) for x in table.column(c).to_pylist()])
                     if pa.types.is_list(table.schema.field(c).type) or
                     pa.types.is_fixed_size_list(table.schema.field(c).type)
                     else np.asarray(table.column(c).to_pylist())) for c in columns}
        return {split: {k: np.asarray(v) for k, v in keep(whole, split, problem.rule_tau).items()}
                for split in splits}
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    fs, _ = arrow_filesystem(labels_dir)
    ds = ray.data.read_parquet([arrow_filesystem(p)[1] for p in problem.shards], filesystem=fs).select_columns(columns)
    return {split: ds.map_batches(keep, fn_kwargs={"split": split, "rule_tau": problem.rule_tau},
                                  batch_format="numpy") for split in splits}


def _trainer(cfg: PipelineConfig, problem: Problem, labels_dir, train_dir):
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    use_gpu = cfg.train.use_gpu
    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= cfg.train.num_workers
    cpus = ray.cluster_resources().get("CPU", 1)
    # On small CPU machines whole-CPU workers starve Ray Data's read tasks and the run hangs.
    per_worker = 1.0 if use_gpu or cpus >= 2 * cfg.train.num_workers + 2 else 0.5
    vocab = problem.vocab_size
    data = _datasets(cfg, problem, labels_dir)
    streamed = not all(isinstance(v, dict) for v in data.values())  # Ray Datasets, not columns in memory
    # The MLP's workers each take a part of the train split; every ridge worker needs all of it.
    split_across = ["train"] if cfg.train.model == "mlp" else []
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "train": vars(cfg.train), "candidates": problem.candidates, "vocab_size": vocab,
            "num_actions": len(problem.action_names),
            "label_column": LABEL_COLUMN, "fixed_index": problem.fixed_index, "trained_index": problem.trained_index,
            "train_dir": str(train_dir), "progress": cfg.progress,
            "costs": problem.costs if uses_costs(cfg.train.objective, cfg.train.label) else None,
            "speed": problem.speed,
            "cache_in_memory": len(problem.splits.split) * vocab * 4 <= cfg.train.cache_max_gb * 2**30,
            "in_memory": None if streamed else {name: ray.put(cols) for name, cols in data.items()},
            "split_across_workers": split_across,
        },
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": per_worker}),
        datasets=data if streamed else None,
        dataset_config=DataConfig(datasets_to_split=split_across),
        run_config=RunConfig(
            name=RUN_NAME, **checkpoint.storage(train_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            logging_config=ray_train_logging_config(),
        ),
    )
    return trainer, use_gpu


def _log_start(cfg: PipelineConfig, problem: Problem, use_gpu: bool) -> None:
    s, t = problem.splits, cfg.train
    how = "ridge" if t.model == "ridge" else f"mlp, {t.epochs} epochs"
    rules = f" + {len(problem.rule_actions)} rule actions" if problem.rule_actions else ""
    log("train").info(f"{int(s.train.sum())} train / {int(s.calib.sum())} calibration / {int(s.val.sum())} val rows, "
                      f"objective {t.objective} ({how}), candidates {problem.candidates}{rules}, "
                      f"V={problem.vocab_size}, {t.num_workers} worker(s), gpu={use_gpu}")
    if t.model == "mlp":  # where it runs and what it needs: at V = 151,936 the first layer alone is 311M parameters
        from pipeline.decoding.memory import GiB, policy_plan

        plan = policy_plan(problem.vocab_size, len(problem.action_names), t.hidden, t.n_layers, t.batch_size,
                           device="cuda" if use_gpu else "cpu")
        params = plan.weights["policy parameters"] // 4
        log("train").info(f"the MLP: {params / 1e6:.1f}M parameters (first layer {problem.vocab_size * t.hidden / 1e6:.1f}M); "
                          f"each worker plans {plan.peak / GiB:.2f} GiB on {'a GPU' if use_gpu else 'the CPU'} "
                          f"(weights, gradients, Adam's moments, a batch of {t.batch_size}); a checkpoint holds "
                          f"~{12 * params / GiB:.2f} GiB (weights and Adam's moments)")
    if problem.costs is not None:
        from pipeline.policy.labels import speed_label

        def plain(h):  # b:rows, in order: a log line, not a dict
            return " ".join(f"{b}:{n}" for b, n in h.items())

        n_c = len(problem.candidates)
        log("train").info(f"cost profile {problem.profile_path}: ms per step "
                          f"{' '.join(f'{c * 1e3:.2f}' for c in problem.costs[:n_c])}; rows per label (b:rows): "
                          f"argmax tau {plain(histogram(s.y_tau, problem.candidates))}; argmax tau/cost "
                          f"{plain(histogram(speed_label(s.tau, problem.costs), problem.action_names))}")


def _check_revisions(cfg: PipelineConfig, labels_dir) -> None:
    """A revision set in the config must be the one the labels were made with: the policy learns that target's
    logits and that draft's acceptance (train loads no model, so a null revision is the labels' own)."""
    from pipeline.io.shards import labels_revisions

    recorded = labels_revisions(labels_dir)
    for key in ("target_revision", "draft_revision"):
        mine, was = getattr(cfg.model, key), recorded.get(key)
        if mine and was and not was.startswith("sha256:") and mine != was:
            raise ValueError(f"model.{key}: {mine} is not the revision the labels were made with ({was}, "
                             f"{labels_dir}/fingerprint.json): train with the labels' models, or label again")


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    t_start = time.monotonic()
    layout = RunLayout(resolve(cfg.output_dir))  # a local folder, or object storage (s3://...)
    labels_dir, train_dir = layout.labels, layout.train
    folder = StageFolder(train_dir, "train", extra_outputs=(RUN_NAME, POLICY, METRICS, CURVES))
    folder.ensure_writable()
    report = validate_dataset(str(labels_dir))
    if not report.ok:
        raise ValueError(f"label dataset {labels_dir} is not valid, train refuses it:\n  " +
                         "\n  ".join(report.problems))
    _check_revisions(cfg, labels_dir)
    fp = fingerprint(cfg, labels_dir)
    previous = folder.previous_summary(fp)
    if previous is not None:
        return folder.skipped(previous, t_start)
    folder.bind(fp, cfg.force)
    folder.start(cfg)
    problem = load_problem(cfg.train, labels_dir)
    if cfg.train.model == "ridge":  # before Ray starts: a fit that cannot fit train.cache_max_gb fails here
        from pipeline.training.ridge import check_memory

        check_memory(int((problem.splits.train | problem.splits.calib).sum()), problem.vocab_size,
                     cfg.train.cache_max_gb)
    init_ray(cfg.ray)
    trainer, use_gpu = _trainer(cfg, problem, labels_dir, train_dir)
    _log_start(cfg, problem, use_gpu)
    # the ridge fit is one report: its "epoch 1/1" line would repeat the closing val line
    with EpochLog(train_dir / METRICS, cfg.train.epochs, cfg.progress and cfg.train.model != "ridge"):
        result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training produced no checkpoint (error: {result.error})")
    with result.checkpoint.as_directory() as d:
        state, history = checkpoint.load_state(Path(d))
    inp = ExportInput(problem, cfg.train, state, history, fp["labels_manifest_sha256"])
    held = export_policy(inp, layout.policy)
    plot_curves(history, train_dir / CURVES)
    summary = train_summary(inp, held)
    summary.update(output=str(train_dir), policy=str(layout.policy), status="done",
                   wall_seconds=round(time.monotonic() - t_start, 1))
    folder.complete(summary)
    for line in summary_lines(summary):
        log("train").info(line)
    return summary
