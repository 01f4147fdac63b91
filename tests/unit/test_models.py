"""Model loading from local folders (what a hub id resolves to after download) and bundled names; refusals of a
checkpoint that does not match its class and of a location that is not there."""

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipeline import ASSETS
from pipeline.runtime.config import ModelConfig
from pipeline.decoding.engine import Engine
from pipeline.decoding.models import (ModelNotFound, draft_config, is_hub_id, load_draft, load_target, load_tokenizer,
                                      locate, resolve_device, resolve_dtype)
from random_pair import make_pair, prompt

CPU, F32 = torch.device("cpu"), torch.float32


def rewritten_copy(src, dst, edit):
    """A copy of the checkpoint folder ``src`` whose model.safetensors is rewritten by ``edit(state_dict)`` (in
    place), with the file's metadata kept: what a bad conversion or a hand-edited checkpoint looks like."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    with safe_open(str(f), framework="pt") as fh:
        metadata = fh.metadata()
    sd = load_file(f)
    edit(sd)
    save_file(sd, f, metadata=metadata)
    return dst


def rename(old, new):
    def edit(sd):
        sd[new] = sd.pop(old)
    return edit


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


def test_the_bundled_pair_loads_as_stored():
    """The bundled target ties lm_head to the embeddings and stores only the embeddings: no complaint, and the two
    share one tensor equal to the stored one."""
    cfg = ModelConfig()
    target, draft = load_target(cfg, CPU, F32), load_draft(cfg, CPU, F32)
    stored = load_file(ASSETS / "tiny-target" / "model.safetensors")
    assert "lm_head.weight" not in stored
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert torch.equal(target.lm_head.weight, stored["model.embed_tokens.weight"].float())
    fc = load_file(ASSETS / "tiny-draft" / "model.safetensors")["fc.weight"]
    assert torch.equal(draft.fc.weight, fc.float())


def test_a_renamed_draft_tensor_is_refused(tmp_path):
    """transformers alone warns and initialises fc.weight at random (labels then come out garbage)."""
    bad = rewritten_copy(ASSETS / "tiny-draft", tmp_path / "d", rename("fc.weight", "fc_renamed.weight"))
    with pytest.raises(ValueError) as err:
        load_draft(ModelConfig(draft=str(bad)), CPU, F32)
    assert str(err.value) == (f"model.draft: {bad}: the checkpoint does not match DFlashDraftModel: "
                              f"missing 1: fc.weight; unexpected 1: fc_renamed.weight")


def test_a_renamed_target_tensor_is_refused(tmp_path):
    q = "model.layers.1.self_attn.q_proj.weight"
    bad = rewritten_copy(ASSETS / "tiny-target", tmp_path / "t", rename(q, q.replace("q_proj", "q_renamed")))
    with pytest.raises(ValueError, match=rf"^model\.target: {bad}: the checkpoint does not match Qwen3ForCausalLM: "
                                         rf"missing 1: {q}; unexpected 1: "):
        load_target(ModelConfig(target=str(bad)), CPU, F32)


def test_a_tensor_of_the_wrong_size_is_refused_naming_both_shapes(tmp_path):
    def narrow(sd):
        sd["fc.weight"] = sd["fc.weight"][:, :-1].contiguous()

    bad = rewritten_copy(ASSETS / "tiny-draft", tmp_path / "d", narrow)
    shapes = r"size-mismatched 1: fc\.weight \(checkpoint \[192, 575\], model \[192, 576\]\)"
    with pytest.raises(ValueError, match=shapes):
        load_draft(ModelConfig(draft=str(bad)), CPU, F32)


def test_the_first_five_names_are_shown_with_the_count(tmp_path):
    def drop_layer(sd):
        for k in [k for k in sd if k.startswith("layers.1.")]:
            del sd[k]

    bad = rewritten_copy(ASSETS / "tiny-draft", tmp_path / "d", drop_layer)
    with pytest.raises(ValueError) as err:
        load_draft(ModelConfig(draft=str(bad)), CPU, F32)
    listed = str(err.value).split("missing 11: ", 1)[1]
    assert listed.count("layers.1.") == 5 and listed.endswith(", ...")


@pytest.mark.parametrize("bad", ["/nonexistent/draft", "not a model", "a/b/c", "bundled:nope"])
def test_a_location_that_is_not_there_is_one_line_naming_the_key(bad, tmp_path):
    """Every reader of a location refuses it the same way (the CLI prints a FileNotFoundError without traceback)."""
    cfg = ModelConfig(target=bad, draft=bad)
    readers = {"model.draft": [lambda: draft_config(cfg), lambda: load_draft(cfg, CPU, F32)],
               "model.target": [lambda: load_tokenizer(cfg), lambda: load_target(cfg, CPU, F32)]}
    for key, calls in readers.items():
        for call in calls:
            with pytest.raises(ModelNotFound) as err:
                call()
            assert isinstance(err.value, FileNotFoundError)
            message = str(err.value)
            assert message.startswith(f"{key}: ") and repr(bad) in message and "\n" not in message
    with pytest.raises(ModelNotFound, match="^model.tokenizer: '/nonexistent/draft' is neither a local folder nor a "
                                            "hub id"):
        load_tokenizer(ModelConfig(tokenizer="/nonexistent/draft"))


def test_locations_are_told_apart(tmp_path):
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").mkdir()
    assert locate("bundled:tiny-draft", "v1", "model.draft") == locate("bundled:tiny-draft", None, "k")
    assert locate("bundled:tiny-draft", None, "k").kind == "bundled"
    here = str(tmp_path / "owner" / "name")
    assert locate(here, "v1", "k").kind == "local" and locate(here, "v1", "k").revision is None
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("z-lab/Qwen3-8B-DFlash-b16")
    assert not any(is_hub_id(x) for x in ["gpt2", "/abs/path", "a/b/c", "bad id/x", "./rel"])


def test_a_dflash2_checkpoint_loads_as_dflash2(tmp_path):
    """The loader builds the class the checkpoint names: a DFlash2 draft keeps its selector and convolutions
    (loading it as DFlashDraftModel would silently drop them and propose by argmax)."""
    from dflash.model import DFlash2DraftModel

    target, draft = make_pair(0, dflash2=True)
    assert isinstance(draft, DFlash2DraftModel)
    draft.save_pretrained(tmp_path / "d")
    d2 = load_draft(ModelConfig(draft=str(tmp_path / "d")), CPU, F32)
    assert type(d2) is DFlash2DraftModel
    sd, sd2 = draft.state_dict(), d2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_a_draft_of_another_architecture_is_refused():
    with pytest.raises(ValueError, match=r"^model\.draft: bundled:tiny-target: architecture \['Qwen3ForCausalLM'\] "
                                         r"is not a dflash draft"):
        load_draft(ModelConfig(draft="bundled:tiny-target"), CPU, F32)


def test_a_draft_folder_without_config_is_refused(tmp_path):
    """dflash's config class would build a default Qwen3Config from an empty folder, without a word."""
    with pytest.raises(ModelNotFound, match=f"^model.draft: {tmp_path} has no config.json$"):
        draft_config(ModelConfig(draft=str(tmp_path)))
