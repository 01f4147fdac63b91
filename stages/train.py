"""train: Ray Train fits the BlockPilot MLP policy on the label shards, with per-epoch checkpoints and resume.

Data: ``ray.data.read_parquet`` over the validated label shards, split train/val by a hash of prompt_id. The
train split is sharded across workers; every worker sees the whole val split (metrics are computed on rank 0).
Checkpoints: one per epoch under ``output_dir/train/ray/`` (model, optimizer, epoch, metric history); a killed
run relaunched with the same output_dir continues from the last checkpoint (Ray Train's get_checkpoint()).
Output: ``train/metrics.jsonl``, ``train/curves.png``, ``train/policy/`` (model.safetensors + policy.json).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from pipeline.runtime.config import PipelineConfig
from pipeline.io.shards import decode_metadata
from pipeline.executor.driver import StageFolder
from pipeline.runtime.log import get as log
from pipeline.policy.blocksize import split_of
from pipeline.io.shards import MANIFEST, file_sha256, list_shards, write_jsonl_atomic
from pipeline.io.storage import arrow_filesystem, is_remote, location, parquet_file, read_table, resolve, savefig
from pipeline.data.validate import validate_dataset

from .ray_executor import init_ray, ray_train_logging_config

RUN_NAME = "ray"
Batch = Tuple[np.ndarray, np.ndarray, np.ndarray]  # logits [n, V], label index [n], tau [n, |C|]


def _label_column(cfg: PipelineConfig) -> str:
    """The stored label column a classifier reads (objective hard with train.label=tau, paper, soft); speed and
    hard with train.label=speedup recompute theirs from tau under train.cost_profile (see _to_arrays)."""
    return "label_block_size"


def _uses_costs(cfg: PipelineConfig) -> bool:
    return cfg.train.objective == "speed" or (cfg.train.objective == "hard" and cfg.train.label == "speedup")


def _to_arrays(batch: Dict[str, np.ndarray], candidates: List[int], label_col: str,
               costs: Optional[List[float]] = None) -> Batch:
    """(logits, label index, tau). With ``costs`` (seconds per step per candidate, train.cost_profile), the label is
    the fastest candidate, argmax tau / cost (ties to the smaller b), whatever profile the rows were labelled on."""
    x = np.stack(batch["logits"]).astype(np.float32)
    tau = np.stack(batch["tau"]).astype(np.float32)
    if costs is not None:
        y = np.argmax(tau.astype(np.float64) / np.asarray(costs)[None, :], axis=1).astype(np.int64)
    else:
        index = {b: i for i, b in enumerate(candidates)}
        y = np.array([index[int(b)] for b in batch[label_col]], dtype=np.int64)
    return x, y, tau


# ---- the train loop, in named pieces (torchtitan style); all of it runs on every Ray Train worker ----------------

class SplitData:
    """One split's batches, epoch after epoch. Ray Data streams the worker's shard each epoch; a split that fits in
    memory (decided by the driver) is read once and reshuffled in memory, since re-running the read pipeline costs
    seconds per epoch."""

    def __init__(self, shard, config: Dict[str, Any], shuffle: bool):
        self.shard, self.shuffle = shard, shuffle
        self.t, self.cands, self.label_col = config["train"], config["candidates"], config["label_column"]
        self.in_memory = config["cache_in_memory"]
        self.costs = config.get("costs")
        self._cache: Optional[Batch] = None

    def _stream(self, seed: Optional[int]) -> Iterator[Batch]:
        kwargs = {"local_shuffle_buffer_size": 4 * self.t["batch_size"], "local_shuffle_seed": seed} \
            if seed is not None else {}
        for b in self.shard.iter_batches(batch_size=self.t["batch_size"], batch_format="numpy", **kwargs):
            yield _to_arrays(b, self.cands, self.label_col, self.costs)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        seed = self.t["seed"] + epoch if self.shuffle else None
        if not self.in_memory:
            yield from self._stream(seed)
            return
        if self._cache is None:
            parts = list(self._stream(None))
            self._cache = tuple(np.concatenate([p[i] for p in parts]) if parts else np.zeros((0,))
                                for i in range(3))
        x, y, tau = self._cache
        order = np.random.default_rng(seed).permutation(len(y)) if self.shuffle else np.arange(len(y))
        for i in range(0, len(y), self.t["batch_size"]):
            idx = order[i:i + self.t["batch_size"]]
            yield x[idx], y[idx], tau[idx]


def train_step(model, opt, batch: Batch, t: Dict[str, Any], speed: Optional[Dict[str, Any]] = None) -> float:
    """One optimiser step; returns the batch's loss. objective speed: mean squared error of every candidate's
    predicted log speed ratio over the fallback (tau / cost, scaled by ``speed["scale"]``), not only the argmax."""
    import torch

    from pipeline.policy.blocksize import speed_targets, transform_inputs

    x, y, tau = batch
    out = model(transform_inputs(torch.from_numpy(x), t["input_transform"]))
    if t["objective"] == "speed":
        target = speed_targets(tau.astype(np.float64), np.asarray(speed["costs"]), speed["fallback_index"])
        loss = torch.nn.functional.mse_loss(out, torch.from_numpy(target / speed["scale"]).float())
    elif t["objective"] == "soft":
        target = torch.softmax(torch.from_numpy(tau) / t["soft_temperature"], dim=-1)
        loss = -(target * torch.log_softmax(out, dim=-1)).sum(-1).mean()
    else:
        loss = torch.nn.functional.cross_entropy(out, torch.from_numpy(y))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def train_epoch(model, opt, data: SplitData, epoch: int, t: Dict[str, Any],
                speed: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    model.train()
    total, seen = 0.0, 0
    for batch in data.epoch(epoch):
        total += train_step(model, opt, batch, t, speed) * len(batch[1])
        seen += len(batch[1])
    return {"epoch": epoch, "train_loss": total / max(1, seen)}


def validate(model, data: SplitData, epoch: int, config: Dict[str, Any]) -> Dict[str, Any]:
    """The policy's choices on the val split against the baselines (``val_*`` metrics); empty without val rows."""
    import torch

    from pipeline.policy.blocksize import choice_metrics, transform_inputs

    model.eval()
    scores, ys, taus = [], [], []
    with torch.no_grad():
        for x, y, tau in data.epoch(epoch):
            scores.append(model(transform_inputs(torch.from_numpy(x), config["train"]["input_transform"])))
            ys.append(y)
            taus.append(tau)
    if not ys:
        return {}
    scores, tau = torch.cat(scores), np.concatenate(taus)
    vm = choice_metrics(scores, np.concatenate(ys), tau, config["fixed_index"], config["trained_index"])
    if config.get("costs") is not None:  # modelled speed of the raw argmax (no fallback) over the best fixed b
        from pipeline.policy.blocksize import speed_gain

        costs, rows = np.asarray(config["costs"]), len(tau)
        fixed = np.full(rows, config["fixed_index"])
        oracle = np.argmax(tau / costs[None, :], axis=1)
        vm["speed_gain_policy"] = speed_gain(tau, costs, scores.argmax(dim=-1).numpy(), fixed)
        vm["speed_gain_oracle"] = speed_gain(tau, costs, oracle, fixed)
    return {f"val_{k}": v for k, v in vm.items()}


