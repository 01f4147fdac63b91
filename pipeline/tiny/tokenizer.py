"""The tiny pair's tokenizer: byte-level BPE with an end-of-text token (eos and pad) and the DFlash mask token,
saved as a transformers fast tokenizer with a raw chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch

EOS = "<|endoftext|>"
MASK = "<|mask|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)


def train_tokenizer(train_files, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in train_files), trainer=trainer, length=len(train_files))
    return tok


def save_tokenizer(tok, out_dir: Path):
    """Save as a transformers fast tokenizer; the chat template goes into tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        additional_special_tokens=[MASK],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir, save_jinja_files=False)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE  # keep it in tokenizer_config.json whatever the version
    cfg["mask_token"] = MASK
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    stray = out_dir / "chat_template.jinja"
    if stray.exists():
        stray.unlink()
    return hf


def encode_files(tok, files, eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch([f.text for f in files], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)
