"""The embedded default tiny target + DFlash draft pair (built by ``python -m pipeline.tiny.build``).

The committed artefacts live in ``pipeline/assets/tiny-target`` (Qwen3ForCausalLM + tokenizer)
and ``pipeline/assets/tiny-draft`` (dflash.model.DFlashDraftModel, block size 8).
A tool that stands alone: it imports no other pipeline sub-package, only transformers, dflash and tokenizers.
"""

from pipeline import ASSETS as ASSETS_DIR
TINY_TARGET_DIR = ASSETS_DIR / "tiny-target"
TINY_DRAFT_DIR = ASSETS_DIR / "tiny-draft"

__all__ = ["ASSETS_DIR", "TINY_DRAFT_DIR", "TINY_TARGET_DIR"]
