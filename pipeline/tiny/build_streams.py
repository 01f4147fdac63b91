"""The token streams of the tiny build: the mixed training stream and each kind's held-out documents encoded as one
id tensor each, documents joined by ``<|endoftext|>`` (the target trains on random windows of the first), with the
tokens of each kind counted for the report; and the mixed held-out stream the target's training logs its val loss on.
"""

from __future__ import annotations

import torch


def encode_docs(tok, docs, eos_id: int) -> tuple[torch.Tensor, dict[str, int]]:
    """The documents' ids joined by eos (as tokenizer.encode_files), and the tokens of each kind."""
    ids: list[int] = []
    per_kind: dict[str, int] = {}
    for d, enc in zip(docs, tok.encode_batch([d.text for d in docs], add_special_tokens=False)):
        ids.extend(enc.ids)
        ids.append(eos_id)
        kind = getattr(d, "kind", "code")
        per_kind[kind] = per_kind.get(kind, 0) + len(enc.ids) + 1
    return torch.tensor(ids, dtype=torch.long), per_kind


def mixed_val_ids(val_by_kind: dict[str, torch.Tensor], weights: dict[str, float], seq: int, n_windows: int):
    """The held-out stream that training logs its val loss on: eval_lm reads consecutive windows from the start,
    so each kind contributes round(weight * n_windows) windows' worth of its own held-out tokens, in kind order."""
    parts = []
    for k, ids in val_by_kind.items():
        n = max(1, round(weights[k] * n_windows)) * seq
        parts.append(ids[:n])
    return torch.cat(parts + [parts[-1][:1]])


__all__ = ["encode_docs", "mixed_val_ids"]
