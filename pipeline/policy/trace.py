"""One prompt's per-step trace (label schema v3's ``trace_*`` columns), what pipeline.policy.simulate replays.

Plain Python, no torch: ``blockpilot validate`` checks every row's trace with :meth:`Trace.check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence


@dataclass
class Trace:
    """One prompt's per-step trace at drafted block size ``block_size`` (label schema v3's ``trace_*`` columns).

    ``match[i]`` and ``confidence[i]`` belong to the step that would start at offset i of the new tokens (start
    s = n + i), for i = 0 .. new_tokens - 2: the last new token never starts a step. ``confidence[i]`` holds
    vs - 1 values; it is empty where the engine cannot draft the block (DFlash2's convolution longer than vs) and
    fails, which pipeline.policy.simulate then does too."""

    block_size: int
    match: List[int]
    confidence: List[Sequence[float]]
    stopped: bool

    @property
    def new_tokens(self) -> int:
        return len(self.match) + 1

    @classmethod
    def from_row(cls, row: Dict[str, Any]) -> Optional["Trace"]:
        """The trace of a label row (a dict of its columns); None where the row has none (null columns)."""
        if row.get("trace_block_size") is None:
            return None
        return cls(int(row["trace_block_size"]), list(row["trace_match"]), list(row["trace_confidence"]),
                   bool(row["trace_stopped"]))

    def check(self, max_new_tokens: Optional[int] = None) -> None:
        """ValueError naming the first inconsistency: lists of different lengths, a match outside its block, a
        confidence outside [0, 1] (NaN included), and with the generation cap: more new tokens than the cap, fewer
        without a stop token, or a block not min(b_max, max_new_tokens - i) - 1 wide (nor empty)."""
        if self.block_size < 2:
            raise ValueError(f"trace block size {self.block_size} < 2")
        if len(self.confidence) != len(self.match):
            raise ValueError(f"{len(self.match)} trace_match values for {len(self.confidence)} confidence lists")
        if max_new_tokens is not None and (self.new_tokens > max_new_tokens
                                           or (not self.stopped and self.new_tokens != max_new_tokens)):
            raise ValueError(f"the trace has {self.new_tokens} new tokens ({'' if self.stopped else 'not '}stopped), "
                             f"max_new_tokens {max_new_tokens}")
        for i, (m, conf) in enumerate(zip(self.match, self.confidence)):
            width = len(conf)
            if max_new_tokens is not None and width not in (0, min(self.block_size, max_new_tokens - i) - 1):
                raise ValueError(f"{width} confidences at offset {i}, expected "
                                 f"{min(self.block_size, max_new_tokens - i) - 1} (b_max {self.block_size})")
            if not 0 <= m <= width:
                raise ValueError(f"match {m} at offset {i} outside 0..{width}")
            if not all(0.0 <= x <= 1.0 for x in conf):
                raise ValueError(f"a confidence outside [0, 1] at offset {i}: {list(conf)}")