class Checkpointer:
    """Per-epoch checkpoints through Ray Train (model, optimizer, epoch, metric history), loaded the safe way."""

    STATE, HISTORY = "state.pt", "history.json"

    def __init__(self, rank: int):
        self.rank = rank

    def restore(self, model, opt) -> Tuple[int, List[Dict[str, Any]]]:
        """(first epoch to run, metric history so far): from the last checkpoint of a killed run, else (0, [])."""
        import ray.train
        import torch

        ckpt = ray.train.get_checkpoint()
        if not ckpt:
            return 0, []
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / self.STATE, weights_only=True)  # our own file, loaded safely all the same
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            history = json.loads((Path(d) / self.HISTORY).read_text())
        print(f"[train] resuming from the checkpoint of epoch {int(state['epoch'])}", flush=True)
        return int(state["epoch"]) + 1, history

    def save_and_report(self, model, opt, epoch: int, metrics: Dict[str, Any],
                        history: List[Dict[str, Any]]) -> None:
        """Rank 0 writes the checkpoint; every rank reports (Ray Train needs each worker's report)."""
        import ray.train
        import torch
        from ray.train import Checkpoint

        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if self.rank == 0:
                raw = model.module if hasattr(model, "module") else model
                torch.save({"model": raw.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                           Path(d) / self.STATE)
                (Path(d) / self.HISTORY).write_text(json.dumps(history))
                checkpoint = Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)


