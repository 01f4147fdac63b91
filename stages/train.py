"""train: Ray Train fits the BlockPilot MLP policy on the label shards, with per-epoch checkpoints and resume.

Data: ``ray.data.read_parquet`` over the validated label shards, split train/val by a hash of prompt_id. The
train split is sharded across workers; every worker sees the whole val split (metrics are computed on rank 0).
Checkpoints: one per epoch under ``output_dir/train/ray/`` (model, optimizer, epoch, metric history); a killed
run relaunched with the same output_dir continues from the last checkpoint (Ray Train's get_checkpoint()).
Output: ``train/metrics.jsonl``, ``train/curves.png``, ``train/policy/`` (model.safetensors + policy.json).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pyarrow.parquet as pq

from pipeline.config import PipelineConfig, write_resolved
from pipeline.dataset import decode_metadata
from pipeline.policy import is_val
from pipeline.shards import (
    MANIFEST,
    check_fingerprint,
    clear_complete,
    ensure_writable,
    file_sha256,
    is_complete,
    list_shards,
    mark_complete,
    write_jsonl_atomic,
)
from pipeline.validate import validate_dataset

from .common import init_ray

RUN_NAME = "ray"


def _label_column(cfg: PipelineConfig) -> str:
    return "label_speedup_block_size" if cfg.train.label == "speedup" else "label_block_size"


def _to_arrays(batch: Dict[str, np.ndarray], candidates: List[int], label_col: str):
    x = np.stack(batch["logits"]).astype(np.float32)
    tau = np.stack(batch["tau"]).astype(np.float32)
    index = {b: i for i, b in enumerate(candidates)}
    y = np.array([index[int(b)] for b in batch[label_col]], dtype=np.int64)
    return x, y, tau


def train_loop(config: Dict[str, Any]) -> None:
    """Runs on every Ray Train worker."""
    import ray.train
    import torch
    from ray.train import Checkpoint

    from pipeline.policy import BlockSizeMLP, choice_metrics, transform_inputs

    t = config["train"]
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(t["seed"] + rank)
    cands = config["candidates"]
    model = BlockSizeMLP(config["vocab_size"], len(cands), t["hidden"], t["n_layers"], t["dropout"])
    opt = torch.optim.Adam(model.parameters(), lr=t["lr"])
    start_epoch, history = 0, []
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            # Our own checkpoint, but loaded the safe way all the same.
            state = torch.load(Path(d) / "state.pt", weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start_epoch = int(state["epoch"]) + 1
            history = json.loads((Path(d) / "history.json").read_text())
        print(f"[train] resuming from the checkpoint of epoch {start_epoch - 1}", flush=True)
    model = ray.train.torch.prepare_model(model)
    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    label_col = config["label_column"]

    def stream(shard, shuffle_seed=None):
        kwargs = {"local_shuffle_buffer_size": 4 * t["batch_size"], "local_shuffle_seed": shuffle_seed} \
            if shuffle_seed is not None else {}
        for b in shard.iter_batches(batch_size=t["batch_size"], batch_format="numpy", **kwargs):
            yield _to_arrays(b, cands, label_col)

    cache: Dict[str, tuple] = {}

    def batches(name, shard, epoch):
        """Ray Data streams the shard each epoch; a shard that fits in memory (decided by the driver) is read
        once and reshuffled in memory, since re-running the read pipeline costs seconds per epoch."""
        shuffle = name == "train"
        if not config["cache_in_memory"]:
            yield from stream(shard, t["seed"] + epoch if shuffle else None)
            return
        if name not in cache:
            parts = list(stream(shard))
            cache[name] = tuple(np.concatenate([p[i] for p in parts]) if parts else np.zeros((0,)) for i in range(3))
        x, y, tau = cache[name]
        order = np.random.default_rng(t["seed"] + epoch).permutation(len(y)) if shuffle else np.arange(len(y))
        for i in range(0, len(y), t["batch_size"]):
            idx = order[i:i + t["batch_size"]]
            yield x[idx], y[idx], tau[idx]

    for epoch in range(start_epoch, t["epochs"]):
        model.train()
        losses, seen = 0.0, 0
        for x, y, tau in batches("train", train_shard, epoch):
            x = transform_inputs(torch.from_numpy(x), t["input_transform"])
            out = model(x)
            if t["objective"] == "soft":
                target = torch.softmax(torch.from_numpy(tau) / t["soft_temperature"], dim=-1)
                loss = -(target * torch.log_softmax(out, dim=-1)).sum(-1).mean()
            else:
                loss = torch.nn.functional.cross_entropy(out, torch.from_numpy(y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses += float(loss.detach()) * len(y)
            seen += len(y)
        metrics: Dict[str, Any] = {"epoch": epoch, "train_loss": losses / max(1, seen)}
        model.eval()
        scores, ys, taus = [], [], []
        with torch.no_grad():
            for x, y, tau in batches("val", val_shard, epoch):
                scores.append(model(transform_inputs(torch.from_numpy(x), t["input_transform"])))
                ys.append(y)
                taus.append(tau)
        if ys:
            vm = choice_metrics(torch.cat(scores), np.concatenate(ys), np.concatenate(taus),
                                config["fixed_index"], config["trained_index"])
            metrics.update({f"val_{k}": v for k, v in vm.items()})
        history.append(metrics)
        checkpoint = None
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                raw = model.module if hasattr(model, "module") else model
                torch.save({"model": raw.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                           Path(d) / "state.pt")
                (Path(d) / "history.json").write_text(json.dumps(history))
                checkpoint = Checkpoint.from_directory(d)
                if config["progress"]:
                    shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}
                    print(f"[train] epoch {epoch + 1}/{t['epochs']} {shown}", flush=True)
            ray.train.report(metrics, checkpoint=checkpoint)
        if rank == 0:
            # After the report, so the file never runs ahead of the checkpoints; the whole history each time,
            # so a resumed run rewrites it and never duplicates an epoch.
            write_jsonl_atomic(history, Path(config["train_dir"]) / "metrics.jsonl")


def _split_tables(shards: List[Path], val_fraction: float, label_col: str, candidates: List[int]):
    """Small columns only (no logits): the driver's view of the split and of the baselines."""
    import pyarrow as pa

    t = pa.concat_tables([pq.read_table(p, columns=["prompt_id", "tau", label_col]) for p in shards])
    ids = t.column("prompt_id").to_pylist()
    val_mask = np.array([is_val(i, val_fraction) for i in ids], dtype=bool)
    tau = np.array(t.column("tau").to_pylist(), dtype=np.float32)
    index = {b: i for i, b in enumerate(candidates)}
    y = np.array([index[int(b)] for b in t.column(label_col).to_pylist()])
    return val_mask, tau, y


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    t_start = time.monotonic()
    out = Path(cfg.output_dir).resolve()
    labels_dir, train_dir = out / "labels", out / "train"
    report = validate_dataset(str(labels_dir))
    if not report.ok:
        raise ValueError(f"label dataset {labels_dir} is not valid, train refuses it:\n  " +
                         "\n  ".join(report.problems))
    ensure_writable(train_dir)
    shards = list_shards(labels_dir)
    meta = decode_metadata(pq.read_schema(shards[0]).metadata)
    candidates = [int(b) for b in meta["candidates"]]
    vocab = int(meta["vocab_size"])
    B = int(meta["trained_block_size"])
    label_col = _label_column(cfg)
    fp = {"labels_manifest_sha256": file_sha256(labels_dir / MANIFEST), "train": vars(cfg.train).copy()}
    for key in ("num_workers", "use_gpu", "max_failures", "cache_max_gb"):  # how it runs, not what it learns
        fp["train"].pop(key)
    if check_fingerprint(train_dir, fp, cfg.force, (train_dir / RUN_NAME).exists() or is_complete(train_dir)):
        print(f"[train] force=true: config changed, discarding {train_dir / RUN_NAME}", flush=True)
        shutil.rmtree(train_dir / RUN_NAME, ignore_errors=True)
        clear_complete(train_dir)
    if is_complete(train_dir):
        print(f"[train] {train_dir}: complete, nothing to do", flush=True)
        return json.loads((train_dir / "summary.json").read_text())
    write_resolved(cfg, train_dir)

    val_mask, tau, y = _split_tables(shards, cfg.train.val_fraction, label_col, candidates)
    if val_mask.all() or (~val_mask).sum() == 0:
        raise ValueError("train.val_fraction leaves no training rows")
    # Baselines decided on the TRAIN split only: the single best fixed b, and the majority class.
    fixed_index = int(np.argmax(tau[~val_mask].mean(axis=0)))
    majority = int(np.bincount(y[~val_mask], minlength=len(candidates)).argmax())
    trained_index = candidates.index(B) if B in candidates else len(candidates) // 2

    ray = init_ray(cfg.ray)
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.data.DataContext.get_current().enable_progress_bars = False
    columns = ["prompt_id", "logits", "tau", label_col]
    ds = ray.data.read_parquet([str(p) for p in shards]).select_columns(columns)
    frac = cfg.train.val_fraction

    def keep(batch, val: bool):
        mask = np.array([is_val(i, frac) == val for i in batch["prompt_id"]], dtype=bool)
        return {k: v[mask] for k, v in batch.items()}

    train_ds = ds.map_batches(keep, fn_kwargs={"val": False}, batch_format="numpy")
    val_ds = ds.map_batches(keep, fn_kwargs={"val": True}, batch_format="numpy")
    use_gpu = cfg.train.use_gpu
    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= cfg.train.num_workers
    cpus = ray.cluster_resources().get("CPU", 1)
    # On small CPU machines whole-CPU workers starve Ray Data's read tasks and the run hangs.
    per_worker = 1.0 if use_gpu or cpus >= 2 * cfg.train.num_workers + 2 else 0.5
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "train": vars(cfg.train), "candidates": candidates, "vocab_size": vocab, "label_column": label_col,
            "fixed_index": fixed_index, "trained_index": trained_index, "train_dir": str(train_dir),
            "progress": cfg.progress,
            "cache_in_memory": len(val_mask) * vocab * 4 <= cfg.train.cache_max_gb * 2**30,
        },
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": per_worker}),
        datasets={"train": train_ds, "val": val_ds},
        dataset_config=DataConfig(datasets_to_split=["train"]),
        run_config=RunConfig(
            name=RUN_NAME, storage_path=str(train_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
        ),
    )
    print(f"[train] {int((~val_mask).sum())} train / {int(val_mask.sum())} val rows, candidates {candidates}, "
          f"V={vocab}, {cfg.train.epochs} epochs, {cfg.train.num_workers} worker(s), gpu={use_gpu}", flush=True)
    result = trainer.fit()
    summary = _export(cfg, result, train_dir, candidates, vocab, B, fp, fixed_index, majority, y, val_mask)
    summary["wall_seconds"] = round(time.monotonic() - t_start, 1)
    (train_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    mark_complete(train_dir)
    _print_summary(summary)
    return summary


def _export(cfg, result, train_dir: Path, candidates, vocab, B, fp, fixed_index, majority, y, val_mask):
    import torch

    from pipeline.policy import BlockSizeMLP, BlockSizePolicy

    if result.checkpoint is None:
        raise RuntimeError(f"training produced no checkpoint (error: {result.error})")
    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=True)
        history = json.loads((Path(d) / "history.json").read_text())
    t = cfg.train
    model = BlockSizeMLP(vocab, len(candidates), t.hidden, t.n_layers, t.dropout)
    model.load_state_dict(state["model"])
    final = history[-1]
    val_y = y[val_mask]
    info = {"label_dataset_fingerprint": fp["labels_manifest_sha256"], "label": t.label,
            "objective": t.objective, "epochs": int(state["epoch"]) + 1, "final_metrics": final,
            "best_fixed_block_size": candidates[fixed_index], "trained_block_size": int(B)}
    BlockSizePolicy(model, candidates, vocab, t.input_transform, info).save_pretrained(train_dir / "policy")
    _plot(history, train_dir / "curves.png")
    return {
        "stage": "train", "output": str(train_dir), "policy": str(train_dir / "policy"),
        "epochs": int(state["epoch"]) + 1, "train_rows": int((~val_mask).sum()), "val_rows": int(val_mask.sum()),
        "candidates": candidates, "best_fixed_block_size": candidates[fixed_index],
        "majority_class_block_size": candidates[majority],
        "val_majority_accuracy": float((val_y == majority).mean()) if len(val_y) else None,
        "final": final,
    }


