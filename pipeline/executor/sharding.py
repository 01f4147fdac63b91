"""How many prompts a shard holds: a shard is one worker's unit of work, so too few shards leave workers idle.

``prepare.shard_size`` alone made 2,000 prompts at 64 a shard into 32 shards, so 32 of 64 GPUs waited for the whole
label stage. The rule (:func:`shard_size_for`): the largest size at most ``prepare.shard_size`` that gives each
expected worker ``prepare.shards_per_worker`` shards, so that a worker that finishes early takes another and the
stage's tail is one short shard, not a long one; never under :data:`MIN_SHARD` prompts (a shard's fixed costs:
its write, checksum and manifest entry, and a label batch no larger than the shard) unless the prompts are fewer.
"""

from __future__ import annotations

import math

MIN_SHARD = 8


def shard_size_for(prompts: int, workers: int, max_size: int, per_worker: int) -> int:
    """Prompts per shard for ``prompts`` over ``workers`` expected workers (``per_worker`` 0: ``max_size``)."""
    if per_worker <= 0 or prompts <= 0:
        return max_size
    wanted = math.ceil(prompts / (max(1, workers) * per_worker))
    return max(1, min(max_size, max(MIN_SHARD, wanted)))
