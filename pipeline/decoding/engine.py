"""The one decoding engine: DFlash speculative decoding, instrumented, with a prefill shared by every block size.

This is `dflash.model.dflash_generate` (dflash 0.1.0) split in two so that the candidates of one prompt share
one prefill:

* :meth:`Engine.prefill` runs the target once over the prompt and returns a :class:`PrefillState` holding the raw
  last-position logits (the policy's feature), the target KV cache and the draft's context features.
* :meth:`Engine.decode` runs the speculative loop at any block size ``b >= 1`` (``b = 1`` is plain autoregressive
  decoding). It appends to the shared target cache and crops it back to the prompt before returning, so the state
  is never consumed. The loop body mirrors dflash's step for step (same tensors, same order of RNG draws), which
  the tests check token for token and step for step.

It imports no Ray and works in a notebook. Timers synchronise CUDA only when the model is on CUDA (dflash's own
``return_stats`` calls ``torch.cuda.synchronize()`` unconditionally, which fails on a CPU-only torch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from dflash.model import (
    DFlash2DraftModel,
    _crop_to,
    _draft_value,
    _make_cache,
    _output_head,
    _raw_input_embeddings,
    _rejection_sample,
    _sample_probs,
    _sampling_probs,
    _validate_sampling,
    extract_context_feature,
    sample,
)

from pipeline.decoding.expected import dense_draft_probs, expected_committed
from pipeline.policy.step_rules import draft_confidence


@dataclass
class PrefillState:
    """What one prefill leaves for every decode of the same prompt."""

    input_ids: torch.Tensor  # [1, n]
    logits: torch.Tensor  # [V] raw last-position logits, before temperature or softmax
    target_cache: object  # DynamicCache holding exactly the n prompt positions
    context: torch.Tensor  # [1, n, len(target_layer_ids) * hidden]: the draft's context features
    prefill_seconds: float
    # [H] the target's final (normed) hidden state at the last position: logits = lm_head(hidden). What a folded
    # policy reads instead of the V logits (BlockSizePolicy.fold).
    hidden: Optional[torch.Tensor] = None

    @property
    def num_input_tokens(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass
class DecodeResult:
    output_ids: torch.Tensor  # [1, n + new_tokens], prompt included (as dflash returns it)
    num_input_tokens: int
    block_size: int
    committed: List[int] = field(default_factory=list)  # tokens committed per verify step, bonus included
    # Drafted tokens sent to the target per step (block_size - 1 on full steps; fewer with a step rule, or at the
    # max_new_tokens cut). The verify forward runs over verified + 1 positions.
    verified: List[int] = field(default_factory=list)
    # Per step, the expected tokens committed given the step's drafted tokens (pipeline.decoding.expected): at T > 0
    # the rejection sampling integrated out, at T = 0 what the step committed.
    expected_committed: List[float] = field(default_factory=list)
    step_rule: Optional[dict] = None  # the per-step rule's describe(), None for plain decoding at block_size
    draft_seconds: float = 0.0  # sum over steps; a step rule's own work (rule_seconds) included
    verify_seconds: float = 0.0
    # The first step's draft and verify seconds apart (its draft pass reads the whole prompt's context features, so
    # it costs more than the others: what the cost profile fits as a per-decode term), and the seconds a step rule
    # spent choosing (its confidences and verify_length, summed over steps; part of draft_seconds).
    first_step_seconds: tuple = (0.0, 0.0)
    rule_seconds: float = 0.0
    decode_seconds: float = 0.0
    stopped: bool = False  # ended on a stop token (else on max_new_tokens)
    # With decode(keep_context=True): the target's context features of every committed position, prompt included
    # ([1, final_start, F]); what exact greedy replay (pipeline.labelling.replay) feeds the draft.
    context: Optional[torch.Tensor] = None

    @property
    def new_ids(self) -> torch.Tensor:
        return self.output_ids[0, self.num_input_tokens:]

    @property
    def new_tokens(self) -> int:
        return int(self.output_ids.shape[1] - self.num_input_tokens)

    @property
    def steps(self) -> int:
        return len(self.committed)

    @property
    def tau(self) -> float:
        """Acceptance length: mean tokens committed per verify step, bonus included (>= 1).

        A generation with no verify step (the first token already stops it, or max_new_tokens == 1) has no
        acceptance to measure; it is reported as 1.0 with ``steps == 0`` so that consumers can filter it.
        """
        return sum(self.committed) / len(self.committed) if self.committed else 1.0

    @property
    def tau_expected(self) -> float:
        """tau with each step's committed tokens replaced by their expectation over the step's acceptance draws (its
        drafted tokens and the context kept): the same mean at T > 0, with less variance; = tau at T = 0."""
        e = self.expected_committed
        return sum(e) / len(e) if e else self.tau


class Engine:
    """DFlash decoding for one target/draft pair, batch size 1."""

    def __init__(self, target, draft, stop_token_ids: Optional[Sequence[int]] = None):
        self.target = target
        self.draft = draft
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids else None
        self.device = target.device
        self._cuda = self.device.type == "cuda"

    @property
    def trained_block_size(self) -> int:
        return int(self.draft.block_size)

    def now(self) -> float:
        """A clock that waits for queued CUDA work first (plain perf_counter on CPU)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> PrefillState:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
            raise ValueError(f"prefill takes one non-empty prompt, got input_ids of shape {tuple(input_ids.shape)}")
        input_ids = input_ids.to(self.device)
        n = input_ids.shape[1]
        cache = _make_cache(self.target.config)
        t0 = self.now()
        out = self.target(
            input_ids,
            position_ids=torch.arange(n, device=self.device)[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=True,
        )
        context = extract_context_feature(out.hidden_states, self.draft.target_layer_ids)
        _crop_to(cache, n)
        seconds = self.now() - t0
        return PrefillState(input_ids, out.logits[0, -1], cache, context, seconds, out.hidden_states[-1][0, -1].clone())

    def decode(
        self,
        state: PrefillState,
        block_size: int,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: Optional[int] = 0,
        keep_context: bool = False,
        step_rule=None,
    ) -> DecodeResult:
        """Decode one continuation at block size ``block_size``; ``seed`` makes T > 0 reproducible.

        ``step_rule`` (:mod:`pipeline.policy.step_rules`): the draft still proposes ``block_size`` tokens per step, and the
        rule picks how many of them the target verifies, from the draft's confidences. Exact like every mode."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if keep_context and block_size < 2:
            raise ValueError("keep_context needs block_size >= 2 (b = 1 computes no context features)")
        if step_rule is not None and block_size < 2:
            raise ValueError("a step rule needs block_size >= 2 (it cuts the drafted block)")
        _validate_sampling(temperature, top_p, top_k)
        try:
            if temperature > 0 and seed is not None:
                devices = [self.device] if self._cuda else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(seed)
                    return self._decode(state, block_size, max_new_tokens, temperature, top_p, top_k, keep_context,
                                        step_rule)
            return self._decode(state, block_size, max_new_tokens, temperature, top_p, top_k, keep_context,
                                step_rule)
        finally:
            # Leave the shared cache exactly as prefill left it, whatever happened.
            _crop_to(state.target_cache, state.num_input_tokens)

    @torch.inference_mode()
    def _decode(self, state, block_size, max_new_tokens, temperature, top_p, top_k, keep_context,
                step_rule=None) -> DecodeResult:
        # Mirrors dflash.model.dflash_generate after its prefill; comments mark where it differs.
        draft, target = self.draft, self.target
        num_input_tokens = state.num_input_tokens
        max_length = num_input_tokens + max_new_tokens
        output_ids = torch.full((1, max_length + 1), draft.mask_token_id, dtype=torch.long, device=self.device)
        position_ids = torch.arange(output_ids.shape[1], device=self.device).unsqueeze(0)
        past_key_values_target = state.target_cache
        past_key_values_draft = _make_cache(draft.config)
        embed_scale = float(_draft_value(draft.config, "input_embedding_scale", 1.0))
        head = _output_head(target)

        output_ids[:, :num_input_tokens] = state.input_ids
        output_ids[:, num_input_tokens] = sample(state.logits[None], temperature, top_p, top_k)
        target_hidden = state.context

        result = DecodeResult(output_ids, num_input_tokens, block_size,
                              step_rule=step_rule.describe() if step_rule is not None else None)
        kept = [state.context] if keep_context else None
        t_start = self.now()
        start = num_input_tokens
        stop_tokens = (
            torch.tensor(self.stop_token_ids, dtype=output_ids.dtype, device=self.device)
            if self.stop_token_ids else None
        )
        stopped = stop_tokens is not None and bool(torch.isin(output_ids[:, start], stop_tokens).any())
        while start + 1 < max_length and not stopped:
            t0 = self.now()
            verify_size = min(block_size, max_length - start)
            block_output_ids = output_ids[:, start:start + verify_size].clone()
            block_position_ids = position_ids[:, start:start + verify_size]
            draft_probs = draft_indices = draft_logits = None
            if verify_size > 1:
                noise_embedding = _raw_input_embeddings(target, block_output_ids, embed_scale)
                draft_hidden = draft(
                    target_hidden=target_hidden,
                    noise_embedding=noise_embedding,
                    position_ids=position_ids[:, start - target_hidden.shape[1]:start + verify_size],
                    past_key_values=past_key_values_draft,
                    use_cache=True,
                )[:, 1 - verify_size:, :]
                _crop_to(past_key_values_draft, start)
                if isinstance(draft, DFlash2DraftModel):
                    draft_tokens, draft_indices, draft_probs = draft.propose(
                        draft_hidden, block_output_ids[:, 0], head, temperature)
                    block_output_ids[:, 1:] = draft_tokens
                else:
                    draft_logits = draft.compute_logits(draft_hidden, head)
                    if temperature > 0:
                        draft_probs = _sampling_probs(draft_logits, temperature, top_p, top_k)
                        block_output_ids[:, 1:] = _sample_probs(draft_probs)
                    else:
                        block_output_ids[:, 1:] = torch.argmax(draft_logits, dim=-1)
                if step_rule is not None:  # not in dflash: verify only a prefix of the drafted block
                    tr = self.now()
                    if draft_probs is None and draft_logits is None:
                        draft_logits = draft.compute_logits(draft_hidden, head)
                    k = int(step_rule.verify_length(draft_confidence(draft_probs, draft_logits), result.committed))
                    if not 1 <= k <= verify_size - 1:
                        raise ValueError(f"step rule {step_rule.describe()} chose {k} of {verify_size - 1} tokens")
                    verify_size = k + 1
                    block_output_ids = block_output_ids[:, :verify_size]
                    block_position_ids = block_position_ids[:, :verify_size]
                    if draft_probs is not None:
                        draft_probs = draft_probs[:, :k]
                    if draft_indices is not None:
                        draft_indices = draft_indices[:, :k]
                    result.rule_seconds += self.now() - tr
            t1 = self.now()
            output = target(
                block_output_ids,
                position_ids=block_position_ids,
                past_key_values=past_key_values_target,
                use_cache=True,
                output_hidden_states=verify_size > 1,
            )
            if temperature > 0:
                target_probs = _sampling_probs(output.logits, temperature, top_p, top_k)
                if verify_size > 1:
                    acceptance_length, bonus = _rejection_sample(
                        block_output_ids[:, 1:], target_probs, draft_probs, draft_indices)
                else:
                    acceptance_length = 0
                    bonus = _sample_probs(target_probs[:, -1])[0]
            else:
                posterior = torch.argmax(output.logits, dim=-1)
                acceptance_length = int(
                    (block_output_ids[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0].item())
                bonus = posterior[:, acceptance_length][0]
            expected = None
            if temperature > 0:
                expected = 1.0 if verify_size == 1 else expected_committed(
                    target_probs[0], dense_draft_probs(draft_probs, draft_indices, target_probs.shape[-1])[0],
                    block_output_ids[0, 1:], max_length - start - 1)
            output_ids[:, start:start + acceptance_length + 1] = block_output_ids[:, :acceptance_length + 1]
            output_ids[:, start + acceptance_length + 1] = bonus
            produced = min(acceptance_length + 1, max_length - start - 1)
            if stop_tokens is not None:
                stop_indices = torch.isin(
                    output_ids[0, start + 1:start + produced + 1], stop_tokens).nonzero(as_tuple=True)[0]
                if stop_indices.numel() > 0:
                    produced = int(stop_indices[0].item()) + 1
                    stopped = True
            start += produced
            _crop_to(past_key_values_target, start)
            result.committed.append(int(produced))
            result.verified.append(verify_size - 1)
            result.expected_committed.append(float(produced) if expected is None else expected)
            if verify_size > 1:
                # With b >= 2, verify_size is >= 2 on every step (the loop needs start + 1 < max_length), so the
                # draft always sees fresh features; with b = 1 it never drafts and never reads them.
                target_hidden = extract_context_feature(output.hidden_states, draft.target_layer_ids)[:, :produced, :]
                if kept is not None:
                    kept.append(target_hidden)
            t2 = self.now()
            if len(result.verified) == 1:
                result.first_step_seconds = (t1 - t0, t2 - t1)
            result.draft_seconds += t1 - t0
            result.verify_seconds += t2 - t1

        result.output_ids = output_ids[:, :min(start + 1, max_length)]
        result.stopped = bool(stopped)
        if kept is not None:
            result.context = torch.cat(kept, dim=1)
        result.decode_seconds = self.now() - t_start
        return result


def greedy_reference(target, input_ids: torch.Tensor, max_new_tokens: int,
                     stop_token_ids: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Plain autoregressive greedy decoding with the target alone (no draft, no engine): the ground truth that
    speculative decoding at T = 0 must reproduce. Returns prompt + new ids, ending at the first stop token."""
    from transformers import DynamicCache

    ids = input_ids.to(target.device)
    if ids.dim() == 1:
        ids = ids[None]
    cache = DynamicCache(config=target.config)
    stops = set(stop_token_ids or [])
    with torch.inference_mode():
        out = target(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        new = []
        for _ in range(max_new_tokens):
            tok = int(out.logits[0, -1].argmax())
            new.append(tok)
            if tok in stops:
                break
            out = target(torch.tensor([[tok]], device=ids.device), past_key_values=cache, use_cache=True)
    return torch.cat([ids[0], torch.tensor(new, dtype=ids.dtype, device=ids.device)])[None]
