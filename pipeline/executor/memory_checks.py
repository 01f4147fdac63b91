"""The memory plan (pipeline.decoding.memory) put to the stages' use: what each decoding stage's worker checks in its
preflight, the batch ``label.batch_size: auto`` fills, and how many engines evaluate's pass at load runs at once.

Every budget is :func:`budget`: ``label.memory_gb`` when set, else 90 % of the device's memory (a GPU's total: the
plan counts the weights itself; on CPU the host's available memory). The prompts' length is the longest the stage
will decode (``stages.decoding.DecodingStage.longest_prompt``: what prepare recorded in the prompts' manifest, one
small read in the timed preflight, not one of every shard), else ``prepare.max_prompt_tokens``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

GiB = 1024 ** 3
FRACTION = 0.9  # of the device's memory a plan may fill: the rest is the allocator's slack and the runtime's own


def model_configs(cfg):
    """(target config, draft config), read without a weight."""
    from transformers import AutoConfig

    from pipeline.decoding.models import draft_config, locate

    m = cfg.model
    where = locate(m.target, m.target_revision, "model.target")
    target = AutoConfig.from_pretrained(where.path, revision=where.revision, trust_remote_code=m.trust_remote_code)
    return target, draft_config(m)


def budget(cfg, facts: Dict[str, Any]) -> Optional[int]:
    """Bytes a worker's plan may use on the device ``facts`` describes (pipeline.executor.preflight.device_facts);
    None when the device's memory is unknown."""
    if cfg.label.memory_gb is not None:
        return int(cfg.label.memory_gb * GiB)
    have = facts.get("memory_total") if facts.get("device_name") != "cpu" else facts.get("memory_free")
    return int(FRACTION * have) if have else None


def label_plan(stage, dtype, device: str):
    """The label stage's plan: batched replay (pipeline.decoding.memory.LabelMemory) in replay mode, the batch-1
    engine's in exhaustive mode."""
    from pipeline.decoding.memory import LabelMemory, engine_plan

    target, draft = model_configs(stage.cfg)
    n, m = stage.longest_prompt, stage.cfg.decode.max_new_tokens
    if stage.mode != "replay":
        return None, engine_plan(target, draft, dtype, 1, n, m, stage.largest_block, device=device)
    return LabelMemory(target, draft, dtype, n, m, stage.candidates, stage.trace_block_size, device=device), None


def label_check(stage, facts: Dict[str, Any], dtype) -> Dict[str, Any]:
    """In a label worker's preflight: the plan at label.batch_size (or the batch ``auto`` would take) against the
    budget; ``key`` names what to change."""
    from pipeline.decoding.memory import auto_batch_size

    device = "cpu" if facts.get("device_name") == "cpu" else "cuda"
    memory, single = label_plan(stage, dtype, device)
    have, asked = budget(stage.cfg, facts), stage.cfg.label.batch_size
    if single is not None:
        plan, batch = single, 1
    elif asked == "auto" and have:
        fit = auto_batch_size(memory, have)
        plan, batch = fit.plan, fit.batch
    else:
        plan, batch = memory.at(1 if asked == "auto" else int(asked)), asked
    most = auto_batch_size(memory, have).batch if memory is not None and have else None
    detail = (f"label.batch_size={asked} plans {plan.peak / GiB:.1f} GiB ({plan.what}; peak in its "
              f"{plan.peak_phase} phase)"
              + (f" and the budget is {have / GiB:.1f} GiB" if have else "")
              + (f": set label.batch_size=auto (it would take {most}) or lower it" if most else ""))
    return {"need": plan.peak, "have": have, "key": "label.batch_size", "detail": detail, "batch": batch,
            "plan": plan.describe()}


def vllm_check(stage, facts: Dict[str, Any], dtype) -> Dict[str, Any]:
    """In a label worker's preflight with label.engine=vllm: vLLM sizes its own memory, so what it will hold is its
    setting against the budget: on a GPU vllm.gpu_memory_utilization of the device; on a CPU the models' weights
    (the batch-1 engine's plan holds them) and vllm.cpu_kv_cache_gb of KV cache."""
    from pipeline.decoding.memory import engine_plan

    v, have = stage.cfg.vllm, budget(stage.cfg, facts)
    if facts.get("device_name") != "cpu" and facts.get("memory_total"):
        need, what = int(v.gpu_memory_utilization * facts["memory_total"]), \
            f"vllm.gpu_memory_utilization={v.gpu_memory_utilization:g} of the GPU"
    else:
        target, draft = model_configs(stage.cfg)
        weights = sum(engine_plan(target, draft, dtype, 1, 1, 1, stage.largest_block, device="cpu").weights.values())
        need, what = int(weights + v.cpu_kv_cache_gb * GiB), \
            f"the weights and vllm.cpu_kv_cache_gb={v.cpu_kv_cache_gb:g} GiB of KV cache"
    return {"need": need, "have": have, "key": "vllm.gpu_memory_utilization" if "GPU" in what else
            "vllm.cpu_kv_cache_gb", "detail": f"vLLM holds {need / GiB:.1f} GiB ({what})"
            + (f" and the budget is {have / GiB:.1f} GiB" if have else ""), "batch": stage.label_batch_size,
            "plan": f"vLLM: {what}"}


def engine_check(stage, facts: Dict[str, Any], dtype, slots: int = 1, methods: int = 1) -> Dict[str, Any]:
    """In a tune or evaluate worker's preflight: one batch-1 engine (the per-prompt decodes) against the budget."""
    from pipeline.decoding.memory import engine_plan

    device = "cpu" if facts.get("device_name") == "cpu" else "cuda"
    target, draft = model_configs(stage.cfg)
    n, m = stage.longest_prompt, stage.cfg.decode.max_new_tokens
    plan = engine_plan(target, draft, dtype, slots, n, m, stage.largest_block, methods=methods, device=device)
    have = budget(stage.cfg, facts)
    return {"need": plan.peak, "have": have, "key": "decode.max_new_tokens",
            "detail": f"one engine plans {plan.peak / GiB:.1f} GiB for prompts up to {n} tokens + {m} new"
                      + (f", over the budget of {have / GiB:.1f} GiB" if have else ""), "plan": plan.describe()}


def engines_at_once(cfg, models, prompts, c: int, methods: int, block_size: int) -> int:
    """How many engines evaluate's pass at load runs in lockstep: every method's when their slot caches fit the
    budget (the default, by far), else as many as fit, at least one (the methods then run in turn)."""
    from pipeline.decoding.memory import engine_plan
    from pipeline.executor.preflight import device_facts

    device = models.device.type
    facts = device_facts(device)
    have = budget(cfg, facts)
    if not have:
        return methods
    n = max(len(p) for p in prompts)
    weights = {"models": sum(p.numel() * p.element_size() for mod in (models.target, models.draft)
                             for p in mod.parameters())}
    k = methods
    while k > 1 and engine_plan(models.target.config, models.draft.config, models.dtype, c, n,
                                cfg.decode.max_new_tokens, block_size, methods=k, device=device,
                                weights=weights).peak > have:
        k -= 1
    return k
