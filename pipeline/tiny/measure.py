"""Measure acceptance length (tau) of a target/draft pair over block sizes, and check that
speculative decoding at T=0 is lossless against plain autoregressive greedy decoding; per kind of
text too (:func:`measure_kinds`, :func:`format_kinds`: the build's per-kind held-out loss and tau).

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


def merge_reports(reports: list[PairReport]) -> PairReport:
    """One report over the prompts of several (same block sizes and candidates)."""
    first = reports[0]
    rep = PairReport(list(first.block_sizes), list(first.candidates))
    for b in rep.block_sizes:
        rep.tau[b] = [t for r in reports for t in r.tau[b]]
        rep.lossless[b] = [v for r in reports for v in r.lossless[b]]
    rep.new_tokens = [n for r in reports for n in r.new_tokens]
    rep.seconds = sum(r.seconds for r in reports)
    return rep


def measure_kinds(
    target,
    draft,
    prompts_by_kind: dict[str, list[torch.Tensor]],
    log: Callable[[str], None] | None = None,
    **kwargs,
) -> dict[str, PairReport]:
    """:func:`measure_pair` on each kind's prompts (its held-out eval set), in the given order."""
    out = {}
    for kind, ids in prompts_by_kind.items():
        if not ids:
            continue
        out[kind] = measure_pair(target, draft, ids, log=log, **kwargs)
        if log is not None:
            log("  " + kind_line(kind, out[kind]))
    return out


def kind_line(kind: str, rep: PairReport, heldout_loss: float | None = None) -> str:
    """One log line: ``kind code: held-out loss 4.25, tau@4 3.03 @8 4.53 @16 5.57 (n prompts, new tokens)``."""
    show = [b for b in (4, 8, 12, 16) if b in rep.tau]
    taus = " ".join(f"@{b} {rep.mean_tau(b):.2f}" for b in show)
    loss = f"held-out loss {heldout_loss:.3f}, " if heldout_loss is not None else ""
    n = len(rep.tau[rep.block_sizes[0]])
    mean_new = sum(rep.new_tokens) / max(1, len(rep.new_tokens))
    return (f"kind {kind}: {loss}tau {taus} ({n} prompts, {mean_new:.0f} new tokens, lossless "
            f"{rep.all_lossless()})")


def format_kinds(reports: dict[str, PairReport], losses: dict[str, float] | None = None,
                 show=(2, 4, 6, 8, 10, 12, 16)) -> str:
    """Markdown: per kind, the target's held-out loss and the draft's mean tau at some block sizes, and the share
    of prompts whose argmax of tau over the candidates is each candidate."""
    losses = losses or {}
    kinds = list(reports)
    if not kinds:
        return ""
    bs = [b for b in show if b in reports[kinds[0]].tau]
    cands = reports[kinds[0]].candidates
    head = ["kind", "held-out loss", "prompts", "mean new tokens"] + [f"tau@{b}" for b in bs]
    lines = ["| " + " | ".join(head) + " |", "|:---|" + "---:|" * (len(head) - 1)]
    for k in kinds:
        r = reports[k]
        n = len(r.tau[r.block_sizes[0]])
        loss = f"{losses[k]:.3f}" if k in losses else ""
        lines.append(f"| {k} | {loss} | {n} | {sum(r.new_tokens) / max(1, len(r.new_tokens)):.1f} | "
                     + " | ".join(f"{r.mean_tau(b):.2f}" for b in bs) + " |")
    lines += ["", "argmax of tau over {" + ",".join(map(str, cands)) + "} per kind (share of prompts):", "",
              "| kind | " + " | ".join(f"b={b}" for b in cands) + " |",
              "|:---|" + "---:|" * len(cands)]
    for k in kinds:
        sh = reports[k].argmax_share()
        lines.append(f"| {k} | " + " | ".join(f"{sh[b]:.2f}" for b in cands) + " |")
    return "\n".join(lines)
