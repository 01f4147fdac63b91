"""What a failure while decoding a prompt means for the run: the prompt's own, or its worker's device.

A prompt's own failure (an error this prompt triggers, an out-of-memory at batch 1) is a reject, and the rest of its
shard completes; such rejects are retried on a rerun (:data:`RETRIED_REASONS`: the shard is redone), since another
worker or a fix may label them. A broken device is not the prompt's: a sticky CUDA error poisons every later call in
that process, so its rejects would be every prompt the worker is given, and a worker that fails fast takes more
shards. So a sticky error, or :data:`FAILURES_IN_A_ROW` prompts failing one after another on one worker, raises
:class:`DeviceFailure` out of the shard: the Ray pool retires that worker and gives its shard to another one
(pipeline.executor.ray.pool_run.PoolRun.retire); in the driver's own process the stage fails, naming it.

A sticky error is charged to the prompts in flight when it struck (:attr:`DeviceFailure.prompts`: the one prompt, or
the batch), and the pool keeps the charges: a prompt charged on two different workers broke both devices, so it is
the prompt's fault, and its shard is redone with it rejected as ``breaks_device`` (:data:`PROMPT_BREAKS_DEVICE`, not
retried: a rerun would break another worker with it); a worker charged alone is restarted in a fresh process (a
new CUDA context) and retired only if it fails again (pipeline.executor.ray.pool_run.PoolRun.on_device_failure).
A worker whose failures of any kind (rejects with a retried reason, shard errors) run far above the other workers'
is taken out while the stage runs (:func:`far_above`).
"""

from __future__ import annotations

from typing import Optional

# What a reject's ``reason`` is when a rerun retries it (the shard is redone): failures of the decoding, not of the
# input. A deterministic bad input (prepare's too long, empty, untokenizable) is rejected before labelling and stays.
RETRIED_REASONS = ("decode_error", "out_of_memory")
# A prompt that broke the device of two different workers (a sticky error charged to it on each): rejected with the
# error, and kept so on a rerun (not retried: it would break a third worker).
PROMPT_BREAKS_DEVICE = "breaks_device"
# Prompts failing one after another on one worker before it counts as broken: a healthy worker's failures are rare
# and apart (one bad prompt, then the next labels); a broken device fails every prompt it is given.
FAILURES_IN_A_ROW = 4
class DeviceFailure(RuntimeError):
    """The worker's device failed: the shard goes to another worker, this one is restarted or retired.
    ``prompts``: the prompt ids in flight when a sticky error struck (charged to them); () when no prompt is to
    blame (prompts failing in a row)."""

    def __init__(self, message: str, prompts=()):
        super().__init__(message)
        self.prompts = tuple(prompts)

    def __reduce__(self):  # raised in a Ray actor, rebuilt in the driver with its prompts
        return (type(self), (str(self), self.prompts))


# How far above the other workers' a worker's failure rate must run, and on how many failures at least, before it is
# taken out while the stage runs: a healthy worker's rejects are the prompts' own and fall alike on every worker
# (a bad prompt fails wherever it goes), a broken one's are most of what it is given. Eight: two of the in-a-row
# limit, so that a shard with a few bad prompts of its own does not take a healthy worker out before the others
# have shown their rate.
FAR_ABOVE = 4.0
MIN_FAILURES = 2 * FAILURES_IN_A_ROW
# Shard-level errors (reading the prompts, writing the output) that take a worker out when the others have none
# or far fewer: a node with broken storage fails every shard it is given.
MIN_SHARD_ERRORS = 2


def far_above(mine: int, mine_of: int, others: int, others_of: int, min_count: int,
              limit: Optional[float] = None) -> bool:
    """Whether ``mine`` failures in ``mine_of`` tries run far above the other workers' ``others`` in ``others_of``:
    at least ``min_count``, over ``limit`` (a stage's max_reject_fraction) as a rate, and at least FAR_ABOVE times
    the others' rate (where the others have tried anything: else the count and the limit decide)."""
    if mine < min_count or mine_of <= 0:
        return False
    rate = mine / mine_of
    if limit is not None and rate <= limit:
        return False
    return others_of <= 0 or rate >= FAR_ABOVE * (others / others_of)


def sticky_device_error(err: BaseException) -> bool:
    """An error after which the device is unusable in this process (pipeline.labelling.batched's words for it;
    imported where a prompt failed, so that local.py does not import torch)."""
    from pipeline.labelling.batched import sticky_device_error as sticky

    return sticky(err)


class PromptFailures:
    """One worker's record of its prompts' failures: :meth:`failed` names a failed prompt's reject reason, or raises
    :class:`DeviceFailure` when the failure is the device's (sticky, or the ``limit``-th in a row)."""

    def __init__(self, worker: str, limit: int = FAILURES_IN_A_ROW):
        self.worker, self.limit = worker, limit
        self.in_a_row = 0
        self.last: Optional[str] = None

    def succeeded(self) -> None:
        self.in_a_row = 0

    def new_shard(self) -> None:
        """A shard starts: the count in a row starts again (the last prompts of one shard and the first of the next
        are not one run of failures; a broken device still fails ``limit`` prompts of the shard in a row)."""
        self.in_a_row = 0

    def failed(self, err: BaseException, prompt_id: Optional[str] = None) -> str:
        """The reject reason for ``prompt_id``'s failure ``err``; raises DeviceFailure when it is the device's."""
        from pipeline.labelling.batched import StickyBatch, out_of_memory

        if isinstance(err, StickyBatch):  # a batch's sticky error (labelling/batched.py): charged to the batch
            raise DeviceFailure(f"worker {self.worker}: {err}", err.prompts) from None
        detail = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"

        if sticky_device_error(err):
            raise DeviceFailure(f"worker {self.worker}: the device failed on prompt {prompt_id} ({detail})",
                                () if prompt_id is None else (prompt_id,)) from err
        if out_of_memory(err):  # the prompt's own size, at batch 1: not counted against the device
            return "out_of_memory"
        self.in_a_row += 1
        self.last = detail
        if self.in_a_row >= self.limit:
            raise DeviceFailure(f"worker {self.worker}: {self.in_a_row} prompts in a row failed (last: {detail})") \
                from err
        return "decode_error"
