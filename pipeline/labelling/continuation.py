"""The target's greedy continuation g for labelling, decoded one token a step or speculatively, whichever is cheaper.

Replay (pipeline.labelling.batched) needs per prompt g and the target's context features along prompt + g. At T = 0
any exact decode gives the same g: one-token batched greedy (:func:`pipeline.labelling.greedy.greedy_continuations`)
takes ``max_new_tokens`` target steps, a speculative decode at the trained B about 1 / tau(B) as many, each dearer.
Where a step is launch overhead (a GPU at small batch, issue #45: 36 ms a step against a ~4 ms bound at 8B) the
speculative one saves most of labelling's time; where a step is work (this 2-core CPU at batch 64) it may not.

So the choice is the cost profile's, per batch (:class:`ContinuationChoice`): predicted seconds of each way at the
batch's rows, from the load grid (pipeline.policy.load_cost.LoadCost), and tau(B) from the labels this worker has
already made (replay measures tau at B for every prompt, so the first batch, without one, decodes greedily). The
prediction leaves out the ragged tail (rows that finish early leave smaller steps) on both sides; both figures and
the choice are logged and counted in the label summary.

A third way, ``vllm`` (pipeline.labelling.vllm_continuation): vLLM decodes the continuations of a whole shard, then a
teacher-forced target pass per batch. It is chosen per shard, before its batches: forced by ``label.continuation:
vllm``, or under auto where vLLM is installed, its memory fits beside ours, and its measured costs (``vllm_costs``:
seconds per decode step of c requests timed in vLLM at the worker's start, and the teacher-forced pass's seconds per
token, pipeline.labelling.vllm_continuation.probe_costs) predict it cheaper than the cheaper of the other two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from pipeline.runtime.checks import CONTINUATIONS


@torch.inference_mode()
def speculative_continuations(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int):
    """What :func:`greedy_continuations` returns with ``layer_ids`` (new tokens per prompt; context [P, L, F]
    right-padded: the features of positions 0 .. len(prompt + g) - 2; the raw last-prompt-position logits [P, V];
    the prefill's seconds), from one batched speculative decode of every prompt at once at ``block_size``
    (pipeline.decoding.batched, exact at T = 0: the same g as the batch-1 engine, and so as greedy decoding)."""
    from pipeline.decoding.batched import BatchedEngine

    prompts = [list(p) for p in prompts]
    logits: Dict[int, torch.Tensor] = {}

    def choose(i, first_logits, hidden):
        logits[i] = first_logits
        return int(block_size), None

    run = BatchedEngine(engine, keep_context=True).run(prompts, len(prompts), max_new_tokens, choose)
    news = [r.decode.new_ids.tolist() for r in run.requests]
    # Each row's features cover positions 0 .. len(prompt + g) - 2 already: right-padded with zeros (never read).
    context = torch.nn.utils.rnn.pad_sequence([r.decode.context[0] for r in run.requests], batch_first=True)
    prefill = sum(s.verify_seconds for s in run.steps if s.kind == "prefill")
    return news, context, torch.stack([logits[i] for i in range(len(prompts))]), prefill


@dataclass
class ContinuationChoice:
    """Per batch: greedy or speculative at B, by the cost profile's predicted seconds (``mode`` auto), or forced."""

    mode: str
    block_size: int
    profile: object = None  # pipeline.policy.cost.CostProfile (the worker's own); None: greedy under auto
    tau_sum: float = 0.0
    tau_rows: int = 0
    last: Optional[dict] = None  # the last batch's choice and its two predictions
    records: List[dict] = field(default_factory=list)  # every batch's, since the last drained()
    # vLLM's measured costs under auto ({"step": {c: seconds a decode step of c requests}, "teacher_per_token":
    # seconds}); None: vllm is not among auto's ways (mode vllm needs none)
    vllm_costs: Optional[dict] = None

    def __post_init__(self):
        if self.mode not in CONTINUATIONS:
            raise ValueError(f"label.continuation must be one of {CONTINUATIONS}, got {self.mode!r}")
        self._load = None
        if self.profile is not None:
            from pipeline.policy.load_cost import LoadCost, has_ar

            load = LoadCost.from_profile(self.profile)
            self._load = load if has_ar(load) else None

    def predict(self, rows: int, max_new_tokens: int) -> Tuple[Optional[float], Optional[float]]:
        """(greedy seconds, speculative seconds) for a batch of ``rows`` prompts; None where it cannot be said (no
        profile with b = 1 under load, or no tau(B) measured yet)."""
        if self._load is None:
            return None, None
        greedy = max_new_tokens * self._load.cost(1, rows)
        if not self.tau_rows:
            return greedy, None
        tau = self.tau_sum / self.tau_rows
        return greedy, math.ceil(max_new_tokens / tau) * self._load.cost(self.block_size, rows)

    def predict_vllm(self, rows: int, max_new_tokens: int, prompt_tokens: int) -> Optional[float]:
        """Predicted seconds of vLLM's continuation and the teacher-forced pass for ``rows`` prompts of
        ``prompt_tokens`` (None without vLLM's costs): max_new_tokens steps at the measured c nearest above
        ``rows`` (the largest measured beyond it), plus the pass's seconds per token over rows x (prompt + g)."""
        if not self.vllm_costs:
            return None
        step = {int(c): float(s) for c, s in self.vllm_costs["step"].items()}
        c = min((c for c in step if c >= rows), default=max(step))
        return (max_new_tokens * step[c] * max(1.0, rows / c)
                + float(self.vllm_costs["teacher_per_token"]) * rows * (prompt_tokens + max_new_tokens))

    def use_vllm(self, rows: int, max_new_tokens: int, prompt_tokens: int) -> bool:
        """Per shard: vLLM's continuation (mode vllm; under auto, where its prediction beats the better of greedy and
        speculative at ``rows`` per batch). Logged by the caller with :meth:`describe_vllm`."""
        if self.mode == "vllm":
            return True
        if self.mode != "auto":
            return False
        v = self.predict_vllm(rows, max_new_tokens, prompt_tokens)
        greedy, spec = self.predict(rows, max_new_tokens)
        others = [x for x in (greedy, spec) if x is not None]
        self.vllm_last = {"rows": rows, "predicted_vllm_seconds": v, "predicted_greedy_seconds": greedy,
                          "predicted_speculative_seconds": spec}
        return v is not None and bool(others) and v < min(others)

    def describe_vllm(self) -> str:
        x = getattr(self, "vllm_last", None) or {}
        fmt = (lambda v: "n/a" if v is None else f"{v:.2f} s")
        return (f"continuation at {x.get('rows')} rows a batch: predicted vllm {fmt(x.get('predicted_vllm_seconds'))}, "
                f"greedy {fmt(x.get('predicted_greedy_seconds'))}, speculative "
                f"{fmt(x.get('predicted_speculative_seconds'))} (mode {self.mode})")

    def add(self, record: dict) -> None:
        """A batch labelled along vLLM's continuation (vllm_continuation.vllm_replay_label_prompts' record)."""
        self.last = record
        self.records.append(record)

    def choose(self, rows: int, max_new_tokens: int) -> str:
        greedy, spec = self.predict(rows, max_new_tokens)
        if self.mode not in ("auto", "vllm"):
            way = self.mode
        else:
            way = "speculative" if greedy is not None and spec is not None and spec < greedy else "greedy"
        self.last = {"continuation": way, "rows": rows, "predicted_greedy_seconds": greedy,
                     "predicted_speculative_seconds": spec, "block_size": self.block_size,
                     "tau": self.tau_sum / self.tau_rows if self.tau_rows else None}
        self.records.append(self.last)
        return way

    def observe(self, taus_at_b: List[float]) -> None:
        """tau(B) of the prompts just labelled (replay measures it for every prompt)."""
        self.tau_sum += float(sum(taus_at_b))
        self.tau_rows += len(taus_at_b)

    def drained(self) -> List[dict]:
        """Every batch's choice and predictions since the last call (a shard's: its metadata ``continuations``)."""
        out, self.records = self.records, []
        return out

    @staticmethod
    def counts(records: List[dict]) -> Dict[str, int]:
        """Batches per way among ``records``, as the flat counts the label summary sums."""
        out = {f"continuation_{w}": sum(r["continuation"] == w for r in records)
               for w in ("greedy", "speculative", "vllm")}
        # prompts whose vLLM continuation was not the target's greedy one, labelled by greedy instead
        out["continuation_vllm_fallback"] = sum(int(r.get("fallback", 0)) for r in records)
        return out

    def describe(self) -> str:
        x = self.last or {}
        fmt = (lambda v: "n/a" if v is None else f"{v:.2f} s")
        return (f"continuation {x.get('continuation')} at {x.get('rows')} rows (predicted greedy "
                f"{fmt(x.get('predicted_greedy_seconds'))}, speculative b={self.block_size} "
                f"{fmt(x.get('predicted_speculative_seconds'))}, mode {self.mode})")
