"""Model loading from local folders (what a hub id resolves to after download) and bundled names."""

import pytest
import torch

from pipeline.runtime.config import ModelConfig
from pipeline.decoding.engine import Engine
from pipeline.decoding.models import load_draft, load_target, resolve_device, resolve_dtype, resolve_location
from random_pair import make_pair, prompt


def test_local_folders_round_trip(tmp_path):
    target, draft = make_pair(0)
    target.save_pretrained(tmp_path / "t")
    draft.save_pretrained(tmp_path / "d")
    cfg = ModelConfig(target=str(tmp_path / "t"), draft=str(tmp_path / "d"))
    dev = resolve_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype("auto", dev)
    t2, d2 = load_target(cfg, dev, dtype), load_draft(cfg, dev, dtype)
    assert d2.block_size == draft.block_size and d2.target_layer_ids == draft.target_layer_ids
    assert not t2.training and not d2.training
    a = Engine(target, draft).prefill(prompt(0)).logits
    b = Engine(t2, d2).prefill(prompt(0)).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_unknown_bundled_name_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="bundled model 'bundled:nope'"):
        resolve_location("bundled:nope")
    assert resolve_location("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # hub ids pass through untouched


def test_a_dflash2_checkpoint_loads_as_dflash2(tmp_path):
    """The loader builds the class the checkpoint names: a DFlash2 draft keeps its selector and convolutions
    (loading it as DFlashDraftModel would silently drop them and propose by argmax)."""
    from dflash.model import DFlash2DraftModel

    target, draft = make_pair(0, dflash2=True)
    assert isinstance(draft, DFlash2DraftModel)
    draft.save_pretrained(tmp_path / "d")
    d2 = load_draft(ModelConfig(draft=str(tmp_path / "d")), torch.device("cpu"), torch.float32)
    assert type(d2) is DFlash2DraftModel
    sd, sd2 = draft.state_dict(), d2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