def _plot(history: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = [h["epoch"] + 1 for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(ep, [h["train_loss"] for h in history])
    axes[0].set(title="train loss", xlabel="epoch")
    for key in ("val_accuracy", "val_top2_accuracy"):
        if key in history[0]:
            axes[1].plot(ep, [h[key] for h in history], label=key[4:])
    axes[1].set(title="val accuracy", xlabel="epoch")
    axes[1].legend()
    for key in ("val_tau_policy", "val_tau_best_fixed", "val_tau_trained_b", "val_tau_oracle"):
        if key in history[0]:
            axes[2].plot(ep, [h[key] for h in history], label=key[8:])
    axes[2].set(title="val mean tau of the chosen b", xlabel="epoch")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _print_summary(s: Dict[str, Any]) -> None:
    f = s["final"]
    print(f"[train] done: {s['epochs']} epochs -> {s['policy']}")
    if "val_accuracy" in f:
        print(f"[train] val accuracy {f['val_accuracy']:.3f} (majority class {s['val_majority_accuracy']:.3f}); "
              f"val mean tau: policy {f['val_tau_policy']:.3f}, best fixed b={s['best_fixed_block_size']} "
              f"{f['val_tau_best_fixed']:.3f}, oracle {f['val_tau_oracle']:.3f}", flush=True)
