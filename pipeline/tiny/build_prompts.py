"""Step 6 of the tiny build, the bundled prompt sets written under ``<out>/prompts``: per kind, the label and eval sets
of :mod:`pipeline.tiny.prompts` cut from the kind's held-out documents (code: the first ``--n-prompts`` of the
historical ``stdlib-heldout.jsonl``, which keeps all ``--n-stdlib-prompts`` of its prompts), and
``prompt_sets.json``, which lists them with each kind's source and licence. Prompt lengths are counted in tokens of
the freshly trained tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.tiny import corpus as tcorpus
from pipeline.tiny import data as tdata
from pipeline.tiny import prompts as tprompts
from pipeline.tiny.provenance import provenance
from pipeline.tiny.training import log


def write_prompts(heldout_files, hf_tok, out_dir: Path, n: int, seed: int) -> list[dict]:
    count = lambda s: len(hf_tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    prompts = tdata.cut_prompts(heldout_files, count, n=n, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "stdlib-heldout.jsonl", "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"id": p["id"], "text": p["text"]}, ensure_ascii=False) + "\n")
    return prompts


def write_prompt_sets(pdir: Path, kinds: list[str], held_by: dict, hf_tok, dialogue: bool, n_prompts: int,
                      n_stdlib_prompts: int, seed: int) -> dict:
    """Every kind's prompt files and ``prompt_sets.json`` in ``pdir``; returns what the latter lists per kind."""
    prompt_sets: dict = {}
    count = lambda s: len(hf_tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    for k in kinds:
        spec = tcorpus.KINDS[k]
        if k == "code":
            stdlib = write_prompts(held_by[k], hf_tok, pdir, n_stdlib_prompts, seed)
            log(f"prompts: {len(stdlib)} stdlib-heldout prompts")
            cut = stdlib[: n_prompts]
        else:
            cut = tprompts.cut_kind_prompts(spec, held_by[k], count, n_prompts, seed)
        info = tprompts.write_kind_sets(pdir, k, cut)
        info.update({"source": spec.source, "licence": provenance(spec)["licence"]})
        prompt_sets[k] = info
        log(f"prompts {k}: {info['label']} label + {info['eval']} eval ({info['mean_tokens']} tokens mean)")
    (pdir / "prompt_sets.json").write_text(json.dumps(
        {"split": "eval iff int(sha256(id)[:8], 16) % 10 == 0 (pipeline.data.sources.bundled_split)",
         "chat_template": "roles" if dialogue else "raw", "kinds": prompt_sets}, indent=1) + "\n")
    return prompt_sets


__all__ = ["write_prompt_sets", "write_prompts"]
