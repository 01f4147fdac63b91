"""The memory labelling, the batched serving engine and the policy's training hold, planned from the model configs.

Why: a label batch that runs out of memory is retried prompt by prompt (pipeline.labelling.batched.ShardBatches),
~64x slower, so a label actor sizes its batch before the first failure (:func:`auto_batch_size`). A plan is the
weights plus the largest of the phases the code passes through, each phase the tensors alive at its peak: what one
phase frees before the next allocates does not add up. Each part is named after the code that allocates it.
Measured against peak RSS on CPU and, at Qwen3-8B's shapes, a GPU's peak: benchmarks/results/memory-plan.md.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, Optional, Sequence

import torch
from dflash.model import _draft_value, build_target_layer_ids

# The code's own chunk sizes, restated (decoding sits below labelling and may not import it; a unit test holds them
# equal): greedy.PREFILL_GROUP, runner.HEAD_ROWS, trace.TRACE_MAX_ROWS.
PREFILL_GROUP, HEAD_ROWS, TRACE_MAX_ROWS = 8, 1024, 4096
# greedy.FEATURE_ELEMENTS and vllm_continuation.LOGIT_ELEMENTS: the teacher-forced pass's row chunks
FEATURE_ELEMENTS, LOGIT_ELEMENTS = 1 << 28, 1 << 28
GiB = 2 ** 30


class Shape(namedtuple("Shape", "layers hidden intermediate heads kv_heads head_dim vocab")):
    """What memory depends on in one model's config."""

    @property
    def kv(self) -> int:  # KV cache elements per position, every layer
        return 2 * self.layers * self.kv_heads * self.head_dim


def _read(cfg):
    """A dict read like a config object (dflash's _draft_value reads attributes and ``dflash_config``)."""
    return SimpleNamespace(**cfg) if isinstance(cfg, dict) else cfg


def shape(cfg) -> Shape:
    cfg, heads = _read(cfg), _read(cfg).num_attention_heads
    # head_dim as the engines size their caches (pipeline.decoding.batched.BatchedEngine._cache)
    return Shape(cfg.num_hidden_layers, cfg.hidden_size, getattr(cfg, "intermediate_size", 0) or 0, heads,
                 getattr(cfg, "num_key_value_heads", None) or heads,
                 getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, cfg.vocab_size)


def feature_layers(draft_cfg) -> int:
    """How many target layers the draft reads (features = that many x hidden per position), as DFlashDraftModel
    resolves target_layer_ids."""
    cfg = _read(draft_cfg)
    default = build_target_layer_ids(getattr(cfg, "num_target_layers", 0), cfg.num_hidden_layers)
    return len(_draft_value(cfg, "target_layer_ids", default))


def dtype_bytes(dtype) -> int:
    return torch.empty((), dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).element_size()


