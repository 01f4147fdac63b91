"""Batched replay labelling (T = 0): the labels of a whole batch of prompts from three batched passes.

Batch-1 replay (pipeline.labelling.replay) needs per prompt only the target's greedy continuation g and the
target's context features along prompt + g; the rest is draft work. So a label actor does both for a batch at once:

1. **g and the features**, by one batched greedy decode of the target that reads the draft's features from its
   own forwards (pipeline.labelling.greedy);
2. **the draft's walks**, lockstep AND batched across prompts (pipeline.labelling.walks): each round ONE draft
   forward proposes for the current start of every candidate of every prompt still running, a row of blocks per
   prompt (pipeline.labelling.runner, reading only the proposal rows a walk reads);
3. **the per-step trace** at b_max, by the same runner at every start of every g (pipeline.labelling.trace), reading
   every proposal row: what pipeline.policy.simulate needs to replay any verify rule offline.

Every candidate, b = B included, is replayed by the draft: there is no reference speculative decode.

Agreement. The arithmetic is the target's and the draft's own; only the shapes of the matrix products differ from
the batch-1 engine (padding, batch rows, features from one-token decode steps instead of verify blocks). A target
argmax that is a float near-tie can therefore resolve differently and change g (and so tau), and likewise a draft
near-tie can change one proposal. ``benchmarks/label_agreement.py`` measures how often.

Seconds (the ``decode_seconds`` / ``prefill_seconds`` columns): the batch's prefill, generation and draft replay
are shared equally by its prompts; a prompt's share of the batched prefill is its ``prefill_seconds``, its share of
the rest is split equally over its candidates (so a row's prefill + decode seconds sum to its share of the batch).
The trace's pass is not in them: its equal share per prompt is ``trace_seconds``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch

from pipeline.labelling.continuation import speculative_continuations
from pipeline.labelling.greedy import greedy_continuations
from pipeline.labelling.labels import PromptLabels, assemble_labels
from pipeline.labelling.runner import DraftRunner
from pipeline.labelling.support import require_replayable
from pipeline.labelling.trace import record_traces
from pipeline.labelling.walks import lockstep_walks


def _as_list(ids) -> List[int]:
    if isinstance(ids, torch.Tensor):
        return [int(t) for t in ids.reshape(-1).tolist()]
    return [int(t) for t in ids]


def length_sorted_chunks(lengths: Sequence[int], batch_size: int) -> List[List[int]]:
    """Indices in chunks of batch_size, by ascending length: prompts of similar length share a batch, so that
    left padding wastes little. Deterministic (ties by index), so a rerun batches a shard the same way."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def batched_replay_label_prompts(engine, prompts: Sequence, candidates: Sequence[int], max_new_tokens: int,
                                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                                 step_cost: Optional[Dict[int, float]] = None, pad_token_id: int = 0,
                                 trace_block_size: Optional[int] = None,
                                 continuation_block_size: Optional[int] = None) -> List[PromptLabels]:
    """replay_label_prompt for a batch of prompts (token id lists or [1, n] tensors): one PromptLabels per prompt,
    in order, with the same fields, the trace at ``trace_block_size`` included (pipeline.labelling.trace: one more
    draft pass, every start of every prompt, batched like the walks). Raises ValueError before any work at T > 0
    or for a draft replay does not model; any error inside the batch fails the whole batch (the caller retries its
    prompts alone). ``continuation_block_size``: g from a batched speculative decode at that b instead of one-token
    greedy (pipeline.labelling.continuation; the same g at T = 0)."""
    if temperature > 0:
        raise ValueError("replay labelling is exact only at temperature 0; use exhaustive mode")
    require_replayable(engine.draft)
    prompts = [_as_list(p) for p in prompts]
    if not prompts:
        return []
    if min(len(p) for p in prompts) < 1:
        raise ValueError("every prompt needs at least one token")
    t0 = engine.now()
    # g, the draft's context features and the prefill logits from one batched decode.
    if continuation_block_size:
        news, context, logits, prefill_seconds = speculative_continuations(engine, prompts, max_new_tokens,
                                                                           continuation_block_size)
    else:
        news, context, logits, prefill_seconds = greedy_continuations(
            engine.target, prompts, max_new_tokens, engine.stop_token_ids, pad_token_id,
            layer_ids=engine.draft.target_layer_ids, clock=engine.now)
    return replay_along(engine, prompts, news, context, logits, candidates, max_new_tokens, t0, prefill_seconds,
                        step_cost, trace_block_size)


