"""The config's value checks (pipeline.runtime.config.load_config runs them): closed sets of values, ranges, and the
keys that must agree with each other. Each failure is a ConfigError naming its key."""

from __future__ import annotations

from typing import Any, Dict


class ConfigError(ValueError):
    """A config problem, raised before any work; the message names the offending key."""


# Choice lists this module owns (their users sit in layers above pipeline.runtime, or in stages/, and import them
# from here). train.input_transform's list is pipeline.policy.blocksize.TRANSFORMS (see _choices).
DTYPES = ("auto", "float32", "float16", "bfloat16")
LABEL_MODES = ("auto", "exhaustive", "replay")
LOGITS_PRECISIONS = ("fp16", "bf16")  # label.logits_precision; documented in pipeline/data/schemas.py
CONTINUATIONS = ("auto", "greedy", "speculative", "vllm")  # label.continuation (pipeline.labelling.continuation)
LABEL_ENGINES = ("hf", "vllm")  # label.engine (pipeline.labelling.vllm_labels)
COMPILE_MODES = ("auto", "on", "off")  # engine.compile (pipeline.decoding.compiled), vllm.compile, profile.share
LOAD_LOADS = ("evaluated", "changes")  # tune.load_loads (pipeline.evaluation.load_check.loads_to_check)
OBJECTIVES = ("speed", "paper", "hard", "soft")
POLICY_MODELS = ("ridge", "mlp")
LABEL_KINDS = ("tau", "speedup")
TAU_COLUMNS = ("tau", "tau_expected")  # train.tau_column; documented in pipeline/data/schemas.py
SOURCE_KINDS = ("bundled", "hf", "jsonl", "json", "parquet", "text", "sharegpt")


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _choices() -> Dict[str, tuple]:
    """Every key with a closed set of values, and the set. The transforms are imported here, not at the top:
    pipeline.policy.blocksize imports torch, which reading a config does not need."""
    from pipeline.policy.blocksize import TRANSFORMS

    return {
        "model.dtype": DTYPES,
        "label.mode": LABEL_MODES, "label.logits_precision": LOGITS_PRECISIONS,
        "label.continuation": CONTINUATIONS, "engine.compile": COMPILE_MODES, "label.engine": LABEL_ENGINES,
        "vllm.compile": COMPILE_MODES, "profile.share": COMPILE_MODES, "tune.load_loads": LOAD_LOADS,
        "train.input_transform": TRANSFORMS,
        "train.objective": OBJECTIVES, "train.model": POLICY_MODELS,
        "train.label": LABEL_KINDS, "train.tau_column": TAU_COLUMNS,
    }


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {msg}")


