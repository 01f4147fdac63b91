"""The model cards of the tiny target and draft, written from the build's metadata and training history."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.tiny.configs import BLOCK_SIZE
from pipeline.tiny.tokenizer import CHAT_TEMPLATE, EOS, MASK


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _chat_share(history: dict) -> str:
    share = history["draft_data"].get("chat_prompt_share") or 0.0
    return f" ({share:.0%} of them ending at `<|assistant|>`, as a chat-templated prompt does)" if share else ""


def _loss_table(rows, keys) -> str:
    out = ["| " + " | ".join(keys) + " |", "|" + "---:|" * len(keys)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(out)


def _data_section(meta: dict) -> str:
    """The cards' Data section: per kind, its source, package (version), licence, sizes and share of the stream."""
    kinds = meta.get("kinds") or {}
    lines = ["## Data", ""]
    if meta.get("mix_chars"):
        lines.append(
            f"A mix of {len(kinds)} kinds of text. The training stream is {meta['mix_chars']:,} characters of "
            "training-split documents joined by `<|endoftext|>`; each kind's share of those characters is its "
            "weight (documents taken in a seeded order, repeated whole when a kind is short of its share, the last "
            "one cut at a line end), and the taken documents of all kinds are shuffled together"
            + (f"; {meta['chat_frac']:.0%} of each non-dialogue kind's share is chat-formatted continuations "
               "(`<|user|>` text up to a line end `<|assistant|>` the text after it `<|endoftext|>`), what a "
               "prompt of that kind looks like through the chat template" if meta.get("chat_frac") else "")
            + ". See `pipeline/tiny/corpus.py`."
        )
    else:
        lines.append("One kind of text; the training stream is its training-split documents once, in id order, "
                     "joined by `<|endoftext|>`.")
    lines += ["", "| kind | text | source | package (version) | licence | documents (train / held out) | "
              "characters (train / held out) | bytes (all) | weight | stream chars (passes) | stream tokens |",
              "|:---|:---|:---|:---|:---|---:|---:|---:|---:|---:|---:|"]
    for k, m in kinds.items():
        pk = ", ".join(f"`{p['name']}` {p['version'] or '(not installed)'}" for p in m["packages"]) or "none"
        st = m["stream"]
        lines.append(
            f"| {k} | {m['text']} | {m['source']} | {pk} | {m['licence']} | {m['train']['docs']:,} / "
            f"{m['heldout']['docs']:,} | {m['train']['chars']:,} / {m['heldout']['chars']:,} | "
            f"{m['all']['bytes']:,} | {m['weight']:.2f} | {st['chars']:,} ({st['passes']:.2f}) | "
            f"{st.get('tokens', 0):,} ({st.get('token_share', 0):.1%}) |"
        )
    lines += [""]
    for k, m in kinds.items():
        if m.get("copyright_file"):
            lines.append(
                f"- {k}: licence read from `{m['copyright_file']}` (sha256 {str(m['copyright_sha256'])[:12]}...)"
                + (f", which states \"{m['licence_evidence']}\"" if m.get("licence_verified") else
                   ": the expected statement was NOT found; check the file")
                + "."
            )
    lines.append(
        "- Split: a document is held out iff sha1(key) % 100 < its kind's percentage ("
        + ", ".join(f"{k} {m['heldout_percent']}%" for k, m in kinds.items())
        + "; key = `<kind>/<id>`, code's the bare relative path as before). Held-out documents are used only for "
        "the held-out loss and the bundled prompts (`prompts/<kind>-label.jsonl`, `prompts/<kind>-eval.jsonl`"
        + (", `prompts/stdlib-heldout.jsonl`" if "code" in kinds else "") + ")."
    )
    for k, msg in (meta.get("skipped_kinds") or {}).items():
        lines.append(f"- Skipped kind {k}: {msg}.")
    return "\n".join(lines) + "\n"


def _licence_tag(meta: dict) -> str:
    lic = {m["licence"].split(" ")[0] for m in (meta.get("kinds") or {}).values()}
    return "psf-2.0" if lic <= {"PSF-2.0"} else "other\nlicense_name: mixed (per kind of text, see Data)"