def log_metrics(history: List[Dict[str, Any]], config: Dict[str, Any], rank: int) -> None:
    """After the report, so the file never runs ahead of the checkpoints; the whole history each time, so a resumed
    run rewrites it and never duplicates an epoch. The driver shows it (:class:`EpochLog`): a worker's own prints
    reach the driver through Ray's log streaming, once per worker and sometimes twice."""
    if rank == 0:
        write_jsonl_atomic(history, location(config["train_dir"]) / "metrics.jsonl")


class EpochLog:
    """On the driver, while ``trainer.fit()`` runs: follows metrics.jsonl and logs one line every ``every`` epochs
    (about ten lines a run) and the last one."""

    def __init__(self, path: Path, epochs: int, enabled: bool):
        import threading

        self.path, self.epochs, self.enabled = path, epochs, enabled
        self.every = max(1, epochs // 10)
        self.shown = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)
            self._show()

    def _follow(self) -> None:
        while not self._stop.wait(1.0):
            self._show()

    def _show(self) -> None:
        try:
            history = [json.loads(x) for x in self.path.read_text().splitlines()]
        except (OSError, ValueError):  # not written yet, or mid-replace
            return
        for m in history:
            e = m["epoch"]
            if e > self.shown and ((e + 1) % self.every == 0 or e + 1 == self.epochs):
                shown = {k: round(v, 4) for k, v in m.items() if isinstance(v, float)}
                log("train").info(f"epoch {e + 1}/{self.epochs} {shown}")
                self.shown = e


def _quiet_ray_train_reports() -> None:
    """Ray Train logs "Reporting training result ..." (a full repr of every report) through a logger named by its
    file path, which its own log_level filter (RunConfig.logging_config, for ``ray.train.*``) misses: quiet it here,
    on the worker, unless -v."""
    import logging

    from pipeline.runtime.log import verbosity

    if verbosity() < 1:
        from ray.train.v2._internal.execution import context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)


def train_loop(config: Dict[str, Any]) -> None:
    """Runs on every Ray Train worker: restore, then epoch after epoch train, validate, checkpoint, log."""
    import ray.train
    import torch

    from pipeline.policy.blocksize import BlockSizeMLP

    _quiet_ray_train_reports()
    t = config["train"]
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(t["seed"] + rank)
    model = BlockSizeMLP(config["vocab_size"], len(config["candidates"]), t["hidden"], t["n_layers"], t["dropout"])
    opt = torch.optim.Adam(model.parameters(), lr=t["lr"])
    checkpointer = Checkpointer(rank)
    start_epoch, history = checkpointer.restore(model, opt)
    model = ray.train.torch.prepare_model(model)
    train_data = SplitData(ray.train.get_dataset_shard("train"), config, shuffle=True)
    val_data = SplitData(ray.train.get_dataset_shard("val"), config, shuffle=False)
    every = max(1, int(t.get("checkpoint_every", 1)))
    for epoch in range(start_epoch, t["epochs"]):
        metrics = train_epoch(model, opt, train_data, epoch, t, config.get("speed"))
        metrics.update(validate(model, val_data, epoch, config))
        history.append(metrics)
        # A Ray Train report (with its checkpoint) costs ~2 s on a small machine whatever the model: every
        # `checkpoint_every` epochs and at the last, not every epoch. metrics.jsonl follows the reports.
        if (epoch + 1) % every == 0 or epoch + 1 == t["epochs"]:
            checkpointer.save_and_report(model, opt, epoch, metrics, history)
            log_metrics(history, config, rank)