def validate(cfg) -> None:
    """Every value check of the schema: a bad value fails here, before any work, naming its key."""
    for key, choices in _choices().items():
        value = _get(cfg, key)
        _check(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")
    d = cfg.decode
    _check(d.max_new_tokens >= 1, "decode.max_new_tokens", "must be >= 1")
    _check(d.temperature >= 0, "decode.temperature", "must be >= 0")
    _check(0 < d.top_p <= 1, "decode.top_p", "must be in (0, 1]")
    _check(d.top_k >= 0, "decode.top_k", "must be >= 0")
    _check(cfg.label.k >= 0, "label.k", "must be >= 0")
    _check(0 <= cfg.label.max_reject_fraction <= 1, "label.max_reject_fraction", "must be in [0, 1] (a share of the "
           "prompts)")
    _check(cfg.label.block_size is None or cfg.label.block_size - cfg.label.k >= 1,
           "label.block_size", "B - k must be >= 1")
    b = cfg.label.batch_size
    _check(b == "auto" or (isinstance(b, int) and not isinstance(b, bool) and b >= 1), "label.batch_size",
           f"{b!r} is neither an integer >= 1 nor auto")
    _check(cfg.label.memory_gb is None or cfg.label.memory_gb > 0, "label.memory_gb", "must be > 0")
    for key, low in (("label.num_workers", 1), ("label.trace_block_size", 2),
                     ("prepare.shard_size", 1), ("prepare.max_prompt_tokens", 1), ("prepare.limit", 1),
                     ("prepare.write_threads", 1),
                     ("train.checkpoint_every", 1), ("profile.max_block_size", 1)):  # None: unset, or no bound
        _check(_get(cfg, key) is None or _get(cfg, key) >= low, key, f"must be >= {low}")
    _check(cfg.workers.cpus_per_worker > 0, "workers.cpus_per_worker", "must be > 0")
    _check(cfg.workers.max_retries >= 0, "workers.max_retries", "must be >= 0")
    _check(cfg.workers.wait_s > 0, "workers.wait_s", "must be > 0")
    _check(cfg.prepare.shards_per_worker >= 0, "prepare.shards_per_worker", "must be >= 0 (0: every shard shard_size)")
    _check(cfg.workers.check_timeout_s > 0, "workers.check_timeout_s", "must be > 0")
    _check(cfg.workers.task_timeout_s > 0, "workers.task_timeout_s", "must be > 0")
    _check(cfg.workers.shard_timeout_factor > 1, "workers.shard_timeout_factor", "must be > 1 (times a shard's "
           "expected time)")
    _check(cfg.workers.setup_timeout_s > 0, "workers.setup_timeout_s", "must be > 0")
    _check(0 < cfg.workers.min_fraction <= 1, "workers.min_fraction", "must be in (0, 1]")
    _check(cfg.profile.share_tolerance > 0, "profile.share_tolerance", "must be > 0")
    _check(not (cfg.label.mode == "replay" and d.temperature > 0), "label.mode",
           "replay is exact only at temperature 0; use exhaustive or auto")
    if cfg.label.continuation == "vllm":  # vLLM decodes replay's greedy g; our engine does everything else
        _check(d.temperature == 0, "label.continuation", f"vllm decodes the target's greedy continuation, which is "
               f"replay's only at T = 0 (decode.temperature={d.temperature:g}: the labels need the sampled one); "
               "use greedy or auto")
        _check(cfg.label.engine == "hf", "label.continuation", "vllm is replay's continuation for our engine's labels "
               "(label.engine=hf); label.engine=vllm decodes every candidate in vLLM: drop one of the two")
        _check(cfg.label.mode != "exhaustive", "label.continuation", "vllm is replay's continuation: "
               "label.mode=exhaustive decodes every candidate itself (use replay or auto)")
    if cfg.label.engine == "vllm":  # vLLM decodes every candidate on its own batching: no replay, no trace
        _check(cfg.label.mode == "auto", "label.mode", "label.engine=vllm decodes every candidate itself: leave "
               "label.mode auto (replay and exhaustive are the hf engine's)")
        _check(d.top_k == 0, "decode.top_k", "vLLM 0.32's sampler fails with top_k under speculative decoding "
               "(topk_topp_sampler: max() of an empty tensor): label.engine=vllm needs decode.top_k=0")
        _check(cfg.vllm.max_num_seqs >= max(pr_c for pr_c in cfg.profile.concurrency), "vllm.max_num_seqs",
               f"must be >= the largest of profile.concurrency {list(cfg.profile.concurrency)}: vLLM times its steps "
               "at each c")
    _check(cfg.vllm.max_num_seqs >= 1, "vllm.max_num_seqs", "must be >= 1")
    _check(0 < cfg.vllm.gpu_memory_utilization <= 1, "vllm.gpu_memory_utilization", "must be in (0, 1]")
    _check(cfg.vllm.cpu_kv_cache_gb > 0, "vllm.cpu_kv_cache_gb", "must be > 0")
    _check(cfg.vllm.check_repeats >= 2, "vllm.check_repeats", "must be >= 2 (a paired interval needs two repeats)")
    _check(cfg.vllm.check_prompts >= 1, "vllm.check_prompts", "must be >= 1")
    _check(0 <= cfg.train.val_fraction < 1, "train.val_fraction", "must be in [0, 1)")
    _check(0 <= cfg.train.calibration_fraction and cfg.train.val_fraction + cfg.train.calibration_fraction < 1,
           "train.calibration_fraction", "must be >= 0 and leave training rows (val_fraction + it < 1)")
    pr = cfg.profile
    _check(len(pr.context_lengths) >= 1 and all(c >= 1 for c in pr.context_lengths), "profile.context_lengths",
           "needs at least one length >= 1")
    _check(pr.steps >= 1, "profile.steps", "must be >= 1")
    _check(1 <= pr.min_repeats <= pr.max_repeats, "profile.min_repeats", "must be in [1, profile.max_repeats]")
    _check(pr.rel_tol > 0, "profile.rel_tol", "must be > 0")
    _check(bool(pr.concurrency) and pr.concurrency[0] == 1 and sorted(set(pr.concurrency)) == list(pr.concurrency),
           "profile.concurrency", "must be ascending distinct concurrencies starting at 1, e.g. [1, 4, 16]")
    _check(pr.load_rounds >= 1, "profile.load_rounds", "must be >= 1")
    ev = cfg.evaluate
    _check(bool(ev.concurrency) and set(ev.concurrency) <= set(pr.concurrency), "evaluate.concurrency",
           f"every c must be in profile.concurrency {list(pr.concurrency)} (its cost model is measured there)")
    _check(ev.load_repeats >= 1, "evaluate.load_repeats", "must be >= 1")
    _check(ev.samples >= 1, "evaluate.samples", "must be >= 1")
    _check(cfg.train.n_layers >= 1, "train.n_layers", "must be >= 1")
    _check(cfg.train.epochs >= 1, "train.epochs", "must be >= 1")
    _check(0 <= cfg.train.dropout < 1, "train.dropout", "must be in [0, 1)")
    _check(cfg.train.num_workers >= 1, "train.num_workers", "must be >= 1")
    _check(cfg.tune.limit >= 1, "tune.limit", "must be >= 1")
    _check(cfg.tune.max_rows is None or cfg.tune.max_rows >= 1, "tune.max_rows", "must be >= 1, or null (all rows)")
    _check(cfg.tune.load_prompts >= 0, "tune.load_prompts", "must be >= 0 (0: no load check)")
    _check(cfg.tune.load_repeats >= 2, "tune.load_repeats", "must be >= 2 (the check decides on a paired interval)")
    _check(cfg.tune.load_max_repeats >= cfg.tune.load_repeats, "tune.load_max_repeats",
           "must be >= tune.load_repeats (the repeats go on from load_repeats up to it)")
    _check(0 < cfg.tune.load_alpha < 0.5, "tune.load_alpha", "must be in (0, 0.5) (two-sided, per look)")
    _check(cfg.tune.load_tie >= 0, "tune.load_tie", "must be >= 0 (a half-width of the log ratio; 0: no tie short "
           "of the cap)")
    _check(-1 < cfg.tune.load_min_gain, "tune.load_min_gain", "must be > -1 (a gain; 0: measured faster than AR)")
    _check(cfg.tune.load_budget_s >= 0, "tune.load_budget_s", "must be >= 0 (seconds; 0: no limit)")
    from pipeline.policy.step_rules import LEARNED, parse_rule

    _check(cfg.train.model != "ridge" or cfg.train.objective == "speed", "train.model",
           f"ridge regresses the speed targets: it needs train.objective=speed (not {cfg.train.objective!r}), or mlp")
    for key, rules in (("tune.rules", cfg.tune.rules), ("train.rules", cfg.train.rules)):
        for i, rule in enumerate(rules):
            try:
                if rule != LEARNED or key == "train.rules":  # a rule action is static: no fitted rule file
                    parse_rule(rule)
            except ValueError as err:
                raise ConfigError(f"config key '{key}[{i}]': {err}") from None
    for section in ("prepare", "evaluate"):
        names = set()
        for i, src in enumerate(getattr(cfg, section).sources):
            key = f"{section}.sources[{i}]"
            _check(src.kind in SOURCE_KINDS, f"{key}.kind", f"{src.kind!r} is not one of {', '.join(SOURCE_KINDS)}")
            _check(src.name not in names, f"{key}.name", f"duplicate source name {src.name!r}")
            names.add(src.name)
            _check(src.limit is None or src.limit >= 1, f"{key}.limit", "must be >= 1")
