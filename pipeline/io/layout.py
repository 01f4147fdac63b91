"""The names of a run folder's stage folders and files: the one place they are spelled.

A run folder (``output_dir``) holds one folder per stage; every stage folder holds rank-named shards, a manifest, a
``_SUCCESS`` marker, its resolved config, a summary and (for datasets handed to other teams) a card. The names a
user, a reader or another team relies on are spelled here and nowhere else; code asks :class:`RunLayout` for a
path instead of joining string literals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# ---- files in every stage folder ---------------------------------------------------------------------------------
SUCCESS = "_SUCCESS"
MANIFEST = "manifest.json"
FINGERPRINT = "fingerprint.json"
SUMMARY = "summary.json"
CARD = "README.md"  # the Hugging Face dataset-repo convention: the card, with YAML front matter naming the shards
CONFIG = "config.yaml"
CONFIG_SHA256 = "config.sha256"
REJECTS = "rejects.jsonl"  # every reject of the stage, in one file
REJECTS_DIR = "_rejects"  # per-shard reject files; the leading underscore keeps Parquet globs out of it
INPUT_REJECTS = "input.jsonl"  # rows rejected before sharding (prepare's bad source rows)
CHECKSUMS_DIR = "_checksums"  # part-NNNNN.json: each shard's sha256, published just before the shard itself
# {file: stamp} of the shards the manifest lists, as last listed (pipeline.io.storage.listing): kept apart from
# manifest.json, which must stay the same bytes for the same shards (label fingerprints prepare's), while a stamp
# (an mtime on a local disk) differs with every write of the same bytes
STAMPS = "_stamps.json"
LEASE = "_lease.json"  # the one writer's lease: host, pid, start, heartbeat (pipeline.executor.lease)
LEASE_LOCK = "_lease.lock"  # local folders only: serialises lease takeovers and heartbeats (flock)

# ---- artefacts ---------------------------------------------------------------------------------------------------
COST_PROFILE = "cost_profile.json"  # pipeline.policy.cost.CostProfile (beside label shards, and beside a policy)
POLICY_META = "policy.json"  # pipeline.policy.blocksize.BlockSizePolicy: metadata, candidates, fallback
POLICY_WEIGHTS = "model.safetensors"
POLICY_FILES = (POLICY_META, POLICY_WEIGHTS)
STEP_RULE = "step_rule.json"  # tune's choice of per-step verify rule
LOAD_CHECK = "load_check.json"  # tune's measured check of b*(c) against no speculation (pipeline.evaluation.load_check)
VERIFY_MODEL = "verify_model.json"  # tune's learned verify rule (pipeline.policy.step_rules.LearnedVerify), beside it
METRICS = "metrics.jsonl"  # train's per-epoch metrics
CURVES = "curves.png"  # train's loss and val curves

# ---- stage folders -----------------------------------------------------------------------------------------------
PROMPTS, LABELS, TRAIN, POLICY, TUNE, EVAL, REPORT = "prompts", "labels", "train", "policy", "tune", "eval", "report"


@dataclass(frozen=True)
class RunLayout:
    """Paths inside one run folder (local or object storage: ``root`` is a pathlib-like location)."""

    root: Path

    @property
    def prompts(self) -> Path:
        return self.root / PROMPTS

    @property
    def labels(self) -> Path:
        return self.root / LABELS

    @property
    def train(self) -> Path:
        return self.root / TRAIN

    @property
    def policy(self) -> Path:
        """The exported policy (policy.json + model.safetensors + the cost profile it was trained with)."""
        return self.root / TRAIN / POLICY

    @property
    def tune(self) -> Path:
        return self.root / TUNE

    @property
    def step_rule(self) -> Path:
        return self.root / TUNE / STEP_RULE

    @property
    def load_check(self) -> Path:
        return self.root / TUNE / LOAD_CHECK

    @property
    def verify_model(self) -> Path:
        return self.root / TUNE / VERIFY_MODEL

    @property
    def eval(self) -> Path:
        return self.root / EVAL

    @property
    def eval_prompts(self) -> Path:
        return self.root / EVAL / PROMPTS

    @property
    def report(self) -> Path:
        return self.root / REPORT
