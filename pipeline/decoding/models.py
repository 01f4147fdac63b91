"""Loading the target, the DFlash draft and the tokenizer from a hub id, a local folder or a bundled name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from pipeline.runtime.config import ModelConfig

from pipeline import ASSETS
BUNDLED_PREFIX = "bundled:"


def resolve_location(location: str) -> str:
    """``bundled:NAME`` -> the shipped folder; anything else is a local folder or a hub id, as given."""
    if location.startswith(BUNDLED_PREFIX):
        path = ASSETS / location[len(BUNDLED_PREFIX):]
        if not path.is_dir():
            raise FileNotFoundError(f"bundled model {location!r} not found at {path}")
        return str(path)
    return location


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 is the serving dtype on GPUs; fp32 on CPU keeps T=0 runs bit-reproducible.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


@dataclass
class LoadedModels:
    target: Any
    draft: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    stop_token_ids: List[int]

    @property
    def block_size(self) -> int:
        return int(self.draft.block_size)

    @property
    def vocab_size(self) -> int:
        return int(self.target.get_output_embeddings().weight.shape[0])


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    location = resolve_location(cfg.tokenizer or cfg.target)
    revision = cfg.target_revision if cfg.tokenizer is None else None
    return AutoTokenizer.from_pretrained(location, revision=revision, trust_remote_code=cfg.trust_remote_code)


def load_target(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_location(cfg.target), revision=cfg.target_revision, dtype=dtype,
        trust_remote_code=cfg.trust_remote_code,
    )
    return model.to(device).eval()


DRAFT_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")  # the dflash.model classes a draft can be


def draft_classes() -> Dict[str, type]:
    """{name: class} of DRAFT_ARCHITECTURES: the classes the loader builds, and so the only ones replay labelling
    accepts. A function, so that importing the loader does not import dflash."""
    import dflash.model

    return {name: getattr(dflash.model, name) for name in DRAFT_ARCHITECTURES}


def draft_config(cfg: ModelConfig):
    """The draft's config as the loader reads it, without weights: the one place that reads it (B, the draft class,
    and what replay checks all come from here)."""
    from dflash.model import DFlashDraftModel

    return DFlashDraftModel.config_class.from_pretrained(resolve_location(cfg.draft), revision=cfg.draft_revision)


def load_draft(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    """The draft class its config names (``architectures``; none = DFlashDraftModel), so that a DFlash2 checkpoint
    gets its convolutions and candidate selector. Only dflash's own classes: no remote code."""
    location = resolve_location(cfg.draft)
    archs = draft_config(cfg).architectures or []
    name = archs[0] if len(archs) == 1 else "DFlashDraftModel"
    if name not in DRAFT_ARCHITECTURES:
        raise ValueError(f"draft {cfg.draft!r}: architecture {archs} is not a dflash draft "
                         f"({', '.join(DRAFT_ARCHITECTURES)})")
    model = draft_classes()[name].from_pretrained(location, revision=cfg.draft_revision, dtype=dtype)
    if model.mask_token_id is None:
        raise ValueError(f"draft {cfg.draft!r}: config has no dflash_config.mask_token_id")
    return model.to(device).eval()


def stop_token_ids(tokenizer, target=None) -> List[int]:
    """The eos ids of the tokenizer and of the target's generation config (Qwen3 uses two)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(target, "generation_config", None) if target is not None else None
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(i) for i in eos)
    return sorted(ids)


def load_models(cfg: ModelConfig) -> LoadedModels:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(cfg)
    target = load_target(cfg, device, dtype)
    draft = load_draft(cfg, device, dtype)
    return LoadedModels(target, draft, tokenizer, device, dtype, stop_token_ids(tokenizer, target))


def model_revision(location: str, revision: Optional[str]) -> str:
    """A provenance string: the hub revision if given, else the local folder's config hash."""
    if revision:
        return revision
    path = Path(resolve_location(location))
    cfg = path / "config.json"
    if cfg.is_file():
        import hashlib

        return "sha256:" + hashlib.sha256(cfg.read_bytes()).hexdigest()[:16]
    return "unknown"
