"""How many prompts a shard holds: a shard is one worker's unit of work, so too few shards leave workers idle.

``prepare.shard_size`` alone made 2,000 prompts at 64 a shard into 32 shards, so 32 of 64 GPUs waited for the whole
label stage. The rule (:func:`shard_size_for`): the largest size at most ``prepare.shard_size`` that gives each
expected worker ``prepare.shards_per_worker`` shards, so that a worker that finishes early takes another and the
stage's tail is one short shard, not a long one; never under :data:`MIN_SHARD` prompts (a shard's fixed costs:
its write, checksum and manifest entry, and a label batch no larger than the shard) unless the prompts are fewer.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, List, TypeVar

MIN_SHARD = 8
T = TypeVar("T")


def shard_size_for(prompts: int, workers: int, max_size: int, per_worker: int) -> int:
    """Prompts per shard for ``prompts`` over ``workers`` expected workers (``per_worker`` 0: ``max_size``)."""
    if per_worker <= 0 or prompts <= 0:
        return max_size
    wanted = math.ceil(prompts / (max(1, workers) * per_worker))
    return max(1, min(max_size, max(MIN_SHARD, wanted)))


def cut(rows: Iterable[T], size_for: Callable[[int], int]) -> Iterator[List[T]]:
    """Consecutive shards of a stream of rows, cut as ``size_for(number of rows)`` would cut the whole list, without
    holding it (prepare at a million prompts). ``size_for`` (:func:`shard_size_for` over fixed workers) grows with
    the rows up to its largest size, so once the rows read so far give that size no later row changes it and each
    shard goes as it fills; until then (few prompts: at most workers x per_worker x max_size rows) they wait for the
    total."""
    largest, held, size = size_for(1 << 62), [], 0  # the size of any number of rows at most
    for row in rows:
        held.append(row)
        size = size or (largest if size_for(len(held)) == largest else 0)
        if size and len(held) >= size:
            full = len(held) - len(held) % size  # the shards held until the size was known, then one at a time
            for i in range(0, full, size):
                yield held[i:i + size]
            held = held[full:]
    size = size or size_for(len(held))
    for i in range(0, len(held), size):
        yield held[i:i + size]
