"""Training the tiny target, and what both trainings share: seeding, the log line, the LR schedule, the step /
wall-time budget, AdamW parameter groups and the held-out loss."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import torch
import torch.nn.functional as F


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(progress: float, peak: float, warmup_frac: float = 0.04, floor: float = 0.1) -> float:
    """Linear warmup over the first `warmup_frac` of training, then cosine down to floor*peak."""
    if progress < warmup_frac:
        return peak * max(progress, 1e-3) / warmup_frac
    prog = (progress - warmup_frac) / (1 - warmup_frac)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


class Budget:
    """Training length: `steps`, optionally capped by `minutes` of wall time.

    Progress (which drives the LR schedule) is max(step / steps, elapsed / minutes), so a run
    on an idle machine is step-exact (deterministic), and a run on a busy (shared) machine
    still finishes its schedule -- with fewer steps -- within the time cap.
    """

    def __init__(self, steps: int, minutes: float | None):
        self.steps, self.seconds = steps, (minutes * 60 if minutes else None)
        self.t0 = time.perf_counter()
        self.steps_done = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def progress(self, step: int) -> float:
        p = step / self.steps
        if self.seconds:
            p = max(p, self.elapsed() / self.seconds)
        return p

    def schedule(self, opt, peak_lr: float):
        """Yield (step, progress) until the budget is spent, setting ``opt``'s learning rate for each step;
        ``steps_done`` is then the number of steps taken."""
        step = 0
        while True:
            prog = self.progress(step)
            if prog >= 1.0:
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(prog, peak_lr)
            yield step, prog
            step += 1
        self.steps_done = step


def param_groups(model, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def eval_lm(model, val_ids: torch.Tensor, seq: int, n_windows: int) -> float:
    model.eval()
    n = min(n_windows, (len(val_ids) - 1) // seq)
    losses = []
    for i in range(0, n, 16):
        starts = [j * seq for j in range(i, min(n, i + 16))]
        x = torch.stack([val_ids[s : s + seq + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1], use_cache=False).logits
        losses.append(
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()
            * len(starts)
        )
    model.train()
    return sum(losses) / max(1, n)


def train_target(cfg, train_ids, val_ids, args, history: dict):
    from transformers import Qwen3ForCausalLM

    seed_all(args.seed + 1)
    model = Qwen3ForCausalLM(cfg).float()
    model.train()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.target_lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 2)
    seq, bs, steps = args.seq_len, args.target_batch, args.target_steps
    hi = len(train_ids) - seq - 1
    budget = Budget(steps, args.target_minutes)
    t0 = budget.t0
    run = []
    for step, prog in budget.schedule(opt, args.target_lr):
        starts = torch.randint(0, hi, (bs,), generator=gen)
        x = torch.stack([train_ids[s : s + seq + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run.append(loss.item())
        last = budget.progress(step + 1) >= 1.0
        if (step + 1) % args.log_every == 0 or last:
            el = time.perf_counter() - t0
            tr = sum(run) / len(run)
            run = []
            msg = f"target step {step + 1}/{steps} train {tr:.3f} lr {lr_at(prog, args.target_lr):.2e}"
            rec = {"step": step + 1, "train_loss": round(tr, 4), "seconds": round(el, 1)}
            if (step + 1) % (args.log_every * 4) == 0 or last:
                vl = eval_lm(model, val_ids, seq, args.val_windows)
                rec["val_loss"] = round(vl, 4)
                msg += f" val {vl:.3f}"
            history["target"].append(rec)
            log(f"{msg} ({el:.0f} s, {(step + 1) * bs * seq / el:.0f} tok/s)")
    history["target_seconds"] = round(time.perf_counter() - t0, 1)
    history["target_steps_done"] = budget.steps_done
    model.eval()
    return model