def replay_along(engine, prompts: List[List[int]], news: List[List[int]], context: torch.Tensor,
                 logits: torch.Tensor, candidates: Sequence[int], max_new_tokens: int, t0: float,
                 prefill_seconds: float, step_cost: Optional[Dict[int, float]] = None,
                 trace_block_size: Optional[int] = None) -> List[PromptLabels]:
    """Steps 2 and 3 for a batch whose g (``news``), context features [P, L, F] and prefill logits [P, V] are
    known, however they were decoded (our greedy or speculative decode, or vLLM's continuation with a teacher-forced
    pass: pipeline.labelling.vllm_continuation): every candidate's walks, the trace and the rows. ``t0``: when the
    batch began (engine.now()); ``prefill_seconds`` of it go to the rows' prefill share, the rest until the walks
    end to their decode share."""
    P = len(prompts)
    gs = [p + c for p, c in zip(prompts, news)]
    runner = DraftRunner(engine.draft, engine.target, gs, context)
    walks = lockstep_walks(gs, [len(p) for p in prompts], max_new_tokens, list(candidates), runner.propose,
                           engine.stop_token_ids)
    t3 = engine.now()
    ns = [len(p) for p in prompts]
    traces = record_traces(runner, ns, max_new_tokens, trace_block_size, engine.stop_token_ids) \
        if trace_block_size else [None] * P
    trace_share = (engine.now() - t3) / P  # kept out of decode_seconds: no candidate's decode pays for it
    prefill_share = prefill_seconds / P
    decode_share = (t3 - t0 - prefill_seconds) / P / max(1, len(candidates))
    out = []
    for p in range(P):
        per_b = {b: {"committed": walks[p][b], "new_tokens": len(news[p]), "seconds": decode_share}
                 for b in candidates}
        state = SimpleNamespace(logits=logits[p], prefill_seconds=prefill_share)
        out.append(assemble_labels(state, candidates, per_b, step_cost, traces[p], trace_share))
    return out


class ShardBatches:
    """A label shard's prompts labelled in length-sorted batches, handed out row by row in the shard's order.

    The label stage's per-row loop (stages.decoding.DecodingStage.each_prompt) asks for row 0, 1, 2, ...; the
    first request for a row labels its whole batch. A batch that runs out of memory is halved until it fits (down to
    one prompt); one that raises otherwise is retried prompt by prompt, so that one bad prompt costs only itself:
    its own error is raised for its row alone, which each_prompt turns into a reject (pipeline.executor.failures),
    and its batch-mates are labelled.
    """

    def __init__(self, prompt_ids: Sequence[str], input_ids: Sequence[Sequence[int]], batch_size: int,
                 label_batch, with_rows: bool = False, alone=(), skip=()):
        self.prompt_ids = list(prompt_ids)
        self.input_ids = [list(x) for x in input_ids]
        # [input ids, ...] -> [PromptLabels, ...]; with_rows: label_batch(ids, the shard rows they are) (per-row seeds)
        self.label_batch = label_batch
        self.with_rows = with_rows
        # ``alone``: prompts in a batch that broke a device (the pool's ShardTask.alone), each its own batch here, so
        # that a sticky error names its one prompt; ``skip``: prompts not decoded at all (ShardTask.refused: each_prompt
        # rejects them without asking for them)
        alone, self.skip = set(alone), set(skip)
        rest = [i for i, p in enumerate(self.prompt_ids) if p not in alone and p not in self.skip]
        self.chunks = [[rest[j] for j in c] for c in length_sorted_chunks([len(self.input_ids[i]) for i in rest],
                                                                        batch_size)]
        self.chunks += [[i] for i, p in enumerate(self.prompt_ids) if p in alone and p not in self.skip]
        self.chunk_of = {i: c for c, chunk in enumerate(self.chunks) for i in chunk}
        self.results: Dict[int, object] = {}
        self.next_row = 0
        # batches run, how many of them failed (and how many of those for memory), prompts then retried alone
        self.batches = self.failed = self.out_of_memory = self.retried = 0

    def __call__(self, rec) -> PromptLabels:
        while self.next_row < len(self.prompt_ids) and self.prompt_ids[self.next_row] in self.skip:
            self.next_row += 1
        i = self.next_row
        if i >= len(self.prompt_ids) or rec["prompt_id"] != self.prompt_ids[i]:
            raise RuntimeError(f"rows must be asked for in the shard's order (row {i}: {rec.get('prompt_id')!r})")
        self.next_row += 1
        if i not in self.results:
            self._label(self.chunks[self.chunk_of[i]])
        result = self.results.pop(i)
        if isinstance(result, BaseException):
            raise result
        return result

    def _label(self, chunk: List[int]) -> None:
        """``chunk`` as one batch; out of memory, its halves, down to one prompt (a batch that ran out of memory at
        64 did not have to fall to 64 batches of one); any other failure, its prompts one by one, so that a bad
        prompt costs only itself."""
        self.batches += 1
        failure = self._run(chunk)
        if failure is None:
            return
        self.failed += 1
        self.out_of_memory += failure == "memory"
        if len(chunk) == 1:
            return
        if failure == "memory":
            half = (len(chunk) + 1) // 2
            self._label(chunk[:half])
            self._label(chunk[half:])
            return
        for i in chunk:
            self.retried += 1
            self._run([i])

    def _run(self, chunk: List[int]) -> Optional[str]:
        """Labels ``chunk``: None when done (its results stored), else "memory" or "error". A lone prompt's error
        is stored for its row without its frames, and the allocator's cache is emptied only once the exception
        is gone: the frames hold the failed batch's tensors, which a cache emptied earlier could not give back."""
        try:
            for i, out in zip(chunk, self._call([self.input_ids[i] for i in chunk], chunk), strict=True):
                self.results[i] = out
            return None
        except Exception as err:  # noqa: BLE001 - halved, or retried prompt by prompt (_label)
            if sticky_device_error(err):  # the context is gone: no prompt can be retried in this process
                ids = [self.prompt_ids[i] for i in chunk]
                raise StickyBatch(f"the device failed on a batch of {len(ids)} prompt(s) "
                                  f"({type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]})",
                                  ids) from None
            kind = "memory" if out_of_memory(err) else "error"
            if len(chunk) == 1:
                self.results[chunk[0]] = _without_frames(err)
        _free_cuda(kind)
        return kind

    def _call(self, ids, rows):
        return self.label_batch(ids, rows) if self.with_rows else self.label_batch(ids)

    def counts(self) -> Dict[str, int]:
        """What the shard's batching cost: the label summary sums these over shards, and the stage's closing line
        says them (a batch retried prompt by prompt costs about batch_size times its time)."""
        return {"batches": self.batches, "batches_failed": self.failed, "batches_out_of_memory": self.out_of_memory,
                "prompts_retried_alone": self.retried}


