"""Training the tiny DFlash draft: its data (greedy continuations of the float16-rounded target, with the target's
hidden states), the block sampling of the DFlash objective, and the training loop."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.tiny.configs import BLOCK_SIZE
from pipeline.tiny.training import Budget, log, param_groups, seed_all


@torch.inference_mode()
def greedy_batch(model, input_ids: torch.Tensor, n_new: int) -> torch.Tensor:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1)
    toks = [nxt]
    for _ in range(n_new - 1):
        out = model(nxt[:, None], past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
        toks.append(nxt)
    return torch.stack(toks, dim=1)


@torch.inference_mode()
def make_draft_data(target, train_ids: torch.Tensor, eos_id: int, layer_ids, args, history, anchor_ends=None):
    """Groups of equal-length sequences: prompt (training text) + greedy target continuation.

    Returns a list of dicts with ids [G, L] (int32), feats [G, L, k*H] (bfloat16: the target
    hidden states of `layer_ids`, concatenated as dflash's extract_context_feature does),
    prompt_len P and last [G] (index of the last usable token: first eos or L-1).

    ``anchor_ends`` (a build with a chat template): positions in ``train_ids`` of the generation
    prompt token (``<|assistant|>``); a share ``args.draft_chat_frac`` of each group's prompts ends
    exactly at one of them, as a chat-formatted prompt of the pipeline does. None (the stdlib-only
    build): every prompt ends at a random position, with the random draws of before.
    """
    from dflash.model import extract_context_feature

    rng = np.random.default_rng(args.seed + 3)
    groups = []
    t0 = time.perf_counter()
    use_anchors = anchor_ends is not None and len(anchor_ends) > 0 and getattr(args, "draft_chat_frac", 0) > 0
    anchor_np = np.asarray(anchor_ends) if use_anchors else None
    for gi in range(args.gen_groups):
        P = int(rng.integers(args.gen_prompt_min, args.gen_prompt_max + 1))
        starts = rng.integers(0, len(train_ids) - P - 1, size=args.gen_batch)
        if use_anchors:
            ok = anchor_np[(anchor_np >= P - 1) & (anchor_np < len(train_ids) - 1)]
            n_chat = int(round(args.draft_chat_frac * args.gen_batch))
            if len(ok) and n_chat:
                starts[:n_chat] = rng.choice(ok, size=n_chat) - P + 1
        prompts = torch.stack([train_ids[s : s + P] for s in starts.tolist()])
        cont = greedy_batch(target, prompts, args.gen_new)
        ids = torch.cat([prompts, cont], dim=1)
        L = ids.shape[1]
        last = torch.full((ids.shape[0],), L - 1, dtype=torch.long)
        is_eos = cont == eos_id
        has = is_eos.any(dim=1)
        first = is_eos.float().argmax(dim=1) + P
        last[has] = first[has]
        feats = []
        for j in range(0, ids.shape[0], 32):
            out = target(ids[j : j + 32], use_cache=False, output_hidden_states=True)
            feats.append(extract_context_feature(out.hidden_states, layer_ids).to(torch.bfloat16))
        groups.append(
            {"ids": ids.to(torch.int32), "feats": torch.cat(feats), "P": P, "last": last}
        )
        if (gi + 1) % max(1, args.gen_groups // 8) == 0 or gi == args.gen_groups - 1:
            log(
                f"draft data: group {gi + 1}/{args.gen_groups} (P={P}, L={L}, "
                f"{time.perf_counter() - t0:.0f} s)"
            )
    n_seq = sum(g["ids"].shape[0] for g in groups)
    n_gen = sum(int((g["last"] - g["P"] + 1).sum()) for g in groups)
    history["draft_data"] = {
        "chat_prompt_share": float(args.draft_chat_frac) if use_anchors else 0.0,
        "sequences": n_seq,
        "generated_tokens": n_gen,
        "prompt_len_range": [args.gen_prompt_min, args.gen_prompt_max],
        "new_tokens": args.gen_new,
        "decoding": "greedy (T=0)",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return groups


def sample_example(group, rows, n_anchors: int, B: int, gen: torch.Generator, mask_id: int):
    """Anchors, block inputs, labels, weights, positions and attention mask for one batch."""
    ids = group["ids"][rows].long()  # [S, L]
    S, L = ids.shape
    P = group["P"]
    last = group["last"][rows]  # [S]
    pos = torch.arange(L)
    # anchor p needs p >= P (generated region) and p + 1 <= last (at least one label)
    valid = (pos[None, :] >= P) & (pos[None, :] <= (last[:, None] - 1))
    weights = valid.float() + 1e-12 * (~valid).float()
    replace = int(valid.sum(1).min()) < n_anchors
    anchors = torch.multinomial(weights, n_anchors, replacement=replace, generator=gen)  # [S, A]
    anchors, _ = anchors.sort(dim=1)
    offs = torch.arange(B)
    blk_pos = anchors[:, :, None] + offs  # [S, A, B]
    blk_pos_c = blk_pos.clamp(max=L - 1)
    tokens = torch.gather(ids, 1, blk_pos_c.view(S, -1)).view(S, n_anchors, B)
    block_in = torch.full_like(tokens, mask_id)
    block_in[:, :, 0] = tokens[:, :, 0]
    labels = tokens[:, :, 1:]  # [S, A, B-1]
    label_ok = blk_pos[:, :, 1:] <= last[:, None, None]
    # attention: block i sees context keys j < p_i and its own block (no causal mask)
    q = n_anchors * B
    ctx_vis = pos[None, None, :] < anchors[:, :, None]  # [S, A, L]
    ctx_vis = ctx_vis[:, :, None, :].expand(S, n_anchors, B, L).reshape(S, q, L)
    blk_id = torch.arange(n_anchors).repeat_interleave(B)
    blk_vis = (blk_id[:, None] == blk_id[None, :])[None].expand(S, q, q)
    attn = torch.cat([ctx_vis, blk_vis], dim=2)[:, None]  # [S, 1, q, L + q]
    position_ids = torch.cat([pos[None].expand(S, L), blk_pos.view(S, q)], dim=1)
    return block_in.view(S, q), labels, label_ok, attn, position_ids


def train_draft(target, groups, dcfg, mask_id: int, args, history):
    from dflash.model import DFlashDraftModel

    seed_all(args.seed + 4)
    draft = DFlashDraftModel(dcfg).float()
    draft.train()
    for p in target.parameters():
        p.requires_grad_(False)
    emb = target.get_input_embeddings().weight  # frozen, shared
    head = target.lm_head
    B = BLOCK_SIZE
    gamma = args.gamma
    w_k = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / gamma)  # k=1..B-1 -> exp(-(k-1)/g)
    opt = torch.optim.AdamW(param_groups(draft, 0.01), lr=args.draft_lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 5)
    steps = args.draft_steps
    budget = Budget(steps, args.draft_minutes)
    t0 = budget.t0
    run_loss, run_acc = [], []
    sizes = torch.tensor([g["ids"].shape[0] for g in groups], dtype=torch.float)
    for step, prog in budget.schedule(opt, args.draft_lr):
        gi = int(torch.multinomial(sizes, 1, generator=gen))
        group = groups[gi]
        rows = torch.randperm(group["ids"].shape[0], generator=gen)[: args.draft_batch]
        block_in, labels, label_ok, attn, position_ids = sample_example(
            group, rows, args.anchors, B, gen, mask_id
        )
        S, A = labels.shape[:2]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            noise = F.embedding(block_in, emb)
            hidden = draft(
                position_ids=position_ids,
                attention_mask=attn,
                noise_embedding=noise,
                target_hidden=group["feats"][rows],
            )
            hidden = hidden.view(S, A, B, -1)[:, :, 1:]
            logits = draft.compute_logits(hidden, head).float()
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        ).view(S, A, B - 1)
        w = w_k.view(1, 1, -1) * label_ok.float()
        loss = (w * ce).sum() / w.sum().clamp_min(1e-6)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels) & label_ok
            # expected accepted length per block under greedy verification (prefix of hits)
            acc_len = (hit.int().cumprod(dim=-1).sum(-1)).float().mean().item()
        run_loss.append(loss.item())
        run_acc.append(acc_len)
        last = budget.progress(step + 1) >= 1.0
        if (step + 1) % args.log_every == 0 or last:
            el = time.perf_counter() - t0
            rec = {
                "step": step + 1,
                "loss": round(sum(run_loss) / len(run_loss), 4),
                "train_block_tau": round(1 + sum(run_acc) / len(run_acc), 3),
                "seconds": round(el, 1),
            }
            history["draft"].append(rec)
            log(
                f"draft step {step + 1}/{steps} loss {rec['loss']:.3f} "
                f"block tau(train, B={B}) {rec['train_block_tau']:.2f} ({el:.0f} s)"
            )
            run_loss, run_acc = [], []
    history["draft_seconds"] = round(time.perf_counter() - t0, 1)
    history["draft_steps_done"] = budget.steps_done
    draft.eval()
    return draft