def parameter_count(cfg, draft: bool = False) -> int:
    """Parameters of the model a config builds, built on the meta device (no memory; ~0.3 s for an 8B): exact for
    whatever transformers or dflash builds (MoE experts, biases, q/k norms, DFlash2's convolutions and selector)
    with no formula per architecture to keep in step; a tied embedding is one tensor, counted once."""
    import dflash.model
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(cfg, dict):
        d = dict(cfg)
        cfg = dflash.model.DFlashDraftModel.config_class(**d) if draft else \
            AutoConfig.for_model(d.pop("model_type", "qwen3"), **d)
    with torch.device("meta"):
        if draft:  # the class the loader builds (pipeline.decoding.models.load_draft)
            dflash2 = (getattr(cfg, "architectures", None) or []) == ["DFlash2DraftModel"]
            model = (dflash.model.DFlash2DraftModel if dflash2 else dflash.model.DFlashDraftModel)(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared (tied) tensor once


def model_weights(target_config, draft_config, dtype) -> Dict[str, int]:
    return {"target weights": parameter_count(target_config) * dtype_bytes(dtype),
            "draft weights": parameter_count(draft_config, draft=True) * dtype_bytes(dtype)}


def repeated_kv(x: Shape, s: int, gpu: bool) -> int:
    """Bytes per key position of one layer's K and V repeated to every query head: what transformers' sdpa does on
    CUDA when there is a mask (pipeline/labelling/attention.py; on CPU the code's own attention avoids it)."""
    return 2 * x.heads * x.head_dim * s if gpu and x.heads > x.kv_heads else 0


def _largest(parts: Dict[str, int]) -> Dict[str, int]:
    """The largest of parts that are never alive together."""
    return {max(parts, key=parts.get): max(parts.values())}


def _gpu(device) -> bool:
    return str(device).startswith("cuda")


@dataclass
class Plan:
    """Weights plus named phases {phase: {part: bytes}}; the peak is the weights plus the largest phase."""

    what: str
    weights: Dict[str, int]
    phases: Dict[str, Dict[str, int]]

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def work(self) -> int:  # the largest phase, the weights apart
        return sum(self.phases[self.peak_phase].values())

    @property
    def peak(self) -> int:
        return sum(self.weights.values()) + self.work

    def describe(self) -> str:
        """One line per part of the peak phase, in GiB; then every phase's total."""
        lines = [f"{self.what}: peak {self.peak / GiB:.2f} GiB (in phase {self.peak_phase})"]
        lines += [f"  {name:<38} {b / GiB:8.2f} GiB" for name, b in self.weights.items()]
        lines += [f"  {name:<38} {b / GiB:8.2f} GiB" for name, b in self.phases[self.peak_phase].items() if b]
        lines.append("  phases: " + ", ".join(f"{p} {sum(v.values()) / GiB:.2f}" for p, v in self.phases.items()))
        return "\n".join(lines)


class LabelMemory:
    """The plan of one batched replay labelling call (pipeline.labelling.batched.batched_replay_label_prompts) at
    any batch size, for prompts of up to ``prompt_tokens`` tokens (a batch is padded to its longest) and every
    prompt running to ``max_new_tokens`` (the worst case: a stop token only frees positions). ``device`` "cuda"
    adds what transformers' sdpa does there with a mask (K/V repeated to every query head, one layer at a time);
    "cpu" adds the trace's Python lists. ``weights`` {name: bytes} (e.g. the loaded models' nbytes) skips building
    the models on the meta device. The phases, in the order the call passes them: ``prefill`` (the last prefill
    group's forward, greedy._grouped_prefill, beside the batch's prompt-KV copy being filled in), ``handoff`` (that
    copy and the static cache both alive, until ``del keys``), ``decode``, ``features`` (the decode's end: the
    features' step list, its torch.cat and the right-aligned gather: three copies), ``draft kv`` (DraftRunner's
    context keys), ``walks`` and ``trace`` (a BlockKeys buffer beside the largest of a rebuild's old buffer, the
    attention and the lm_head's logits chunk)."""

    def __init__(self, target_config, draft_config, dtype, prompt_tokens: int, max_new_tokens: int,
                 candidates: Sequence[int], trace_block_size: Optional[int] = None, device: str = "cuda",
                 weights: Optional[Dict[str, int]] = None, vllm_bytes: Optional[int] = None):
        # vllm_bytes: label.continuation=vllm: vLLM's engine beside ours on the device (on a GPU
        # vllm.gpu_memory_utilization of it, which vLLM takes whole at start-up; on a CPU its weights and KV cache),
        # held for good like the weights; g then comes from vLLM and one teacher-forced pass replaces our decode's
        # phases (pipeline.labelling.vllm_continuation.teacher_forced)
        self.vllm_bytes = vllm_bytes
        self.t, self.d, self.features = shape(target_config), shape(draft_config), feature_layers(draft_config)
        self.s, self.dtype, self.gpu = dtype_bytes(dtype), str(dtype).replace("torch.", ""), _gpu(device)
        self.n, self.m, self.candidates = int(prompt_tokens), int(max_new_tokens), list(candidates)
        self.trace_b = trace_block_size
        self.weights = weights if weights is not None else model_weights(target_config, draft_config, dtype)

    def at(self, batch: int) -> Plan:
        t, d, s, P, n, m = self.t, self.d, self.s, int(batch), self.n, self.m
        W, L, G = n + m, n + m - 1, min(PREFILL_GROUP, P)  # static cache width; context positions; prefill group
        F = self.features * t.hidden * s  # one position's draft features
        kv_t, kv_d = t.kv * s, d.kv * s
        logits = P * t.vocab * s  # the prefill's last-position logits, kept to the end
        rep = lambda x: repeated_kv(x, s, self.gpu)  # noqa: E731
        hidden_all = (t.layers + 1) * t.hidden * s  # output_hidden_states: every layer's hidden state
        q_walk = sum(min(b, m) for b in self.candidates)  # query rows per prompt in the first walks forward
        # the draft's context keys: every context position and the throw-away block's (draft.context_keys)
        kept = {"prefill logits": logits, "draft features (context)": P * L * F, "draft KV": P * (L + 1) * kv_d}
        phases = {
            "prefill": {"prefill logits": logits, "prompt KV copy": P * n * kv_t, "prompt features": P * n * F,
                        "prefill group forward": G * n * (kv_t + hidden_all + F + 3 * t.intermediate * s
                                                          + rep(t))},
            "handoff": {"prefill logits": logits, "prompt KV copy": P * n * kv_t,
                        "target KV (static cache)": P * W * kv_t, "prompt features": P * n * F},
            "decode": {"prefill logits": logits, "target KV (static cache)": P * W * kv_t,
                       "draft features (step list)": P * L * F,
                       "decode step": P * (hidden_all + t.vocab * s + W * rep(t))},
            "features": {"prefill logits": logits, "target KV (static cache)": P * W * kv_t,
                         "draft features x3 (list, cat, gather)": 3 * P * L * F},
            "draft kv": {**kept, "draft fc + norm": P * L * d.hidden * (2 * s + 8),
                         "draft layer transients": P * L * d.kv // d.layers * s * 3},
            # one BlockKeys buffer, plus the largest of what comes and goes beside it: the old buffer while a
            # rebuild allocates the new one, a forward's attention, the lm_head's logits after it
            "walks": {**kept, "BlockKeys": P * (L + 2 * q_walk) * kv_d, **_largest({
                "BlockKeys rebuild (old copy)": P * (L + 2 * q_walk) * kv_d,
                "attention (one layer)": P * (L + q_walk) * rep(d),
                "lm_head logits": min(HEAD_ROWS, P * len(self.candidates)) * t.vocab * s})},
        }
        if self.vllm_bytes is not None:
            # vllm_continuation.teacher_forced: rows chunked under FEATURE_ELEMENTS and LOGIT_ELEMENTS; a chunk's
            # forward (every layer's hidden state, the MLP, the attention) and its logits over g's positions; the
            # context features of the rows done (list, then cat) and the prefill logits kept
            r = max(1, min(P, min(FEATURE_ELEMENTS // max(1, (t.layers + 1) * W * t.hidden),
                                  LOGIT_ELEMENTS // max(1, m * t.vocab))))
            for name in ("prefill", "handoff", "decode", "features"):
                del phases[name]
            phases = {"teacher-forced": {
                "prefill logits": logits, "draft features x2 (list, cat)": 2 * P * L * F,
                "teacher-forced forward": r * W * (hidden_all + F + 3 * t.intermediate * s + rep(t)),
                "teacher-forced logits over g": r * m * t.vocab * s}, **phases}
        if self.trace_b:
            b = self.trace_b
            per = max(1, TRACE_MAX_ROWS // (b * P))  # starts per prompt per trace forward (trace.record_traces)
            group = min(P, max(1, TRACE_MAX_ROWS // (b * per)))
            # the first forward's blocks: start j of g (j < m - 1) drafts min(b, m - j) rows
            sizes = [min(b, m - j) for j in range(min(per, m - 1))]
            q, head = sum(sizes), min(HEAD_ROWS, group * sum(v - 1 for v in sizes))
            phases["trace"] = {
                **kept, "BlockKeys": group * (L + 2 * q) * kv_d,
                # the confidences as Python floats (24 bytes + an 8-byte list slot), on the host
                "trace lists (host)": 0 if self.gpu else 32 * P * m * (b - 1), **_largest({
                    "BlockKeys rebuild (old copy)": P * (L + 2 * q_walk) * kv_d,
                    "attention (one layer)": group * (L + q) * rep(d),
                    # logits, their float copy (bf16/fp16 only) and softmax's float output
                    "lm_head logits + softmax": head * t.vocab * (s + 4 + (4 if s < 4 else 0))})}
        weights = dict(self.weights)
        if self.vllm_bytes is not None:
            weights["vLLM engine (continuation)"] = int(self.vllm_bytes)
        return Plan(f"label batch {P}, prompts <= {n} + {m} new tokens, {self.dtype} on "
                    f"{'cuda' if self.gpu else 'cpu'}" + (", g from vLLM" if self.vllm_bytes is not None else ""),
                    weights, phases)


def engine_plan(target_config, draft_config, dtype, slots: int, prompt_tokens: int, max_new_tokens: int,
                block_size: int, methods: int = 1, device: str = "cuda",
                weights: Optional[Dict[str, int]] = None) -> Plan:
    """The batched serving engine (pipeline.decoding.batched) at ``slots`` requests, ``methods`` engines in lockstep
    (evaluate at load runs every distinct method's engine together, each with its own caches): per engine the
    target's and the draft's SlotCache [slots, kv_heads, width, head_dim] per layer, width = longest prompt +
    max_new_tokens + 1; then the larger of a full admission's prefill (slots prompts in one packed forward) and a
    step. An engine's prefill features stay alive (its rows' contexts are views of them) until its first step."""
    t, d, s = shape(target_config), shape(draft_config), dtype_bytes(dtype)
    F = feature_layers(draft_config) * t.hidden * s
    width, Q, R = prompt_tokens + max_new_tokens + 1, slots * prompt_tokens, slots
    caches = {"target KV (slot caches)": methods * R * width * t.kv * s,
              "draft KV (slot caches)": methods * R * width * d.kv * s,
              "prefill features (engines waiting)": (methods - 1) * Q * F}
    gpu = _gpu(device)
    # attention: each layer gathers its rows' whole slot K/V (index_select). On CUDA a mask with enable_gqa takes
    # SDPA's math kernel (torch's docs: GQA runs in flash and math only, flash takes no mask), which keeps its
    # intermediates in float32 for bf16 inputs: the scores and their softmax, K and V repeated to every head. Read
    # from the docs, not measured (no GPU here).
    n = prompt_tokens
    scores = R * n * t.heads * (2 * n + 2 * t.head_dim) * 4 if gpu else 0
    prefill = {**caches, "prefill hidden states": Q * (t.layers + 1) * t.hidden * s, "prefill features": Q * F,
               "prefill MLP": 3 * Q * t.intermediate * s,
               "attention (one layer)": R * width * t.kv // t.layers * s + scores,
               "prefill logits": R * t.vocab * s}
    # a step: the prefill's features and their torch.cat into the draft's context; the larger of the draft's
    # logits (dflash's compute_logits multiplies them by output_multiplier: a second copy) and the verify's; one
    # layer's slot K/V gathered (the draft's then concatenated with its block: two copies)
    step = {**caches, "prefill features (first step)": 2 * Q * F,
            "draft context fc + norm": Q * d.hidden * (2 * s + 8),
            "draft logits x2 or verify logits": R * max(2 * (block_size - 1), block_size) * t.vocab * s,
            "attention (one layer)": R * width * max(t.kv // t.layers, 2 * d.kv // max(1, d.layers)) * s}
    weights = weights if weights is not None else model_weights(target_config, draft_config, dtype)
    return Plan(f"batched engine, {methods} x {slots} slots, prompts <= {prompt_tokens} + {max_new_tokens} new, "
                f"{str(dtype).replace('torch.', '')} on {'cuda' if gpu else 'cpu'}", dict(weights),
                {"prefill": prefill, "step": step})


def policy_plan(vocab: int, actions: int, hidden: int = 2048, n_layers: int = 2, batch_size: int = 32,
                device: str = "cuda") -> Plan:
    """Training the paper's MLP (pipeline.policy.blocksize.BlockSizeMLP, Adam, float32): parameters, gradients,
    Adam's moments, a batch (its logits rows twice: np.stack, then astype) and Adam's denominator sqrt(v) / c: two
    copies of a parameter at once on CPU (one tensor at a time; the first layer is nearly all of them), one copy of
    all of them on CUDA (the foreach path divides in place)."""
    params = vocab * hidden + hidden + (n_layers - 1) * (hidden * hidden + hidden) + hidden * actions + actions
    return Plan(f"policy MLP {vocab} -> {hidden} x {n_layers} -> {actions}, batch {batch_size}, float32",
                {"policy parameters": 4 * params},
                {"step": {"gradients": 4 * params, "Adam moments": 8 * params,
                          "Adam step transients": (1 if _gpu(device) else 2) * 4 * params,
                          "batch logits x2": 2 * batch_size * vocab * 4,
                          "activations (linear, ReLU, dropout)": 3 * batch_size * hidden * n_layers * 4}})


@dataclass(frozen=True)
class BatchFit:
    """auto_batch_size's answer and its arithmetic."""

    batch: int
    plan: Plan  # at that batch
    budget: int
    next_peak: Optional[int]  # the plan's peak one prompt more (None at ``most``)

    def __int__(self) -> int:
        return self.batch

    def describe(self) -> str:
        more = " (the most asked for)" if self.next_peak is None else \
            f"; {self.batch + 1} would need {self.next_peak / GiB:.2f} GiB"
        fits = "" if self.plan.peak <= self.budget else " (does NOT fit: 1 is the least)"
        return (f"batch {self.batch}{fits}: planned peak {self.plan.peak / GiB:.2f} GiB of a "
                f"{self.budget / GiB:.2f} GiB budget{more}")


def auto_batch_size(memory: LabelMemory, budget_bytes: int, most: int = 1024) -> BatchFit:
    """The largest label batch in 1..most whose planned peak fits ``budget_bytes``, by bisection (the peak grows with
    the batch); at least 1, which :meth:`BatchFit.describe` says when even 1 does not fit."""
    lo, hi = 1, int(most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if memory.at(mid).peak <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return BatchFit(lo, memory.at(lo), int(budget_bytes), memory.at(lo + 1).peak if lo < most else None)


def device_budget(device, fraction: float = 0.9, memory_gb: Optional[float] = None) -> int:
    """The bytes a plan may use: ``memory_gb`` GiB when given, else ``fraction`` of the GPU's total memory or, on
    CPU, of MemAvailable now. The plan counts the weights itself: on CPU, ask before the models are loaded."""
    if memory_gb is not None:
        return int(memory_gb * GiB)
    if _gpu(device):
        return int(fraction * torch.cuda.get_device_properties(torch.device(device)).total_memory)
    with open("/proc/meminfo") as f:
        return int(fraction * 1024 * next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:")))