# cuBLAS and cuDNN say it in their own words ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"):
# their workspace did not fit, as an out-of-memory, and the context stays usable, so not a sticky "CUDA error"
LIBRARY_OOM = ("cublas_status_alloc_failed", "cudnn_status_alloc_failed")


# Errors after which a CUDA context is unusable (every later kernel launch fails too): torch's and the driver's words.
STICKY = ("cuda error", "illegal memory access", "device-side assert", "unspecified launch failure",
          "cublas_status_execution_failed", "cublas_status_internal_error", "cudnn_status_execution_failed",
          "uncorrectable ecc error", "nccl error", "an illegal instruction was encountered",
          "misaligned address", "hip error")


def sticky_device_error(err: BaseException) -> bool:
    """An error after which the device is unusable in this process (not an out-of-memory: that one passes)."""
    text = f"{type(err).__name__}: {err}".lower()
    return not out_of_memory(err) and any(s in text for s in STICKY)


class StickyBatch(RuntimeError):
    """A batch's sticky device error: raised for the batch's rows at once (none can be retried in this process),
    with the prompt ids in flight; pipeline.executor.failures charges the worker's DeviceFailure to them."""

    def __init__(self, message: str, prompts=()):
        super().__init__(message)
        self.prompts = tuple(prompts)


def out_of_memory(err: BaseException) -> bool:
    """torch's CUDA out-of-memory, cuBLAS's or cuDNN's allocation failure, the CPU allocator's (a RuntimeError
    "can't allocate memory"), or Python's."""
    text = str(err).lower()
    return (isinstance(err, MemoryError) or "out of memory" in text or "can't allocate memory" in text
            or any(s in text for s in LIBRARY_OOM))


def _without_frames(err: BaseException) -> BaseException:
    """``err`` and the exceptions chained to it, their tracebacks (and so their frames' tensors) dropped."""
    seen, e = set(), err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return err


def _free_cuda(kind: str) -> None:
    if kind == "memory" and torch.cuda.is_available():
        torch.cuda.empty_cache()