def _split_tables(shards: List[Path], val_fraction: float, label_col: str, candidates: List[int],
                  calibration_fraction: float = 0.0, costs: Optional[List[float]] = None):
    """Small columns only (no logits): the driver's view of the split and of the baselines. Returns
    (split names, tau, label index, argmax-tau label index)."""
    import pyarrow as pa

    t = pa.concat_tables([read_table(p, columns=["prompt_id", "tau", label_col]) for p in shards])
    ids = t.column("prompt_id").to_pylist()
    split = np.array([split_of(i, val_fraction, calibration_fraction) for i in ids])
    tau = np.array(t.column("tau").to_pylist(), dtype=np.float32)
    index = {b: i for i, b in enumerate(candidates)}
    y_tau = np.array([index[int(b)] for b in t.column(label_col).to_pylist()])
    y = np.argmax(tau / np.asarray(costs)[None, :], axis=1) if costs is not None else y_tau
    return split, tau, y, y_tau


def _load_cost_profile(cfg: PipelineConfig, labels_dir):
    """train.cost_profile, else the labelling profile beside the shards; (None, None) when neither exists and the
    objective does not need one."""
    from pipeline.policy.cost import FILENAME, CostProfile

    path = location(cfg.train.cost_profile) if cfg.train.cost_profile else labels_dir / FILENAME
    if not path.is_file():
        if cfg.train.cost_profile or _uses_costs(cfg):
            raise ValueError(f"config key 'train.cost_profile': no cost profile at {path} (objective "
                             f"{cfg.train.objective!r} needs one: run `blockpilot profile` and pass "
                             "train.cost_profile=PATH, or relabel)")
        return None, None
    return CostProfile.load(path), path


