"""What exact replay models of a DFlash draft; anything else is refused before any work.

Replay re-implements the draft's forward around dflash's own modules (pipeline.labelling.draft), so it is exact
only for what it re-implements: the loader's draft classes (pipeline.decoding.models owns the list), full, causal
(``is_causal``) and sliding-window (``layer_types`` / ``sliding_window``) attention layers, and DFlash2's causal
convolutions and candidate selector. A subclass may change forward or propose, so only the exact classes pass.
"""

from __future__ import annotations

from typing import Optional

from dflash.model import (
    CandidateSelector,
    DFlash2DraftModel,
    DFlashDraftModel,
    GroupedDynamicCausalConv,
    Qwen3DFlashAttention,
    Qwen3DFlashDecoderLayer,
)

from pipeline.decoding.models import draft_classes

DRAFT_CLASSES = draft_classes()
LAYER_TYPES = ("full_attention", "sliding_attention")


def _as_draft_config(config):
    """The config as the draft model sees it: its config class (Qwen3Config), which e.g. drops sliding_window
    unless use_sliding_window is set; a plain PretrainedConfig or a dict is converted."""
    cls = DFlashDraftModel.config_class
    if isinstance(config, cls):
        return config
    return cls.from_dict(config if isinstance(config, dict) else config.to_dict())


def _layers_unsupported(config) -> Optional[str]:
    """Layer types and sliding windows, read as Qwen3DFlashAttention.__init__ reads them."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if len(layer_types) < config.num_hidden_layers:
        return f"a layer_types list shorter than num_hidden_layers ({len(layer_types)} < {config.num_hidden_layers})"
    for i, kind in enumerate(layer_types[:config.num_hidden_layers]):
        if kind not in LAYER_TYPES:
            return f"the attention layer type {kind!r} (draft layer {i})"
        window = config.sliding_window
        if kind == "sliding_attention" and not (isinstance(window, int) and window >= 1):
            return f"a sliding_attention layer without a positive sliding_window (draft layer {i}: {window!r})"
    return None


def replay_unsupported_config(config) -> Optional[str]:
    """None if replay is exact for a draft with this config, else what it does not model. Reads the config only
    (class from ``architectures``; absent = DFlashDraftModel, what the loader builds), no weights: what the label
    stage's driver has."""
    config = _as_draft_config(config)
    archs = list(getattr(config, "architectures", None) or ["DFlashDraftModel"])
    if len(archs) != 1 or archs[0] not in DRAFT_CLASSES:
        return f"the draft architecture {archs} (known: {sorted(DRAFT_CLASSES)})"
    return _layers_unsupported(config)


def replay_unsupported(draft) -> Optional[str]:
    """None if replay is proven exact for this loaded draft, else what it does not model."""
    if type(draft) not in DRAFT_CLASSES.values():
        return f"the draft class {type(draft).__name__!r} (known: {sorted(DRAFT_CLASSES)})"
    for i, layer in enumerate(draft.layers):
        parts = [(layer, Qwen3DFlashDecoderLayer), (layer.self_attn, Qwen3DFlashAttention)]
        parts += [(conv, GroupedDynamicCausalConv) for conv in (layer.attention_conv, layer.mlp_conv)
                  if conv is not None]
        for module, cls in parts:
            if type(module) is not cls:
                return f"the draft module {type(module).__name__!r} (draft layer {i}; known: {cls.__name__})"
    if isinstance(draft, DFlash2DraftModel) and type(draft.candidate_selector) is not CandidateSelector:
        return f"the candidate selector {type(draft.candidate_selector).__name__!r}"
    return _layers_unsupported(draft.config)


def require_replayable(draft) -> None:
    """Raises ValueError, naming what replay does not model, for a draft it is not exact for."""
    unsupported = replay_unsupported(draft)
    if unsupported:
        raise ValueError(f"replay does not model {unsupported}; use exhaustive labelling")
