"""What label and evaluate share: a shard stage whose workers decode prompt shards with the target + draft pair.

Prompt shard ``part-N`` becomes output shard ``part-N``. Each worker loads the models once (``setup``); one prompt
that fails while decoding (CUDA OOM, any error) becomes a ``decode_error`` reject and the rest of its shard
completes.
"""

from __future__ import annotations

import time
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Tuple

import pyarrow as pa

from pipeline.executor.stage import Plan, Rejects, Resources, ShardStage, Worker, tasks_from_shards
from pipeline.io.storage import location


class DecodingStage(ShardStage):
    unit = "prompts"

    on_ray = False  # set by pipeline.executor.ray.executor.execute: the actor pool's placement decides where models run

    def __init__(self, cfg, folder: Path, prompts: Path, num_workers, workers_key: str):
        super().__init__(cfg, folder)
        self.prompts = location(prompts)  # the prompt shards (prepare's schema) it decodes
        self.num_workers = num_workers
        self.workers_key = workers_key

    def plan(self) -> Plan:
        return Plan(tasks_from_shards(self.prompts))

    def resources(self) -> Resources:
        w = self.cfg.workers
        return Resources(actors=True, num_workers=self.num_workers, cpus_per_worker=w.cpus_per_worker,
                         max_retries=w.max_retries, workers_key=self.workers_key, device=self.cfg.model.device)

    # -- what was loaded, where: the fingerprint's part that no config value says --
    @cached_property
    def placement(self):
        """The pool's pipeline.executor.ray.placement.Placement when the stage runs on Ray (decided once, when the fingerprint
        first needs it: after the driver's cheap checks, so a bad folder fails before Ray starts); else None."""
        if not self.on_ray:
            return None
        from pipeline.executor.ray.placement import plan_workers
        from pipeline.executor.ray.runtime import init_ray

        return plan_workers(self.resources(), init_ray(self.cfg.ray).cluster_resources())

    @property
    def runs_on(self) -> str:
        """"cuda" or "cpu": where the workers run the models (the pool's placement; in-process, this machine)."""
        if self.placement is not None:
            return self.placement.device
        from pipeline.decoding.models import resolve_device

        return resolve_device(self.cfg.model.device).type

    @cached_property
    def provenance(self) -> Dict[str, Any]:
        """What the models are (pipeline.decoding.provenance: a hub commit, or a hash of a folder's weights), the
        packages that compute with them, and the dtype and device kind they run in: a rerun that differs in any of
        these is refused, so that one folder never mixes fp32-CPU rows with bf16-GPU ones, or two trainings of one
        draft. Read in the driver: a local model folder must be readable there too."""
        from pipeline.decoding.models import resolve_dtype
        from pipeline.decoding.provenance import model_provenance, software_versions

        import torch

        m = self.cfg.model
        dtype = resolve_dtype(m.dtype, torch.device(self.runs_on))
        return {"model.target": model_provenance(m.target, m.target_revision, "model.target"),
                "model.draft": model_provenance(m.draft, m.draft_revision, "model.draft"),
                "dtype": str(dtype).replace("torch.", ""), "device": self.runs_on, "versions": software_versions()}

    @cached_property
    def longest_prompt(self) -> int:
        """The longest prompt the stage decodes, in tokens (what its memory plan is sized for): its prompt shards'
        ``prompt_tokens``, else prepare.max_prompt_tokens (shards not written yet)."""
        from pipeline.io.shards import list_shards
        from pipeline.io.storage import read_table

        shards = list_shards(self.prompts) if self.prompts.exists() else []
        longest = max((max(read_table(p, columns=["prompt_tokens"]).column(0).to_pylist() or [0]) for p in shards),
                      default=0)
        return int(longest or self.cfg.prepare.max_prompt_tokens)

    @property
    def largest_block(self) -> int:
        """The largest block size the stage decodes (its memory plan's verify and draft logits)."""
        return max(self.candidates)

    def memory_check(self, facts: Dict[str, Any], dtype) -> Dict[str, Any]:
        from pipeline.executor.memory_checks import engine_check

        return engine_check(self, facts, dtype)

    def preflight_spec(self, placement, token: str):
        from pipeline.executor.preflight import PreflightSpec

        m, p = self.cfg.model, self.provenance
        return PreflightSpec(self.name, placement.device, m.dtype,
                             models={"model.target": (m.target, m.target_revision),
                                     "model.draft": (m.draft, m.draft_revision)},
                             expect={k: p[k] for k in ("model.target", "model.draft", "versions")},
                             output_dir=str(self.cfg.output_dir), token=token)

    def setup(self, worker: Worker) -> None:
        import torch

        from pipeline.decoding.compiled import apply_compile
        from pipeline.decoding.engine import Engine
        from pipeline.decoding.models import load_models

        if worker.threads:
            torch.set_num_threads(worker.threads)
        self.worker = worker
        self.models = load_models(self.cfg.model)
        stops = self.models.stop_token_ids if self.cfg.decode.stop_on_eos else None
        self.compiled = apply_compile(self.models, self.cfg.engine.compile)
        self.engine = Engine(self.models.target, self.models.draft, stops)
        self.device = f"{self.models.device}/{str(self.models.dtype).replace('torch.', '')}"

    def worker_info(self) -> Dict[str, Any]:
        return {"device": self.device, "compiled": self.compiled}

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