def fingerprint(cfg: PipelineConfig, labels_dir: Path) -> Dict[str, Any]:
    """What the policy learns from: the label set (its manifest) and the train settings that shape the model."""
    fp = {"labels_manifest_sha256": file_sha256(labels_dir / MANIFEST), "train": vars(cfg.train).copy()}
    from pipeline.policy.cost import FILENAME

    profile = location(cfg.train.cost_profile) if cfg.train.cost_profile else labels_dir / FILENAME
    fp["cost_profile_sha256"] = file_sha256(profile) if profile.is_file() else None
    for key in ("num_workers", "use_gpu", "max_failures", "cache_max_gb"):  # how it runs, not what it learns
        fp["train"].pop(key)
    return fp


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    t_start = time.monotonic()
    out = resolve(cfg.output_dir)  # a local folder, or object storage (s3://...)
    labels_dir, train_dir = out / "labels", out / "train"
    folder = StageFolder(train_dir, "train", extra_outputs=(RUN_NAME, "policy", "metrics.jsonl", "curves.png"))
    folder.ensure_writable()
    report = validate_dataset(str(labels_dir))
    if not report.ok:
        raise ValueError(f"label dataset {labels_dir} is not valid, train refuses it:\n  " +
                         "\n  ".join(report.problems))
    fp = fingerprint(cfg, labels_dir)
    previous = folder.previous_summary(fp)
    if previous is not None:
        return folder.skipped(previous, t_start)
    folder.bind(fp, cfg.force)
    folder.start(cfg)
    shards = list_shards(labels_dir)
    meta = decode_metadata(parquet_file(shards[0]).schema_arrow.metadata)
    candidates = [int(b) for b in meta["candidates"]]
    vocab = int(meta["vocab_size"])
    B = int(meta["trained_block_size"])
    label_col = _label_column(cfg)
    profile, profile_path = _load_cost_profile(cfg, labels_dir)
    costs = [profile.cost(b) for b in candidates] if profile is not None else None
    use_costs = _uses_costs(cfg)
    # A classifier on the argmax-tau label (paper, hard with label=tau, soft) ignores the costs while training;
    # the modelled-speed metrics and the best fixed b still use them when a profile exists.
    calib_frac = cfg.train.calibration_fraction if cfg.train.objective == "speed" else 0.0
    split, tau, y, y_tau = _split_tables(shards, cfg.train.val_fraction, label_col, candidates, calib_frac,
                                         costs if use_costs else None)
    train_mask, val_mask = split == "train", split == "val"
    if train_mask.sum() == 0:
        raise ValueError("train.val_fraction + train.calibration_fraction leave no training rows")
    # Baselines decided on the TRAIN split only: the single best fixed b (the fastest by modelled time per token
    # under the cost profile; by mean tau without one), and the majority class.
    if costs is not None:
        fixed_index = int(np.argmin((np.asarray(costs)[None, :] / tau[train_mask]).mean(axis=0)))
    else:
        fixed_index = int(np.argmax(tau[train_mask].mean(axis=0)))
    majority = int(np.bincount(y[train_mask], minlength=len(candidates)).argmax())
    trained_index = candidates.index(B) if B in candidates else len(candidates) // 2
    speed = None
    if cfg.train.objective == "speed":
        from pipeline.policy.blocksize import speed_targets

        target = speed_targets(tau[train_mask].astype(np.float64), np.asarray(costs), fixed_index)
        speed = {"costs": costs, "fallback_index": fixed_index, "scale": float(max(target.std(), 1e-4))}

    ray = init_ray(cfg.ray)
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.data.DataContext.get_current().enable_progress_bars = False
    columns = ["prompt_id", "logits", "tau", label_col]
    fs, _ = arrow_filesystem(labels_dir)  # the stages' own filesystem client, local or object storage
    ds = ray.data.read_parquet([arrow_filesystem(p)[1] for p in shards], filesystem=fs).select_columns(columns)
    frac = cfg.train.val_fraction

    def keep(batch, split: str):
        mask = np.array([split_of(i, frac, calib_frac) == split for i in batch["prompt_id"]], dtype=bool)
        return {k: v[mask] for k, v in batch.items()}

    train_ds = ds.map_batches(keep, fn_kwargs={"split": "train"}, batch_format="numpy")
    val_ds = ds.map_batches(keep, fn_kwargs={"split": "val"}, batch_format="numpy")
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
            "progress": cfg.progress, "costs": costs if use_costs else None, "speed": speed,
            "cache_in_memory": len(val_mask) * vocab * 4 <= cfg.train.cache_max_gb * 2**30,
        },
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": per_worker}),
        datasets={"train": train_ds, "val": val_ds},
        dataset_config=DataConfig(datasets_to_split=["train"]),
        run_config=RunConfig(
            name=RUN_NAME, **_storage(train_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            logging_config=ray_train_logging_config(),
        ),
    )
    calib_rows = int((split == "calib").sum())
    log("train").info(f"{int(train_mask.sum())} train / {calib_rows} calibration / {int(val_mask.sum())} val rows, "
                      f"objective {cfg.train.objective}, candidates {candidates}, V={vocab}, {cfg.train.epochs} "
                      f"epochs, {cfg.train.num_workers} worker(s), gpu={use_gpu}")
    if costs is not None:
        log("train").info(f"cost profile {profile_path}: ms per step {[round(c * 1e3, 3) for c in costs]}; label "
                          f"argmax tau {_hist(y_tau, candidates)} -> argmax tau/cost "
                          f"{_hist(np.argmax(tau / np.asarray(costs)[None, :], axis=1), candidates)}")
    with EpochLog(train_dir / "metrics.jsonl", cfg.train.epochs, cfg.progress):
        result = trainer.fit()
    summary = _export(cfg, result, train_dir, candidates, vocab, B, fp, fixed_index, majority, y, val_mask,
                      shards=shards, split=split, tau=tau, y_tau=y_tau, costs=costs, speed=speed, profile=profile,
                      profile_path=profile_path)
    summary.update(status="done", wall_seconds=round(time.monotonic() - t_start, 1))
    folder.complete(summary)
    _print_summary(summary)
    return summary


