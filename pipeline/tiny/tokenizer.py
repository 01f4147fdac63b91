"""The tiny pair's tokenizer: byte-level BPE with an end-of-text token (eos and pad) and the DFlash mask token,
saved as a transformers fast tokenizer with a chat template.

Two chat templates:

- ``CHAT_TEMPLATE`` (a build with no dialogue kind, e.g. ``--kinds code``): renders the message contents raw,
  as a base model reads text; the generation prompt adds nothing.
- ``ROLE_CHAT_TEMPLATE`` (a build whose mix has a dialogue kind, the default): a user turn is
  ``<|user|>`` + content, an assistant turn ``<|assistant|>`` + content + ``<|endoftext|>``, other roles the content
  raw, and the generation prompt is ``<|assistant|>``. ``<|user|>`` and ``<|assistant|>`` are then special tokens
  (ids 2 and 3). :func:`render_chat` is the same rendering in Python (what the training text of a dialogue kind is;
  ``tests/unit/test_tiny_corpus.py`` checks the two agree).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

EOS = "<|endoftext|>"
MASK = "<|mask|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)
ROLE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}" + EOS +
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
BASE_SPECIALS = (EOS, MASK)
ROLE_SPECIALS = (EOS, MASK, USER, ASSISTANT)


def render_chat(turns, add_generation_prompt: bool = False) -> str:
    """``ROLE_CHAT_TEMPLATE`` in Python: ``turns`` = ``[{"role", "content"}, ...]``."""
    out = []
    for t in turns:
        if t["role"] == "user":
            out.append(USER + t["content"])
        elif t["role"] == "assistant":
            out.append(ASSISTANT + t["content"] + EOS)
        else:
            out.append(t["content"])
    if add_generation_prompt:
        out.append(ASSISTANT)
    return "".join(out)


def _training_pieces(texts, specials):
    """The tokenizer's training text: each text as is, or, where it holds special-token strings, the pieces
    between them (the BPE trainer does not split special tokens out, and would learn merges of them)."""
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    for text in texts:
        if pattern.search(text):
            for piece in pattern.split(text):
                if piece:
                    yield piece
        else:
            yield text


def train_tokenizer(train_files, vocab_size: int, special_tokens=BASE_SPECIALS):
    """Byte-level BPE on the texts of ``train_files`` (objects with ``.text``); specials get ids 0, 1, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _training_pieces((f.text for f in train_files), special_tokens)
    tok.train_from_iterator(texts, trainer=trainer, length=len(train_files))
    return tok


def save_tokenizer(tok, out_dir: Path, chat_template: str = CHAT_TEMPLATE):
    """Save as a transformers fast tokenizer; the chat template goes into tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        additional_special_tokens=[t for t in ROLE_SPECIALS[1:] if tok.token_to_id(t) is not None],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = chat_template
    hf.save_pretrained(out_dir, save_jinja_files=False)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = chat_template  # keep it in tokenizer_config.json whatever the version
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
