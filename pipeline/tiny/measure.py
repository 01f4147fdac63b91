"""Measure acceptance length (tau) of a target/draft pair over block sizes, and check that
speculative decoding at T=0 is lossless against plain autoregressive greedy decoding.

tau(b; x) = mean over the verify steps of one generation of the tokens committed per step,
bonus included -- exactly ``mean(acceptance_lengths)`` of ``dflash_generate(...,
return_stats=True)``. dflash 0.1.0 times its stats with ``torch.cuda.synchronize()``, which
fails on a CPU-only torch, so the timer is swapped for ``time.perf_counter`` while decoding.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache


@dataclass
class PairDecode:
    """One speculative generation of the tiny pair, as the measurement needs it (the library's decode result is
    ``pipeline.decoding.engine.DecodeResult``)."""

    output_ids: torch.Tensor  # [1, prompt + new] (prompt included)
    committed: list[int]  # tokens committed per verify step (bonus included)

    @property
    def tau(self) -> float:
        return sum(self.committed) / len(self.committed) if self.committed else float("nan")


@contextlib.contextmanager
def cpu_safe_dflash_timer():
    """Replace dflash's CUDA-synchronising timer with a plain clock (CPU torch)."""
    import dflash.model as dm

    saved = dm._cuda_time
    dm._cuda_time = time.perf_counter
    try:
        yield
    finally:
        dm._cuda_time = saved


def dflash_decode(target, draft, input_ids, block_size, max_new_tokens, stop_token_ids):
    """One speculative generation with the reference dflash loop (T=0)."""
    from dflash.model import dflash_generate

    with cpu_safe_dflash_timer():
        stats = dflash_generate(
            draft,
            target,
            input_ids,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            temperature=0.0,
            block_size=block_size,
            return_stats=True,
        )
    return PairDecode(stats.output_ids, list(stats.acceptance_lengths))


@torch.inference_mode()
def autoregressive_greedy(target, input_ids, max_new_tokens, stop_token_ids):
    """Plain autoregressive greedy decoding, one token per target forward (no draft).

    Same length convention as dflash_generate: at most ``max_new_tokens`` new tokens, the
    stop token (if produced) included.
    """
    cache = DynamicCache(config=target.config)
    out = target(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    new = []
    stops = set(stop_token_ids or [])
    while True:
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        if tok in stops or len(new) >= max_new_tokens:
            break
        out = target(
            torch.tensor([[tok]], device=input_ids.device), past_key_values=cache, use_cache=True
        )
    return torch.cat([input_ids, torch.tensor([new], device=input_ids.device)], dim=1)


@dataclass
class PairReport:
    block_sizes: list[int]
    candidates: list[int]
    tau: dict[int, list[float]] = field(default_factory=dict)  # b -> per-prompt tau
    lossless: dict[int, list[bool]] = field(default_factory=dict)  # b -> per-prompt equality
    new_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def mean_tau(self, b: int) -> float:
        vals = [t for t in self.tau[b] if t == t]
        return sum(vals) / len(vals) if vals else float("nan")

    def argmax_share(self) -> dict[int, float]:
        """Share of prompts for which each candidate b is the argmax of tau (ties -> smaller b)."""
        n = len(self.tau[self.candidates[0]])
        wins = {b: 0 for b in self.candidates}
        for i in range(n):
            best = max(self.candidates, key=lambda b: (self.tau[b][i], -b))
            wins[best] += 1
        return {b: wins[b] / n for b in self.candidates}

    def all_lossless(self) -> bool:
        return all(all(v) for v in self.lossless.values())

    def format(self) -> str:
        n = len(self.tau[self.block_sizes[0]])
        lines = [
            f"prompts: {n}, mean new tokens: {sum(self.new_tokens) / max(1, len(self.new_tokens)):.1f}, "
            f"time: {self.seconds:.0f} s",
            "",
            "| b | mean tau | lossless |",
            "|---:|---:|:---|",
        ]
        for b in self.block_sizes:
            ok = sum(self.lossless[b])
            lines.append(f"| {b} | {self.mean_tau(b):.3f} | {ok}/{n} |")
        share = self.argmax_share()
        lines += [
            "",
            "argmax of tau over {" + ",".join(map(str, self.candidates)) + "} (ties to the smaller b):",
            "",
            "| b | share of prompts |",
            "|---:|---:|",
        ]
        for b in self.candidates:
            lines.append(f"| {b} | {share[b]:.3f} |")
        lines += ["", f"lossless on every prompt for every b: {self.all_lossless()}"]
        return "\n".join(lines)


DecodeFn = Callable[..., PairDecode]


def measure_pair(
    target,
    draft,
    prompts_ids: list[torch.Tensor],
    block_sizes=tuple(range(1, 17)),
    candidates=tuple(range(6, 11)),
    max_new_tokens: int = 128,
    stop_token_ids: list[int] | None = None,
    decode: DecodeFn = dflash_decode,
    log: Callable[[str], None] | None = None,
) -> PairReport:
    """Decode every prompt at every block size; collect tau and losslessness."""
    rep = PairReport(list(block_sizes), list(candidates))
    for b in rep.block_sizes:
        rep.tau[b], rep.lossless[b] = [], []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts_ids):
        ref = autoregressive_greedy(target, ids, max_new_tokens, stop_token_ids)
        rep.new_tokens.append(ref.shape[1] - ids.shape[1])
        for b in rep.block_sizes:
            res = decode(target, draft, ids, b, max_new_tokens, stop_token_ids)
            rep.tau[b].append(res.tau)
            rep.lossless[b].append(
                res.output_ids.shape == ref.shape and bool(torch.equal(res.output_ids.cpu(), ref.cpu()))
            )
        if log is not None and (i + 1) % 8 == 0:
            log(
                f"  measured {i + 1}/{len(prompts_ids)} prompts "
                f"({time.perf_counter() - t0:.0f} s); tau@{draft.block_size}="
                f"{sum(rep.tau[draft.block_size]) / len(rep.tau[draft.block_size]):.3f}"
                if draft.block_size in rep.tau
                else f"  measured {i + 1}/{len(prompts_ids)} prompts"
            )
    rep.seconds = time.perf_counter() - t0
    return rep
