"""The pipeline's stages: one module per stage, each exposing ``run(cfg) -> dict`` (its summary).

The registry below is what the CLI and ``jobs/`` dispatch on; a stage reads only the config sections it names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Tuple


@dataclass(frozen=True)
class StageInfo:
    name: str
    summary: str
    # Config sections the stage reads, itself or through the stage modules it uses (shown by `blockpilot STAGE
    # --help`; tests/test_config_cli.py checks them against the stage modules' source).
    sections: Tuple[str, ...]
    module: str

    def load(self) -> Callable:
        try:
            mod = importlib.import_module(self.module)
        except ModuleNotFoundError as err:
            if err.name == self.module:
                raise NotImplementedError(f"stage '{self.name}' is not built yet") from None
            raise
        return mod.run


STAGES = {
    s.name: s
    for s in (
        StageInfo("prepare", "prompt sources -> clean, deduplicated, chat-formatted prompt shards with stable ids "
                  "(output_dir/prompts/part-*.parquet, rejects, manifest), in shards that give every expected label worker "
                  "several (label.num_workers, workers, ray)", ("model", "prepare", "label", "workers", "ray"),
                  "stages.prepare"),
        StageInfo("label", "Ray actors (one per GPU, or CPU workers) decode every prompt at every candidate block "
                  "size and write label shards (output_dir/labels/)", ("model", "decode", "prepare", "label", "profile",
                                                                         "engine", "vllm", "workers", "ray"),
                  "stages.label"),
        StageInfo("preflight", "check every worker the label stage expects before any work: devices (Ray's GPUs "
                  "against torch), the models (reachable, weights matching their class, the same bytes on every "
                  "node), output_dir (written and read from every node), the memory plan; one table, exit 1 naming "
                  "the node and the key", ("model", "decode", "prepare", "label", "profile", "engine", "vllm",
                                          "workers", "ray"),
                  "stages.preflight"),
        StageInfo("profile", "the cost model alone: seconds per decode step (draft and verify apart) at every b in "
                  "1..2B on this machine -> cost_profile.json (train.cost_profile=PATH uses it)",
                  ("model", "decode", "label", "profile", "engine"), "stages.profile"),
        StageInfo("train", "Ray Train fits the MLP block-size policy on the label shards, with checkpoints "
                  "(output_dir/train/, exported policy in output_dir/train/policy/)", ("train", "model", "ray"),
                  "stages.train"),
        StageInfo("tune", "choose the per-step verify rule (threshold, running acceptance, or learned from the "
                  "labels' traces): every rule simulated on the label set's held-out prompts by modelled time, the "
                  "best decoded to confirm (output_dir/tune/step_rule.json, verify_model.json); then b*(c) timed against no "
                  "speculation on val prompts at each c > 1 of evaluate.concurrency, K = 0 where it is not measured "
                  "faster (tune/load_check.json)",
                  ("model", "decode", "prepare", "tune", "engine", "workers", "ray"), "stages.tune"),
        StageInfo("evaluate", "adaptive decoding with the policy vs autoregressive, every fixed b and the oracle, "
                  "on held-out prompt sets (output_dir/eval/)",
                  ("model", "decode", "prepare", "evaluate", "engine", "workers", "ray"),
                  "stages.evaluate"),
        StageInfo("report", "tables and plots over labels, training and evaluation (output_dir/report/)", (),
                  "stages.report"),
        StageInfo("run", "prepare -> label -> train -> tune -> evaluate -> report; stages already complete are "
                  "skipped", ("model", "decode", "prepare", "label", "profile", "engine", "vllm", "train", "tune",
                              "evaluate", "workers", "ray"),
                  "stages.run"),
    )
}
