"""What a failure while decoding a prompt means for the run: the prompt's own, or its worker's device.

A prompt's own failure (an error this prompt triggers, an out-of-memory at batch 1) is a reject, and the rest of its
shard completes; such rejects are retried on a rerun (:data:`RETRIED_REASONS`: the shard is redone), since another
worker or a fix may label them. A broken device is not the prompt's: a sticky CUDA error poisons every later call in
that process, so its rejects would be every prompt the worker is given, and a worker that fails fast takes more
shards. So a sticky error, or :data:`FAILURES_IN_A_ROW` prompts failing one after another on one worker, raises
:class:`DeviceFailure` out of the shard: the Ray pool retires that worker and gives its shard to another one
(pipeline.executor.ray.pool_run.PoolRun.retire); in the driver's own process the stage fails, naming it.
"""

from __future__ import annotations

from typing import Optional

# What a reject's ``reason`` is when a rerun retries it (the shard is redone): failures of the decoding, not of the
# input. A deterministic bad input (prepare's too long, empty, untokenizable) is rejected before labelling and stays.
RETRIED_REASONS = ("decode_error", "out_of_memory")
# Prompts failing one after another on one worker before it counts as broken: a healthy worker's failures are rare
# and apart (one bad prompt, then the next labels); a broken device fails every prompt it is given.
FAILURES_IN_A_ROW = 4
# Errors after which a CUDA context is unusable (every later kernel launch fails too): torch's and the driver's words.
STICKY = ("cuda error", "illegal memory access", "device-side assert", "unspecified launch failure",
          "cublas_status_execution_failed", "cublas_status_internal_error", "cudnn_status_execution_failed",
          "uncorrectable ecc error", "nccl error", "an illegal instruction was encountered",
          "misaligned address", "hip error")


class DeviceFailure(RuntimeError):
    """The worker's device failed, not the shard's input: the shard goes to another worker, this one is retired."""


def sticky_device_error(err: BaseException) -> bool:
    """An error after which the device is unusable in this process (not an out-of-memory: that one passes)."""
    from pipeline.labelling.batched import out_of_memory  # (torch: imported where a prompt failed, not by local.py)

    text = f"{type(err).__name__}: {err}".lower()
    return not out_of_memory(err) and any(s in text for s in STICKY)


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

    def failed(self, err: BaseException) -> str:
        detail = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
        from pipeline.labelling.batched import out_of_memory

        if sticky_device_error(err):
            raise DeviceFailure(f"worker {self.worker}: the device failed ({detail})") from err
        if out_of_memory(err):  # the prompt's own size, at batch 1: not counted against the device
            return "out_of_memory"
        self.in_a_row += 1
        self.last = detail
        if self.in_a_row >= self.limit:
            raise DeviceFailure(f"worker {self.worker}: {self.in_a_row} prompts in a row failed (last: {detail})") \
                from err
        return "decode_error"