def _storage(train_dir) -> Dict[str, Any]:
    """Ray Train's checkpoint storage: the train folder itself, on disk or in object storage (through the same
    filesystem client as the other stages, so an S3-compatible endpoint set in the environment applies to both)."""
    if not is_remote(train_dir):
        return {"storage_path": str(train_dir)}
    fs, path = arrow_filesystem(train_dir)
    return {"storage_path": path, "storage_filesystem": fs}


def _hist(index: np.ndarray, candidates: List[int]) -> Dict[int, int]:
    counts = np.bincount(np.asarray(index, dtype=np.int64), minlength=len(candidates))
    return {int(b): int(n) for b, n in zip(candidates, counts)}


def _export(cfg, result, train_dir: Path, candidates, vocab, B, fp, fixed_index, majority, y, val_mask, *, shards,
            split, tau, y_tau, costs, speed, profile, profile_path):
    import torch

    from pipeline.policy.blocksize import SPEED_SCORE, BlockSizeMLP, BlockSizePolicy

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
            "best_fixed_block_size": candidates[fixed_index], "trained_block_size": int(B),
            "best_fixed_chosen_on": "the train split, by modelled time per token (cost profile)" if costs else
            "the train split, by mean tau"}
    held_out: Dict[str, Any] = {}
    if profile is not None:
        info["cost_profile"] = {"file": "cost_profile.json", "source": str(profile_path),
                                "seconds": {str(b): profile.cost(b) for b in candidates},
                                "device": profile.meta.get("device"), "hardware": profile.meta.get("hardware")}
    if speed is not None:
        model.eval()
        held_out = _held_out(model, t, shards, split, tau, np.asarray(costs), fixed_index, speed["scale"])
        info.update(score=SPEED_SCORE, score_scale=speed["scale"], fallback_block_size=candidates[fixed_index],
                    margin=held_out["calibration"]["margin"], calibration=held_out["calibration"])
    else:
        info["score"] = "class_logits"
    policy = BlockSizePolicy(model, candidates, vocab, t.input_transform, info)
    policy.save_pretrained(train_dir / "policy")
    if profile is not None:
        profile.save(train_dir / "policy" / "cost_profile.json")  # what evaluate's modelled speedups use
    _plot(history, train_dir / "curves.png")
    labels = {"argmax_tau": _hist(y_tau, candidates)}
    if costs is not None:
        labels["argmax_tau_over_cost"] = _hist(np.argmax(tau / np.asarray(costs)[None, :], axis=1), candidates)
    return {
        "objective": t.objective, "label_histograms": labels, "held_out": held_out,
        "fallback_block_size": info.get("fallback_block_size"), "margin": info.get("margin"),
        "calibration_rows": int((split == "calib").sum()),
        "stage": "train", "output": str(train_dir), "policy": str(train_dir / "policy"),
        "epochs": int(state["epoch"]) + 1, "train_rows": int((split == "train").sum()), "val_rows": int(val_mask.sum()),
        "candidates": candidates, "best_fixed_block_size": candidates[fixed_index],
        "majority_class_block_size": candidates[majority],
        "val_majority_accuracy": float((val_y == majority).mean()) if len(val_y) else None,
        "final": final,
    }


