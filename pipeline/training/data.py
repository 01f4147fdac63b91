"""Label shards -> arrays: a batch's (logits, label index, tau), one split's batches epoch after epoch, and the
driver's view of the split (small columns only, no logits).

The rows split train / calibration / val by a hash of prompt_id (:func:`pipeline.policy.blocksize.split_of`), so the
split is the same on every run, machine and shard layout.

Logits are read as float32 whatever the set's ``blockpilot.logits_precision`` (fp16 or bf16: both are stored as
float32 holding the rounded values, pipeline.data.schemas.round_logits; schema v1's float16 is widened), so one
reader serves every precision and the model sees exactly the stored values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.io.storage import read_table
from pipeline.policy.blocksize import split_of
from pipeline.policy.labels import speed_label

Batch = Tuple[np.ndarray, np.ndarray, np.ndarray]  # logits [n, V], label index [n], tau [n, |C|]

# The stored label a classifier reads (objective hard with train.label=tau, paper, soft); speed, and hard with
# train.label=speedup, recompute theirs from tau under train.cost_profile (:func:`to_arrays`).
LABEL_COLUMN = "label_block_size"


def uses_costs(objective: str, label: str) -> bool:
    """Whether the model learns from the speed label (argmax tau / cost) rather than the stored argmax-tau one."""
    return objective == "speed" or (objective == "hard" and label == "speedup")


def label_index(block_sizes: Iterable[Any], candidates: Sequence[int]) -> np.ndarray:
    """Each stored label block size as its index among the candidates."""
    index = {b: i for i, b in enumerate(candidates)}
    return np.array([index[int(b)] for b in block_sizes], dtype=np.int64)


def to_arrays(batch: Dict[str, np.ndarray], candidates: List[int], label_col: str = LABEL_COLUMN,
              costs: Optional[Sequence[float]] = None) -> Batch:
    """(logits, label index, tau). With ``costs`` (seconds per step per candidate, train.cost_profile) the label is
    the speed label, whatever profile the rows were labelled on."""
    x = np.stack(batch["logits"]).astype(np.float32)
    tau = np.stack(batch["tau"]).astype(np.float32)
    if costs is not None:
        y = np.asarray(speed_label(tau, costs), dtype=np.int64)
    else:
        y = label_index(batch[label_col], candidates)
    return x, y, tau


def histogram(index: np.ndarray, keys: Sequence[Any]) -> Dict[Any, int]:
    """Rows per candidate block size (or per action, ``keys`` naming each), from label indices."""
    counts = np.bincount(np.asarray(index, dtype=np.int64), minlength=len(keys))
    return {(int(k) if isinstance(k, (int, np.integer)) else k): int(n) for k, n in zip(keys, counts)}


class InMemoryShard:
    """A small split's columns ({name: array}, one row per entry) with the one method of Ray Data's DataIterator that
    :class:`SplitData` calls: a small label set reaches Ray Train's workers through the object store, not as a Ray
    Dataset. Hand-written on purpose: Ray Data's split of an in-memory dataset started four actors of its own
    (DatasetManager, SplitCoordinator, _StatsActor, _AutoscalingCoordinatorActor), ~8 CPU-s per train on a 2-core
    machine, to hand a worker rows the driver already held (benchmarks/results/train-in-memory.md)."""

    def __init__(self, columns: Dict[str, np.ndarray]):
        self.columns = {k: np.asarray(v) for k, v in columns.items()}
        self.rows = len(next(iter(self.columns.values()))) if self.columns else 0

    def part(self, rank: int, world: int) -> "InMemoryShard":
        """Rank ``rank``'s rows of ``world`` workers: every world-th row, so the parts differ by at most one row."""
        return InMemoryShard({k: v[rank::world] for k, v in self.columns.items()})

    def iter_batches(self, batch_size: int, batch_format: str = "numpy", local_shuffle_buffer_size=None,
                     local_shuffle_seed=None) -> Iterator[Dict[str, np.ndarray]]:
        assert batch_format == "numpy", batch_format
        shuffle = local_shuffle_buffer_size is not None or local_shuffle_seed is not None
        order = np.random.default_rng(local_shuffle_seed).permutation(self.rows) if shuffle else np.arange(self.rows)
        for i in range(0, self.rows, batch_size):
            idx = order[i:i + batch_size]
            yield {k: v[idx] for k, v in self.columns.items()}


class SplitData:
    """One split's batches, epoch after epoch, from ``shard`` (anything with Ray Data's ``iter_batches``). A split
    that fits in memory (decided by the driver) is read once and reshuffled in memory, since re-running the read
    pipeline every epoch costs more than the epoch (benchmarks/results/train-report-cost.md)."""

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
            yield to_arrays(b, self.cands, self.label_col, self.costs)

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


