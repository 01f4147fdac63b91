"""What label and evaluate share: a shard stage whose workers decode prompt shards with the target + draft pair.

Prompt shard ``part-N`` becomes output shard ``part-N``. Each worker loads the models once (``setup``); one prompt
that fails while decoding (CUDA OOM, any error) becomes a ``decode_error`` reject and the rest of its shard
completes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Tuple

import pyarrow as pa

from pipeline.executor.stage import Plan, Rejects, Resources, ShardStage, Worker, tasks_from_shards
from pipeline.io.storage import location


class DecodingStage(ShardStage):
    unit = "prompts"

    def __init__(self, cfg, folder: Path, prompts: Path, num_workers):
        super().__init__(cfg, folder)
        self.prompts = location(prompts)  # the prompt shards (prepare's schema) it decodes
        self.num_workers = num_workers

    def plan(self) -> Plan:
        return Plan(tasks_from_shards(self.prompts))

    def resources(self) -> Resources:
        w = self.cfg.workers
        return Resources(actors=True, num_workers=self.num_workers, cpus_per_worker=w.cpus_per_worker,
                         max_retries=w.max_retries)

    def setup(self, worker: Worker) -> None:
        import torch

        from pipeline.decoding.engine import Engine
        from pipeline.decoding.models import load_models

        if worker.threads:
            torch.set_num_threads(worker.threads)
        self.worker = worker
        self.models = load_models(self.cfg.model)
        stops = self.models.stop_token_ids if self.cfg.decode.stop_on_eos else None
        self.engine = Engine(self.models.target, self.models.draft, stops)
        self.device = f"{self.models.device}/{str(self.models.dtype).replace('torch.', '')}"

    def worker_info(self) -> Dict[str, Any]:
        return {"device": self.device}

    def decode_kwargs(self) -> Dict[str, Any]:
        d = self.cfg.decode
        return dict(max_new_tokens=d.max_new_tokens, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
                    seed=d.seed)

    def each_prompt(self, shard: str, table: pa.Table, rejects: Rejects,
                    measure: Callable[[Dict[str, Any]], Any]) -> Iterator[Tuple[Dict[str, Any], Any]]:
        """``(row, measure(row))`` for every prompt row of a shard; a row whose measure raises is rejected."""
        import torch

        from pipeline.runtime.log import verbosity

        t0 = time.perf_counter()
        verbose = self.cfg.progress and verbosity() >= 1
        for i, rec in enumerate(table.to_pylist()):
            try:
                result = measure(rec)
            except Exception as err:  # noqa: BLE001 - one prompt's failure must not lose the shard
                if "out of memory" in str(err).lower() and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                rejects.add(rec, "decode_error", f"{type(err).__name__}: {err}")
                continue
            yield rec, result
            if verbose and (i + 1) % 16 == 0:  # inside a shard, with -v only: the driver reports every shard
                print(f"[{self.name} {self.worker.identity}] {location(shard).name}: {i + 1}/{table.num_rows} prompts "
                      f"({(i + 1) / (time.perf_counter() - t0):.2f}/s)", flush=True)

    @staticmethod
    def input_ids(rec: Dict[str, Any]):
        import torch

        return torch.tensor(rec["input_ids"], dtype=torch.long)[None]