def _held_out(model, t, shards, split, tau, costs, fallback_index: int, scale: float) -> Dict[str, Any]:
    """Calibrate the fallback margin on the calibration rows, then measure on the val rows (never seen by either)
    the modelled gain over the fallback b, and the share of the oracle's gain, of: the MLP's raw argmax, the MLP with
    the fallback (the exported policy), a ridge regression on 32 principal components of the logits with the same
    calibrated fallback, and a perfect predictor of the paper's argmax-tau label."""
    import pyarrow as pa
    import torch

    from pipeline.policy.blocksize import calibrate_margin, speed_gain, speed_targets, transform_inputs

    tab = pa.concat_tables([read_table(p, columns=["logits"]) for p in shards])
    x = np.stack(tab.column("logits").to_numpy(zero_copy_only=False)).astype(np.float32)
    with torch.no_grad():
        s = model(transform_inputs(torch.from_numpy(x), t.input_transform)).numpy().astype(np.float64)
    pred_mlp = s * scale
    tr, ca, va = split == "train", split == "calib", split == "val"
    # The ridge baseline: 32 principal components of the train rows' logits -> every candidate's log speed ratio.
    target = speed_targets(tau.astype(np.float64), costs, fallback_index)
    mu = x[tr].mean(axis=0)
    _, _, vt = np.linalg.svd(x[tr] - mu, full_matrices=False)
    z = (x - mu) @ vt[:32].T
    z /= z[tr].std(axis=0).clip(1e-6)
    zt = np.c_[z, np.ones(len(z))]
    w = np.linalg.solve(zt[tr].T @ zt[tr] + 10.0 * np.eye(zt.shape[1]), zt[tr].T @ target[tr])
    pred_ridge = zt @ w
    fb = np.full(len(tau), fallback_index)
    oracle = np.argmax(tau / costs[None, :], axis=1)
    out: Dict[str, Any] = {}
    policies = {}
    for name, pred in (("mlp", pred_mlp), ("ridge", pred_ridge)):
        best = pred.argmax(axis=1)
        gain = pred.max(axis=1) - pred[:, fallback_index]
        cal = calibrate_margin(gain[ca], best[ca], tau[ca], costs, fallback_index)
        m = cal["margin"]
        with_fallback = fb if m is None else np.where(gain > m, best, fb)
        policies[f"{name}_argmax"] = best
        policies[f"{name}_with_fallback"] = with_fallback
        if name == "mlp":
            out["calibration"] = cal
        else:
            out["ridge_calibration"] = cal
    policies["paper_label_perfect"] = np.argmax(tau, axis=1)
    policies["oracle"] = oracle
    n_val = int(va.sum())
    oracle_gain = speed_gain(tau[va], costs, oracle[va], fb[va]) if n_val else 0.0
    out["val_rows"] = n_val
    out["val"] = {}
    for name, chosen in policies.items():
        g = speed_gain(tau[va], costs, chosen[va], fb[va]) if n_val else 0.0
        out["val"][name] = {"gain": g, "oracle_gain_captured": g / oracle_gain if oracle_gain > 0 else None,
                            "switched": int((chosen[va] != fb[va]).sum())}
    return out


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
    savefig(fig, path, dpi=90)
    plt.close(fig)


def _print_summary(s: Dict[str, Any]) -> None:
    f = s["final"]
    log("train").info(f"done: {s['epochs']} epochs -> {s['policy']}")
    if "val_accuracy" in f:
        log("train").info(f"val accuracy {f['val_accuracy']:.3f} (majority class {s['val_majority_accuracy']:.3f}); "
                          f"val mean tau: policy {f['val_tau_policy']:.3f}, best fixed b={s['best_fixed_block_size']} "
                          f"{f['val_tau_best_fixed']:.3f}, oracle {f['val_tau_oracle']:.3f}")
    h = s.get("held_out") or {}
    if h.get("val"):
        cal = h["calibration"]
        margin = "none (always the fallback)" if cal["margin"] is None else f"{cal['margin']:.4f}"
        log("train").info(f"fallback b={s['fallback_block_size']}, margin {margin} (calibrated on "
                          f"{cal['calibration_rows']} rows: gain {cal['calibration_gain']:+.2%}, "
                          f"{cal['calibration_switched']} switched)")
        shares = ", ".join(f"{k} {v['gain']:+.2%}" + (f" ({v['oracle_gain_captured']:.0%})"
                                                       if v["oracle_gain_captured"] is not None else "")
                           for k, v in h["val"].items())
        log("train").info(f"held-out val ({h['val_rows']} rows) modelled gain over the fallback b "
                          f"(share of the oracle's): {shares}")