def write_cards(out: Path, meta: dict, history: dict, report_md: str | None) -> None:
    tgt, drf = meta["target"], meta["draft"]
    kinds_md = meta.get("kinds_md")
    tau_section = (
        "## Measured acceptance length\n\n"
        f"{meta['measure_desc']}\n\n{report_md}\n"
        + (f"\n### Per kind of text\n\nThe target's held-out loss (float16 weights, up to 128 windows of "
           f"{tgt['seq_len']} tokens of the kind's held-out documents) and the draft's mean tau:\n\n{kinds_md}\n"
           if kinds_md else "")
        if report_md
        else "## Measured acceptance length\n\nNot measured in this build (`--eval-prompts 0`).\n"
    )
    common = (
        f"Built by `{meta['command']}` (seed {meta['seed']}, torch {torch.__version__}, "
        f"{meta['threads']} CPU threads) in {meta['build_minutes']:.1f} minutes.\n\n"
        f"{meta['length_note']}\n\n"
        + _data_section(meta)
    )
    kinds = list(meta.get("kinds") or {})
    what = ("code model, the embedded default target of the\nblockpilot-pipeline (for tests and CPU smoke runs; "
            "it writes plausible but repetitive\nPython)") if kinds == ["code"] else (
            f"model of {len(kinds)} kinds of text ({', '.join(kinds)}), the embedded\ndefault target of the "
            "blockpilot-pipeline (for tests and CPU smoke runs)")
    lic = _licence_tag(meta)
    chat_desc = ("renders the message contents raw; this is a base model" if not meta.get("dialogue") else
                 "a user turn is `<|user|>` + content, an assistant turn `<|assistant|>` + content + "
                 "`<|endoftext|>`, the generation prompt `<|assistant|>`")
    target_card = f"""---
license: {lic}
library_name: transformers
pipeline_tag: text-generation
---
# tiny-target

A tiny Qwen3-architecture base {what}. Not useful for anything else.

{common}
## Model

- `Qwen3ForCausalLM`: hidden {tgt['hidden']}, {tgt['layers']} layers, 4 heads (2 KV heads,
  head_dim {tgt['hidden'] // 4}), intermediate {tgt['intermediate']}, tied embeddings,
  vocab {meta['vocab_size']}; **{tgt['params']:,} parameters**; weights stored in float16.
- Tokenizer: byte-level BPE (HF `tokenizers`), vocab {meta['vocab_size']}, special tokens
  `{EOS}` (id {meta['eos_id']}, eos and pad) and `{MASK}` (id {meta['mask_id']}, the DFlash mask
  token){", `<|user|>` and `<|assistant|>` (ids 2, 3)" if meta.get("dialogue") else ""}. Chat template
  ({chat_desc}):
  `{meta.get("chat_template", CHAT_TEMPLATE)}`.

## Training

{tgt['steps']} steps of AdamW (peak lr {tgt['lr']}, 4% warmup, cosine to 10%, weight decay
0.1, grad clip 1.0), batch {tgt['batch']} x {tgt['seq_len']} tokens (random windows of the
training stream), bf16 autocast on CPU; {history['target_seconds']:.0f} s;
{meta['train_tokens']:,} training tokens, {meta['val_tokens']:,} held-out tokens.

{_loss_table(history['target'], ['step', 'train_loss', 'val_loss', 'seconds'])}

{tau_section}
(draft: `../tiny-draft`)
"""
    draft_card = f"""---
license: {lic}
library_name: transformers
---
# tiny-draft

A DFlash block-diffusion draft (`dflash.model.DFlashDraftModel`, dflash 0.1.0) for
`../tiny-target`, trained block size B = {BLOCK_SIZE}. It has no embedding or lm_head of its own:
it reads the target's (frozen) embedding table for the block tokens and the target's lm_head
for logits, exactly as `dflash.model.dflash_generate` does.

{common}
## Model

- {drf['layers']} draft layer(s), hidden {tgt['hidden']}, intermediate {drf['intermediate']},
  context features from target layers {drf['layer_ids']} (`fc`: {len(drf['layer_ids'])} x
  {tgt['hidden']} -> {tgt['hidden']}); **{drf['params']:,} parameters**; float16 weights.
- config: `num_target_layers` = {tgt['layers']}, `dflash_config` =
  `{json.dumps(drf['dflash_config'])}`.

## Training

- Data: {history['draft_data']['sequences']:,} sequences = a prompt of
  {history['draft_data']['prompt_len_range'][0]}-{history['draft_data']['prompt_len_range'][1]}
  training-stream tokens{_chat_share(history)} + {history['draft_data']['new_tokens']} tokens generated by the
  float16-rounded target with greedy decoding ({history['draft_data']['generated_tokens']:,}
  generated tokens, {history['draft_data']['seconds']:.0f} s).
- Objective (DFlash / SpecForge recipe): {drf['anchors']} random anchors p per sequence in the
  generated region; block input `[x_p, {MASK} x {BLOCK_SIZE - 1}]` at positions p..p+{BLOCK_SIZE - 1};
  keys/values = context features of positions < p plus the block itself (no causal mask inside
  a block, blocks do not see each other); block position k >= 1 predicts x[p+k] with weight
  exp(-(k-1)/{drf['gamma']}); loss = sum(w CE) / sum(w).
- {drf['steps']} steps of AdamW (peak lr {drf['lr']}, 4% warmup, cosine to 10%, grad clip 1.0),
  {drf['batch']} sequences x {drf['anchors']} blocks per step, bf16 autocast;
  {history['draft_seconds']:.0f} s. `train_block_tau` = 1 + mean accepted prefix of the
  draft's argmax against the labels.

{_loss_table(history['draft'], ['step', 'loss', 'train_block_tau', 'seconds'])}

{tau_section}"""
    (out / "tiny-target" / "README.md").write_text(target_card)
    (out / "tiny-draft" / "README.md").write_text(draft_card)