@dataclass
class Splits:
    """The driver's view of the label set, one entry per row in shard order."""

    split: np.ndarray  # "train" | "calib" | "val"
    tau: np.ndarray  # float32 [N, |A|]: the candidates, then the rule actions' equivalent tau
    y: np.ndarray  # the label index the model learns (the speed label when it uses costs)
    y_tau: np.ndarray  # the stored argmax-tau label index
    # Keys a row's attention reads on average over its decode (prompt tokens + half its new tokens), where the
    # shards record prompt_tokens: what a batched step's width is drawn from (pipeline.policy.load_cost.schedule).
    widths: Optional[np.ndarray] = None

    @property
    def train(self) -> np.ndarray:
        return self.split == "train"

    @property
    def train_widths(self) -> Optional[np.ndarray]:
        """``widths`` of the train rows (None where the shards do not record prompt lengths)."""
        return None if self.widths is None else self.widths[self.train]

    @property
    def calib(self) -> np.ndarray:
        return self.split == "calib"

    @property
    def val(self) -> np.ndarray:
        return self.split == "val"


def in_split(prompt_ids: Iterable[str], split: str, val_fraction: float,
             calibration_fraction: float = 0.0) -> np.ndarray:
    """Row mask of the prompts in ``split`` ("train" | "calib" | "val")."""
    return np.array([split_of(i, val_fraction, calibration_fraction) == split for i in prompt_ids], dtype=bool)


def with_rule_tau(tau: np.ndarray, prompt_ids: Sequence[str], rule_tau: Optional[Dict[str, List[float]]]) -> np.ndarray:
    """tau [n, |C|] with each row's rule actions' equivalent tau appended (pipeline.training.problem)."""
    if not rule_tau:
        return tau
    return np.concatenate([tau, np.array([rule_tau[str(i)] for i in prompt_ids], dtype=tau.dtype)], axis=1)


def as_tau(batch: Dict[str, Any], tau_column: str, candidates: Sequence[int]) -> Dict[str, Any]:
    """A batch ({column: values}) whose ``tau`` is ``tau_column`` (train.tau_column) and whose stored argmax-tau label
    (LABEL_COLUMN) is that column's argmax, ties to the smaller b as label stores them; unchanged for ``tau``."""
    if tau_column == "tau":
        return batch
    out = {k: v for k, v in batch.items() if k != tau_column}
    rows = [np.asarray(x, dtype=np.float32) for x in batch[tau_column]]
    tau = np.stack(rows) if rows else np.zeros((0, len(candidates)), dtype=np.float32)
    out["tau"] = list(tau) if isinstance(batch[tau_column], list) else tau
    if LABEL_COLUMN in batch:
        out[LABEL_COLUMN] = np.asarray(candidates)[tau[:, :len(candidates)].argmax(1)]
    return out


def read_splits(shards: List[Path], val_fraction: float, candidates: List[int], calibration_fraction: float = 0.0,
                costs: Optional[Sequence[float]] = None, label_col: str = LABEL_COLUMN,
                rule_tau: Optional[Dict[str, List[float]]] = None, tau_column: str = "tau") -> Splits:
    """The split, tau (``tau_column``, with the rule actions' columns) and labels of every row (no logits: this runs
    on the driver)."""
    import pyarrow as pa

    from pipeline.io.storage import parquet_file

    sized = all({"prompt_tokens", "new_tokens"} <= set(parquet_file(p).schema_arrow.names) for p in shards)
    extra = ["prompt_tokens", "new_tokens"] if sized else []
    t = pa.concat_tables([read_table(p, columns=["prompt_id", tau_column, label_col, *extra]) for p in shards])
    d = as_tau(t.to_pydict(), tau_column, candidates)
    ids = d["prompt_id"]
    split = np.array([split_of(i, val_fraction, calibration_fraction) for i in ids])
    tau = with_rule_tau(np.array(d["tau"], dtype=np.float32), ids, rule_tau)
    y_tau = label_index(d[label_col], candidates)
    y = np.asarray(speed_label(tau, costs), dtype=np.int64) if costs is not None else y_tau
    widths = np.array([p + (n[0] if n else 0) / 2 for p, n in zip(d["prompt_tokens"], d["new_tokens"])],
                      dtype=np.float64) if sized else None
    return Splits(split, tau, y, y_tau, widths)


def read_logits(shards: List[Path]) -> np.ndarray:
    """Every row's logits [N, V] float32, in shard order (the held-out analyses need them all at once)."""
    import pyarrow as pa

    tab = pa.concat_tables([read_table(p, columns=["logits"]) for p in shards])
    return np.stack(tab.column("logits").to_numpy(zero_copy_only=False)).astype(np.float32)
